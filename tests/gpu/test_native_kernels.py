"""The native CUDA kernels of csrc/ against their torch reference (dyngen_core/storage/qformat).

The kernels follow the reference operation for operation (same butterfly order, IEEE division,
round-half-even, fp16 scale rounding), so codes, scales and dequantized rows must be equal bit
for bit. Needs CUDA, nvcc and ninja: skipped without CUDA; on a CUDA machine without a toolkit
the skip message says what is missing.
"""

from __future__ import annotations

import pytest
import torch

from dyngen_core.config import ModelConfig
from dyngen_core.plan import PageCopy
from dyngen_core.storage import native
from dyngen_core.storage.hadamard import rotation_signs
from dyngen_core.storage.qformat import QuantFormat, dequantize, quantize
from dyngen_core.storage.quant import QuantStorage

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@pytest.fixture(scope="module")
def kernels() -> native.NativeKernels:
    reason = native._unavailable_reason()
    if reason is not None:
        pytest.skip(f"native kernels unavailable: {reason}")
    loaded = native.load_native()
    assert loaded is not None, "csrc/ failed to build; the warning logged above says why"
    return loaded


def outlier_rows(tokens: int, heads: int, head_dim: int, dtype: torch.dtype,
                 seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    rows = torch.randn(tokens, heads, head_dim, generator=gen)
    rows = rows * torch.exp(torch.randn(heads, head_dim, generator=gen) * 0.6)
    rows[:, :, 3] += 20.0
    rows[::7] = 0.0  # all-zero rows: scale 0
    return rows.to(dtype).cuda()


def empty_pages(num_slots: int, heads: int, head_dim: int,
                fmt: QuantFormat) -> tuple[torch.Tensor, torch.Tensor]:
    # Filled with garbage so that a slot the kernel should skip is detectably untouched.
    codes = torch.randint(0, 255, (num_slots, heads, fmt.packed_bytes(head_dim)),
                          dtype=torch.uint8, device="cuda").view(fmt.code_dtype)
    scales = torch.randn(num_slots, heads, head_dim // 32, device="cuda").half()
    return codes, scales


def mismatch(a: torch.Tensor, b: torch.Tensor) -> str:
    diff = (a.view(torch.uint8) != b.view(torch.uint8)) if a.element_size() == 1 else (a != b)
    return f"{int(diff.sum())} of {diff.numel()} differ"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize(("key_bits", "value_bits"), [(8, 8), (6, 6), (4, 4), (8, 4)])
def test_quantize_write_equals_reference(kernels: native.NativeKernels, dtype: torch.dtype,
                                         head_dim: int, key_bits: int, value_bits: int) -> None:
    heads, tokens, num_slots = 3, 37, 64
    key_fmt, value_fmt = QuantFormat(key_bits), QuantFormat(value_bits)
    keys = outlier_rows(tokens, heads, head_dim, dtype, seed=head_dim + key_bits)
    values = outlier_rows(tokens, heads, head_dim, dtype, seed=1 + value_bits)
    slots = torch.randperm(num_slots)[:tokens].cuda()
    slots[5] = -1  # padding: must be skipped
    key_codes, key_scales = empty_pages(num_slots, heads, head_dim, key_fmt)
    value_codes, value_scales = empty_pages(num_slots, heads, head_dim, value_fmt)
    before = [t.clone() for t in (key_codes, key_scales, value_codes, value_scales)]
    signs = rotation_signs(32).cuda()
    kernels.quantize_write(keys, values, slots, key_codes, key_scales, value_codes,
                           value_scales, signs, key_bits, value_bits)
    torch.cuda.synchronize()
    written = slots >= 0
    for rows, fmt, codes, scales, old_codes, old_scales in (
        (keys, key_fmt, key_codes, key_scales, before[0], before[1]),
        (values, value_fmt, value_codes, value_scales, before[2], before[3]),
    ):
        ref_codes, ref_scales = quantize(rows.cpu(), fmt, signs.cpu())
        target = slots[written].cpu()
        got_scales, got_codes = scales.cpu()[target], codes.cpu()[target]
        assert torch.equal(got_scales, ref_scales[written.cpu()]), mismatch(
            got_scales, ref_scales[written.cpu()])
        assert torch.equal(got_codes, ref_codes[written.cpu()]), mismatch(
            got_codes, ref_codes[written.cpu()])
        untouched = torch.ones(num_slots, dtype=torch.bool)
        untouched[target] = False
        assert torch.equal(codes.cpu()[untouched], old_codes.cpu()[untouched])
        assert torch.equal(scales.cpu()[untouched], old_scales.cpu()[untouched])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits", [8, 6, 4])
def test_dequantize_gather_equals_reference(kernels: native.NativeKernels, dtype: torch.dtype,
                                            bits: int) -> None:
    num_pages, page_size, heads, head_dim = 6, 16, 2, 128
    fmt = QuantFormat(bits)
    signs = rotation_signs(32).cuda()
    rows = outlier_rows(num_pages * page_size, heads, head_dim, torch.float32, seed=bits)
    codes, scales = quantize(rows, fmt, signs)
    codes = codes.reshape(num_pages, page_size, heads, -1).contiguous()
    scales = scales.reshape(num_pages, page_size, heads, -1).contiguous()
    page_table = torch.tensor([[4, 0, 5], [2, 2, 1]], dtype=torch.int32, device="cuda")
    out = torch.empty(2, 3 * page_size, heads, head_dim, dtype=dtype, device="cuda")
    kernels.dequantize_gather(codes, scales, page_table, signs, bits, out)
    index = page_table.long().cpu()
    expected = dequantize(codes.cpu()[index], scales.cpu()[index], fmt, signs.cpu(), dtype)
    expected = expected.reshape(out.shape)
    assert torch.equal(out.cpu(), expected), mismatch(out.cpu(), expected)


def test_copy_pages_equals_sequential_torch_copies(kernels: native.NativeKernels) -> None:
    tensors = [torch.randint(-128, 127, (8, 16, 3, 36), dtype=torch.int8, device="cuda"),
               torch.randn(8, 16, 3, 2, device="cuda").half(),  # 12-byte slots: 4-byte path
               torch.randint(0, 255, (8, 16, 1, 3), dtype=torch.uint8, device="cuda")]
    copies = [PageCopy(0, 2, 5), PageCopy(3, 4, 16), PageCopy(2, 5, 16),  # chain through 2
              PageCopy(6, 0, 7), PageCopy(1, 6, 1)]
    expected = [t.clone() for t in tensors]
    for c in copies:
        for t in expected:
            t[c.dst, : c.num_slots] = t[c.src, : c.num_slots].clone()
    kernels.copy_pages(tensors, copies)
    torch.cuda.synchronize()
    for got, want in zip(tensors, expected, strict=True):
        assert torch.equal(got, want)


@pytest.mark.parametrize("mode", ["q8", "q6", "q4"])
def test_storage_native_and_torch_paths_agree(kernels: native.NativeKernels, mode: str) -> None:
    config = ModelConfig(architecture="LlamaForCausalLM", vocab_size=32, hidden_size=128,
                         intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                         head_dim=64)
    devices = [torch.device("cuda")] * 2
    fast = QuantStorage(config, 5, 16, torch.bfloat16, devices, mode)
    reference = QuantStorage(config, 5, 16, torch.bfloat16, devices, mode, use_native=False)
    assert fast._native is kernels and reference._native is None
    keys = outlier_rows(50, 2, 64, torch.bfloat16, seed=9)
    values = outlier_rows(50, 2, 64, torch.bfloat16, seed=10)
    slots = torch.randperm(80)[:50].cuda()
    copies = [PageCopy(0, 4, 9), PageCopy(4, 1, 16)]
    for storage in (fast, reference):
        storage.write(1, keys, values, slots)
        storage.copy_pages(copies)
    table = torch.tensor([[3, 1, 4, 0]], dtype=torch.int32, device="cuda")
    for got, want in zip(fast.gather(1, table), reference.gather(1, table), strict=True):
        assert torch.equal(got, want), mismatch(got, want)
    assert fast.nbytes() == reference.nbytes()
