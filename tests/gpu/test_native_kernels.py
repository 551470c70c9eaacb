"""The native CUDA kernels of csrc/ against their torch reference (dyngen_core/storage/qformat).

The kernels follow the reference operation for operation (IEEE division, round-half-even, fp16
scale rounding); only the rotation rounds differently (a warp butterfly there, a float32 matrix
product here). So scales agree to one fp16 step, codes agree except where a value sits on a
rounding boundary (then by one step), and dequantized rows agree to float rounding. Page copies
must be exact. Needs CUDA, nvcc and ninja: skipped without CUDA; on a CUDA machine without a
toolkit the skip message says what is missing.
"""

from __future__ import annotations

import pytest
import torch

from dyngen_core.config import ModelConfig
from dyngen_core.engine.plan import PageCopy
from dyngen_core.kv.quant import native
from dyngen_core.kv.quant.format import QuantFormat, dequantize, quantize
from dyngen_core.kv.quant.hadamard import hadamard_matrix, rotation_signs
from dyngen_core.kv.quant.storage import QuantStorage

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
ROTATION = hadamard_matrix(32)
MAX_CODE_MISMATCH = 1e-3  # fraction of codes allowed one step off (rounding-boundary values)


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


def assert_same_quantization(codes: torch.Tensor, scales: torch.Tensor,
                             ref_codes: torch.Tensor, ref_scales: torch.Tensor,
                             fmt: QuantFormat) -> None:
    """Native and reference quantization agree up to float32 rounding of the rotation.

    Rarely, rounding moves a group's scale: by one fp16 step, or to the opposite sign where the
    largest positive and negative values tie in magnitude. Both results are then within one step
    of the input, so within two steps of each other. Groups with identical scales must have
    identical codes except for values that sat on a rounding boundary.
    """
    torch.testing.assert_close(scales.float().abs(), ref_scales.float().abs(), rtol=2e-3,
                               atol=1e-7)
    same_scale = scales.view(torch.int16) == ref_scales.view(torch.int16)
    assert float(same_scale.float().mean()) >= 0.95, "too many group scales differ"
    restored = dequantize(codes, scales, fmt, ROTATION, torch.float32)
    expected = dequantize(ref_codes, ref_scales, fmt, ROTATION, torch.float32)
    groups = (restored - expected).reshape(*scales.shape, 32).norm(dim=-1)
    step = ref_scales.float().abs()
    assert bool((groups <= 2 * 32**0.5 * step * 1.01 + 1e-6).all()), "a group differs by > 2 steps"
    group_bytes = codes.view(torch.uint8).reshape(*scales.shape, -1)
    ref_group_bytes = ref_codes.view(torch.uint8).reshape(*scales.shape, -1)
    differ = float((group_bytes != ref_group_bytes)[same_scale].float().mean())
    assert differ <= MAX_CODE_MISMATCH, f"{differ:.2%} of code bytes differ"


def assert_close_rows(got: torch.Tensor, want: torch.Tensor) -> None:
    """Rows equal up to the rounding of the rotation and of the output dtype."""
    exact = want.dtype == torch.float32
    scale = float(want.float().abs().max()) + 1e-6
    torch.testing.assert_close(got.float(), want.float(), rtol=1e-4 if exact else 1e-2,
                               atol=(1e-5 if exact else 1e-2) * scale)


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
        ref_codes, ref_scales = quantize(rows.cpu(), fmt, ROTATION)
        target = slots[written].cpu()
        assert_same_quantization(codes.cpu()[target], scales.cpu()[target],
                                 ref_codes[written.cpu()], ref_scales[written.cpu()], fmt)
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
    codes, scales = quantize(rows, fmt, ROTATION)
    codes = codes.reshape(num_pages, page_size, heads, -1).contiguous()
    scales = scales.reshape(num_pages, page_size, heads, -1).contiguous()
    page_table = torch.tensor([[4, 0, 5], [2, 2, 1]], dtype=torch.int32, device="cuda")
    out = torch.empty(2, 3 * page_size, heads, head_dim, dtype=dtype, device="cuda")
    kernels.dequantize_gather(codes, scales, page_table, signs, bits, out)
    index = page_table.long().cpu()
    expected = dequantize(codes.cpu()[index], scales.cpu()[index], fmt, ROTATION, dtype)
    assert_close_rows(out.cpu(), expected.reshape(out.shape))


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
    fast = QuantStorage(config, 5, 16, torch.bfloat16, devices, mode, triton_write=False)
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
    index = table.long()
    ref_pages = reference.layers[1]
    for got, want, scales in zip(fast.gather(1, table), reference.gather(1, table),
                                 (ref_pages.key_scales[index], ref_pages.value_scales[index]),
                                 strict=True):
        # Per group of 32: the rotation is orthogonal, so a group's error norm is the same
        # rotated or not; allow two quantization steps (see assert_same_quantization) plus
        # bfloat16 rounding of the output.
        diff = (got.float() - want.float()).reshape(1, 64, 2, 2, 32).norm(dim=-1)
        norm = want.float().reshape(1, 64, 2, 2, 32).norm(dim=-1)
        step = scales.float().abs().reshape(1, 64, 2, 2)
        assert bool((diff <= 2 * 32**0.5 * step * 1.01 + 1e-2 * norm + 1e-6).all())
        assert float((diff > 1e-2 * norm + 1e-6).float().mean()) <= 0.05
    assert fast.nbytes() == reference.nbytes()
