"""Quantized KV storage (q8 / q6 / q4): the rotation, the codec, and the paged storage on CPU.

Round-trip thresholds come from uniform quantization: with step ``s = max|v| / 2**(bits-1)``
over a rotated group of 32 (near-Gaussian after the Hadamard, max|v| ~ 2.2 sigma), the RMS error
is ``s / sqrt(12)``, i.e. a relative error of about 0.005 / 0.020 / 0.080 for 8 / 6 / 4 bits.
The thresholds add ~35% margin; quantizing the same outlier-heavy data without the rotation
gives 0.011 / 0.043 / 0.17, so a lost rotation fails them.
"""

from __future__ import annotations

import pytest
import torch

from dyngen_core.config import ModelConfig
from dyngen_core.engine.plan import PageCopy
from dyngen_core.kv.cache import make_storage
from dyngen_core.kv.quant.format import (
    QuantFormat,
    dequantize,
    hadamard_matrix,
    inv_sqrt,
    pack,
    quantize_rotated,
    rotate,
    rotation_signs,
    round_query_codes,
    unpack,
    unrotate,
    walsh_hadamard,
)
from dyngen_core.kv.quant.storage import MODE_BITS, QuantStorage

MODES = tuple(MODE_BITS)
MAX_RELATIVE_ERROR = {8: 0.007, 6: 0.027, 4: 0.11}
ROTATION = hadamard_matrix(32)


def model_config(num_layers: int = 2, num_kv_heads: int = 2, head_dim: int = 64) -> ModelConfig:
    return ModelConfig(architecture="LlamaForCausalLM", vocab_size=32, hidden_size=128,
                       intermediate_size=64, num_layers=num_layers, num_heads=4,
                       num_kv_heads=num_kv_heads, head_dim=head_dim)


def keys_with_outliers(tokens: int, heads: int, head_dim: int, seed: int = 0) -> torch.Tensor:
    """Key-like rows: per-channel scales and offsets, and a few huge outlier channels per head."""
    gen = torch.Generator().manual_seed(seed)
    channel_scale = torch.exp(torch.randn(heads, head_dim, generator=gen) * 0.6)
    offset = torch.randn(heads, head_dim, generator=gen) * 0.5
    rows = torch.randn(tokens, heads, head_dim, generator=gen) * channel_scale + offset
    for head in range(heads):
        channels = torch.randperm(head_dim, generator=gen)[:3]
        rows[:, head, channels] = rows[:, head, channels] * 4 + 15
    return rows


def quantize(rows: torch.Tensor, fmt: QuantFormat) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows [..., head_dim] rotated, then quantized: the torch codec end to end."""
    return quantize_rotated(rotate(rows, ROTATION), fmt)


def relative_error(approx: torch.Tensor, exact: torch.Tensor) -> float:
    return float((approx.float() - exact.float()).norm() / exact.float().norm())


def test_walsh_hadamard_matches_sylvester_matrix() -> None:
    sylvester = torch.ones(1, 1)
    while sylvester.shape[0] < 32:
        sylvester = torch.cat((torch.cat((sylvester, sylvester), 1),
                               torch.cat((sylvester, -sylvester), 1)), 0)
    x = torch.randn(5, 64)
    expected = (x.reshape(5, 2, 32) @ sylvester.T).reshape(5, 64)
    torch.testing.assert_close(walsh_hadamard(x, 32), expected)


@pytest.mark.parametrize("n", [32, 64, 128])
def test_rotation_is_orthogonal_and_inverted_by_unrotate(n: int) -> None:
    matrix = hadamard_matrix(n)
    torch.testing.assert_close(matrix @ matrix.T, torch.eye(n), atol=1e-6, rtol=0)
    # R = H diag(s) / sqrt(n): the butterfly of the sign-flipped input, normalized.
    x = torch.randn(7, 3, 2 * n)
    flipped = x.reshape(-1, 2, n) * rotation_signs(n)
    butterfly = walsh_hadamard(flipped, n).reshape(x.shape) / n**0.5
    rotated = rotate(x, matrix)
    torch.testing.assert_close(rotated, butterfly, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(unrotate(rotated, matrix), x, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(rotated.norm(), x.norm(), rtol=1e-5, atol=0)



def test_rotation_entries_are_signs_over_root_n() -> None:
    """Every entry of R is exactly +-inv_sqrt(n): the Triton kernels rotate 16-bit queries as a
    tensor-core dot with sign(R) and scale by inv_sqrt(32) after
    (`attention.triton.key_loop.rotated_queries`)."""
    matrix = hadamard_matrix(32)
    assert torch.equal(matrix.abs(), torch.full_like(matrix, inv_sqrt(32)))
    assert torch.equal(torch.sign(matrix) * inv_sqrt(32), matrix)

def test_rotation_signs_are_fixed_and_mixed() -> None:
    signs = rotation_signs(32)
    assert torch.equal(signs, rotation_signs(32))
    assert set(signs.tolist()) == {-1.0, 1.0}
    assert 8 <= int((signs > 0).sum()) <= 24  # not a constant pattern: a DC offset gets spread
    with pytest.raises(ValueError, match="power of two"):
        rotation_signs(48)


@pytest.mark.parametrize("bits", [4, 6, 8])
def test_pack_unpack_round_trips_every_code(bits: int) -> None:
    fmt = QuantFormat(bits)
    codes = torch.arange(fmt.lowest, fmt.highest + 1, dtype=torch.int32)
    codes = codes.repeat(-(-64 // codes.numel()))[:64].reshape(1, 64).roll(3, dims=1)
    packed = pack(codes, fmt)
    assert packed.shape == (1, fmt.packed_bytes(64)) and packed.dtype == fmt.code_dtype
    assert torch.equal(unpack(packed, fmt), codes)


def test_packed_bit_positions() -> None:
    # value d starts at bit d * bits of its row (the layout paged attention kernels read).
    codes = torch.tensor([[1, -2, 3, -4] * 8], dtype=torch.int32)
    four = pack(codes, QuantFormat(4))
    assert four[0, 0].item() == (1 + 8) | ((-2 + 8) << 4)
    six = pack(codes, QuantFormat(6)).to(torch.int64)
    word = six[0, 0] | (six[0, 1] << 8) | (six[0, 2] << 16)
    assert [(int(word) >> (6 * d)) & 63 for d in range(4)] == [33, 30, 35, 28]


@pytest.mark.parametrize("bits", [8, 6, 4])
def test_round_trip_error_within_bounds(bits: int) -> None:
    rows = keys_with_outliers(512, 4, 128)
    fmt = QuantFormat(bits)
    packed, scales = quantize(rows, fmt)
    assert scales.shape == (512, 4, 4) and scales.dtype == torch.float16
    restored = dequantize(packed, scales, fmt, ROTATION, torch.float32)
    assert relative_error(restored, rows) < MAX_RELATIVE_ERROR[bits]
    # Deterministic bound: every rotated value is within one step of its code, and the
    # rotation preserves norms, so each group's error norm is at most sqrt(32) * |scale|.
    group_error = (restored - rows).reshape(512, 4, 4, 32).norm(dim=-1)
    bound = 32**0.5 * scales.float().abs() * 1.001 + 1e-6
    assert bool((group_error <= bound).all())


def test_rotation_is_what_keeps_outliers_cheap() -> None:
    rows = keys_with_outliers(256, 2, 64, seed=3)
    fmt = QuantFormat(4)
    restored = dequantize(*quantize(rows, fmt), fmt, ROTATION, torch.float32)
    groups = rows.reshape(256, 2, 2, 32)  # the same 4-bit scheme without the rotation
    step = groups.abs().amax(-1, keepdim=True) / 8
    unrotated = (groups / step).round().clamp(-8, 7) * step
    assert relative_error(restored, rows) < 0.75 * relative_error(unrotated, groups)


def test_quantize_handles_zero_rows_and_low_precision_input() -> None:
    fmt = QuantFormat(4)
    zeros = torch.zeros(3, 2, 64, dtype=torch.bfloat16)
    packed, scales = quantize(zeros, fmt)
    assert bool((scales == 0).all())
    assert bool((dequantize(packed, scales, fmt, ROTATION, torch.bfloat16) == 0).all())
    rows = keys_with_outliers(16, 2, 64).to(torch.float16)
    restored = dequantize(*quantize(rows, QuantFormat(8)), QuantFormat(8), ROTATION,
                          torch.float16)
    assert restored.dtype == torch.float16
    assert relative_error(restored, rows) < MAX_RELATIVE_ERROR[8]


def test_round_query_codes_rounds_each_group_to_int8_codes() -> None:
    """The decode kernel's query rounding: exact codes stay exact; other rows move by at most
    half a step (their group's largest magnitude / 254) in the rotated space, and a zero
    group stays zero."""
    codes = torch.randint(-127, 128, (3, 4, 64), generator=torch.Generator().manual_seed(0))
    codes[..., ::32] = 127
    exact = unrotate(codes.float() * 0.5, ROTATION)
    assert torch.allclose(round_query_codes(exact, ROTATION), exact, atol=1e-5)
    rows = keys_with_outliers(8, 2, 64)
    rows[0, 0, :32] = 0.0
    moved = rotate(round_query_codes(rows, ROTATION) - rows, ROTATION).reshape(8, 2, 2, 32)
    step = rotate(rows, ROTATION).reshape(8, 2, 2, 32).abs().amax(-1, keepdim=True) / 127
    assert bool((moved.abs() <= step / 2 + 1e-5).all())
    assert bool((moved.abs() > 0).any())
    assert bool((round_query_codes(rows, ROTATION)[0, 0, :32] == 0).all())


@pytest.mark.parametrize("mode", MODES)
def test_pages_written_through_slots_come_back_through_any_page_table(mode: str) -> None:
    config = model_config()
    storage = make_storage(mode, config, 6, 16, torch.float32, [torch.device("cpu")] * 2)
    assert isinstance(storage, QuantStorage) and storage.mode == mode
    gen = torch.Generator().manual_seed(1)
    slots = torch.randperm(6 * 16, generator=gen)[:50]
    keys = keys_with_outliers(50, 2, 64, seed=1)
    values = torch.randn(50, 2, 64, generator=gen)
    storage.write(1, keys, values, slots)
    page_table = torch.tensor([[5, 0, 3], [2, 2, 4], [1, 5, 0]], dtype=torch.int32)
    got_keys, got_values = storage.gather(1, page_table)
    assert got_keys.shape == (3, 48, 2, 64) and got_keys.dtype == torch.float32
    expected_keys = torch.zeros(6 * 16, 2, 64)
    expected_values = torch.zeros(6 * 16, 2, 64)
    expected_keys[slots] = dequantize(*quantize(keys, storage.key_format),
                                      storage.key_format, ROTATION, torch.float32)
    expected_values[slots] = dequantize(*quantize(values, storage.value_format),
                                        storage.value_format, ROTATION, torch.float32)
    heads = slots % 16 == 0  # the first slot of a page is kept unquantized
    expected_keys[slots[heads]] = keys[heads]
    expected_values[slots[heads]] = values[heads]
    flat_index = (page_table.long()[..., None] * 16 + torch.arange(16)).reshape(3, 48)
    quantized_rows = flat_index % 16 != 0
    assert torch.equal(got_keys[quantized_rows], expected_keys[flat_index][quantized_rows])
    assert torch.equal(got_values[quantized_rows], expected_values[flat_index][quantized_rows])
    # Head rows are stored rotated (as the kernels read them): exact up to float rounding.
    torch.testing.assert_close(got_keys, expected_keys[flat_index], rtol=0, atol=1e-5)
    torch.testing.assert_close(got_values, expected_values[flat_index], rtol=0, atol=1e-5)
    bits = MODE_BITS[mode][0]
    assert relative_error(got_keys.reshape(-1, 2, 64)[_positions(flat_index, slots)],
                          keys[_order(flat_index, slots)]) < MAX_RELATIVE_ERROR[bits]
    untouched_layer = storage.gather(0, page_table)[0]
    assert bool((untouched_layer == 0).all())


def _positions(flat_index: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """Rows of the gathered (flattened) output that hold a written slot."""
    return torch.nonzero(torch.isin(flat_index.reshape(-1), slots)).squeeze(1)


def _order(flat_index: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """For each such row, which written row it holds."""
    where = {int(s): i for i, s in enumerate(slots)}
    flat = flat_index.reshape(-1)
    return torch.tensor([where[int(flat[p])] for p in _positions(flat_index, slots)])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gather_returns_the_compute_dtype(dtype: torch.dtype) -> None:
    storage = QuantStorage(model_config(), 2, 8, dtype, ["cpu", "cpu"], "q8")
    rows = keys_with_outliers(8, 2, 64).to(dtype)
    storage.write(0, rows, rows, torch.arange(8, 16))
    keys, _ = storage.gather(0, torch.tensor([[1]]))
    assert keys.dtype == dtype
    assert relative_error(keys[0], rows) < 0.01


@pytest.mark.parametrize("mode", MODES)
def test_copy_pages_copies_codes_and_scales_in_order(mode: str) -> None:
    storage = QuantStorage(model_config(), 5, 8, torch.float32, ["cpu", "cpu"], mode)
    for layer in range(2):
        rows = keys_with_outliers(40, 2, 64, seed=layer)
        storage.write(layer, rows, -rows, torch.arange(40))
    before = [storage.gather(layer, torch.arange(5).view(1, 5)) for layer in range(2)]
    # Page 2 becomes page 0's first 5 slots; then page 3 takes page 2 in full (a chain: the
    # second copy must see the first one's result); then page 1 goes onto page 0.
    storage.copy_pages([PageCopy(src=0, dst=2, num_slots=5), PageCopy(src=2, dst=3, num_slots=8),
                        PageCopy(src=1, dst=0, num_slots=8)])
    for layer in range(2):
        keys, values = storage.gather(layer, torch.arange(5).view(1, 5))
        for new, old in ((keys, before[layer][0]), (values, before[layer][1])):
            pages, old_pages = new.view(5, 8, 2, 64), old.view(5, 8, 2, 64)
            assert torch.equal(pages[0], old_pages[1])
            assert torch.equal(pages[1], old_pages[1])
            assert torch.equal(pages[2, :5], old_pages[0, :5])
            assert torch.equal(pages[2, 5:], old_pages[2, 5:])
            assert torch.equal(pages[3, :5], old_pages[0, :5])
            assert torch.equal(pages[3, 5:], old_pages[2, 5:])
            assert torch.equal(pages[4], old_pages[4])


@pytest.mark.parametrize("mode", MODES)
def test_independent_copies_move_every_head_of_their_slots(mode: str) -> None:
    """Every KV head of each copied slot moves (partial pages, defrag moves), nothing else
    does."""
    storage = QuantStorage(model_config(), 6, 8, torch.float32, ["cpu", "cpu"], mode)
    rows = keys_with_outliers(24, 2, 64, seed=3)
    storage.write(0, rows, -rows, torch.arange(24))
    before = storage.gather(0, torch.arange(6).view(1, 6))
    storage.copy_pages([PageCopy(src=0, dst=4, num_slots=3), PageCopy(src=2, dst=5, num_slots=8)])
    after = storage.gather(0, torch.arange(6).view(1, 6))
    for new, old in zip(after, before, strict=True):
        pages, old_pages = new.view(6, 8, 2, 64), old.view(6, 8, 2, 64)
        assert torch.equal(pages[:4], old_pages[:4])
        assert torch.equal(pages[4, :3], old_pages[0, :3])
        assert torch.equal(pages[4, 3:], old_pages[4, 3:])
        assert torch.equal(pages[5], old_pages[2])


@pytest.mark.parametrize("mode", MODES)
def test_pages_are_head_major(mode: str) -> None:
    """The rows of one page and KV head are one run of memory (what the decode kernel's block
    copies rely on for whole sectors), behind [pages, page_size, kv_heads, ...] views."""
    storage = QuantStorage(model_config(num_kv_heads=3), 4, 16, torch.float32, ["cpu"] * 2, mode)
    for tensor in storage.layers[0].tensors():
        pages, page_size, heads, width = tensor.shape
        assert (pages, page_size, heads) == (4, 16, 3)
        assert tensor.stride() == (heads * page_size * width, width, page_size * width, 1)
        assert tensor.permute(0, 2, 1, 3).is_contiguous()


def test_copy_pages_rejects_bad_pages() -> None:
    storage = QuantStorage(model_config(), 3, 8, torch.float32, ["cpu", "cpu"], "q4")
    with pytest.raises(IndexError, match="page 3"):
        storage.copy_pages([PageCopy(src=0, dst=3, num_slots=1)])
    with pytest.raises(ValueError, match="9 slots"):
        storage.copy_pages([PageCopy(src=0, dst=1, num_slots=9)])


@pytest.mark.parametrize("mode", MODES)
def test_nbytes_matches_the_format(mode: str) -> None:
    config = model_config(num_layers=3, num_kv_heads=2, head_dim=128)
    storage = QuantStorage(config, 7, 64, torch.bfloat16, ["cpu"] * 3, mode)
    key_bits, value_bits = MODE_BITS[mode]
    # codes: head_dim * bits / 8 bytes; scales: one fp16 per 32 values.
    per_row = (128 * key_bits // 8 + 8) + (128 * value_bits // 8 + 8)
    pages = 3 * 7 * 64 * 2 * per_row
    # head rows: one bf16 key and value row per page (and one spare) per kv head and layer.
    heads = 3 * (7 + 1) * 2 * 2 * 128 * 2
    assert storage.nbytes() == pages + heads
    assert storage.bytes_per_token() * 7 * 64 + storage.bytes_per_page_head() * 8 == (
        pages + heads)
    # recent windows (q6, q4): 16 rows of 5 sequences + a spare
    assert storage.reserve_sequences(5) == (5 if mode != "q8" else 0)
    window = 3 * (16 * 5 + 1) * (2 * 2 * 128 * 2 + 4) if mode != "q8" else 0
    assert storage.nbytes() == pages + heads + window


@pytest.mark.parametrize(("mode", "min_ratio"), [("q8", 1.85), ("q6", 2.4), ("q4", 3.5)])
def test_tokens_per_byte_against_16_bit(mode: str, min_ratio: float) -> None:
    config = model_config(num_layers=2, num_kv_heads=2, head_dim=64)
    # 64 pages: the one spare head row the quantized storage adds is then under 0.1 % of it.
    quantized = make_storage(mode, config, 64, 256, torch.bfloat16, [torch.device("cpu")] * 2)
    sixteen_bit = make_storage("fp16", config, 64, 256, torch.bfloat16,
                               [torch.device("cpu")] * 2)
    tokens = 64 * 256
    assert sixteen_bit.nbytes() == tokens * config.kv_bytes_per_token_fp16
    ratio = (tokens / quantized.nbytes()) / (tokens / sixteen_bit.nbytes())
    assert ratio >= min_ratio


def test_bad_configurations_fail_clearly() -> None:
    with pytest.raises(ValueError, match="multiple of 32"):
        QuantStorage(model_config(head_dim=80), 2, 8, torch.float32, ["cpu", "cpu"], "q4")
    with pytest.raises(ValueError, match="unknown"):
        QuantStorage(model_config(), 2, 8, torch.float32, ["cpu", "cpu"], "q5")
    with pytest.raises(ValueError, match="layer_devices"):
        QuantStorage(model_config(), 2, 8, torch.float32, ["cpu"], "q4")


def test_triton_write_option(monkeypatch: pytest.MonkeyPatch) -> None:
    """The one-launch write (`write`) is never the default off CUDA and cannot be forced onto
    the CPU outside Triton's interpreter."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    storage = QuantStorage(model_config(), 2, 8, torch.float32, ["cpu", "cpu"], "q4")
    assert storage._triton == [False, False]
    with pytest.raises(ValueError, match="triton_write=True"):
        QuantStorage(model_config(), 2, 8, torch.float32, ["cpu", "cpu"], "q4",
                     triton_write=True)


def test_explicit_bits_override_the_mode_pair() -> None:
    storage = QuantStorage(model_config(), 2, 8, torch.float32, ["cpu", "cpu"], "q6",
                           bits=(8, 4))
    assert (storage.key_format.bits, storage.value_format.bits) == (8, 4)
    assert storage.nbytes() == QuantStorage(model_config(), 2, 8, torch.float32,
                                            ["cpu", "cpu"], "q6").nbytes()

