"""The q8/q4 decode kernel (`triton_quant`) against the sdpa reference over the same storage:
decodes of mixed context lengths (a single token, lengths below and across pages and blocks),
with and without a recent window, sequences without a window slot, key offsets, page heads, and
the keys before the window split several ways. Runs on CUDA, or on the CPU under
TRITON_INTERPRET=1 (small shapes)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from dyngen_core.kv.attention.base import ForwardBatch
from dyngen_core.kv.attention.sdpa import SdpaBackend
from dyngen_core.kv.quant.storage import QuantStorage
from tests.gpu.conftest import interpreter_mode
from tests.gpu.quant_setup import decode_step

pytestmark = pytest.mark.gpu

PAGE, WINDOW, HEADS, KV_HEADS = 16, 4, 8, 2
# (context after this step's token, has a window slot) per sequence.
DECODES = [(1, True), (2, True), (17, True), (33, False), (50, True), (64, True), (70, True)]


def _setup(mode: str, window: int, head_dim: int, dtype: torch.dtype, device: torch.device,
           seed: int, page: int = PAGE
           ) -> tuple[QuantStorage, ForwardBatch, torch.Tensor, torch.Tensor]:
    """`quant_setup.decode_step` of this file's decodes at ``head_dim`` and ``page``."""
    return decode_step(mode, window, DECODES, heads=HEADS, kv_heads=KV_HEADS,
                       head_dim=head_dim, page=page, dtype=dtype, device=device, seed=seed)


def _outputs(mode: str, window: int, head_dim: int, dtype: torch.dtype, device: torch.device,
             backend: object, seed: int = 0, page: int = PAGE
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """(backend output, sdpa output) of one decode step over identical storages."""
    gen = torch.Generator().manual_seed(seed + 1)
    q = torch.randn(len(DECODES), HEADS, head_dim, generator=gen).to(device, dtype)
    results = []
    for attend in (backend, SdpaBackend()):
        storage, batch, k, v = _setup(mode, window, head_dim, dtype, device, seed, page)
        results.append(attend.attend(0, q, k, v, storage, batch,  # type: ignore[attr-defined]
                                     head_dim ** -0.5).float())
    assert torch.isfinite(results[0]).all()
    return results[0], results[1]


def _backend(**options: Any) -> Any:
    """The Triton backend at this file's tile sizes (triton imported only when called)."""
    from dyngen_core.kv.attention.triton.paged import TritonPagedBackend  # needs triton

    return TritonPagedBackend(block_n=16, word_block_n=16, **options)


@pytest.mark.parametrize("mode", ["q4", "q8"])
@pytest.mark.parametrize("window", [0, WINDOW])
@pytest.mark.parametrize("head_dim", [32, 64])
def test_word_decode_matches_sdpa(device: torch.device, mode: str, window: int,
                                  head_dim: int) -> None:
    """float32 (exact dots): the kernel and the reference agree to rounding."""
    from dyngen_core.kv.attention.triton.quant import word_decode_fits

    storage, batch, _, _ = _setup(mode, window, head_dim, torch.float32, device, 0)
    assert word_decode_fits(batch, storage.key_format.bits, storage.value_format.bits,
                            object(), 16)  # type: ignore[arg-type]
    out, ref = _outputs(mode, window, head_dim, torch.float32, device,
                        _backend(max_splits=3, programs_per_sm=8))
    torch.testing.assert_close(out, ref, rtol=2e-4, atol=2e-4)


@pytest.mark.parametrize("mode", ["q4", "q8"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_word_decode_half_precision(device: torch.device, mode: str,
                                    dtype: torch.dtype) -> None:
    """fp16 and bf16 pages: the codes' exponent-trick conversion in each dot dtype."""
    if dtype == torch.bfloat16 and interpreter_mode():
        pytest.skip("Triton's interpreter has no bfloat16 (numpy)")
    out, ref = _outputs(mode, WINDOW, 64, dtype, device, _backend(max_splits=2))
    assert float((out - ref).norm() / ref.norm()) < 2e-2


@pytest.mark.parametrize("launches", [1, 2])
def test_word_decode_splits_agree(device: torch.device, launches: int) -> None:
    """One split and many give the same output (the tail program merged as one more), with
    the page and tail programs in one launch or two."""
    one, ref = _outputs("q4", WINDOW, 32, torch.float32, device,
                        _backend(max_splits=1, word_launches=launches))
    many, _ = _outputs("q4", WINDOW, 32, torch.float32, device,
                       _backend(max_splits=8, programs_per_sm=64, word_launches=launches))
    torch.testing.assert_close(one, ref, rtol=2e-4, atol=2e-4)
    torch.testing.assert_close(many, one, rtol=2e-4, atol=2e-4)


def _with_word_options(monkeypatch: pytest.MonkeyPatch, **options: bool | int) -> None:
    """Route the backend's q8/q4 decodes through `attend_word_decode` with kernel options
    that replace the backend's own (its `WordKernelFlags` keywords: a plain partial would be
    overridden by them)."""
    from dyngen_core.kv.attention.triton import paged as triton_paged
    from dyngen_core.kv.attention.triton.quant import attend_word_decode

    def with_options(*args: object, **keywords: object) -> torch.Tensor:
        return attend_word_decode(*args, **(keywords | options))  # type: ignore[arg-type]

    monkeypatch.setattr(triton_paged, "attend_word_decode", with_options)


@pytest.mark.parametrize("mode", ["q4", "q8"])
@pytest.mark.parametrize("join", ["keys", "values", "both", "wide"])
def test_joined_rows_match_sdpa(device: torch.device, monkeypatch: pytest.MonkeyPatch,
                                mode: str, join: str) -> None:
    """Keys and/or values dequantized to whole rows (one dot per block), and ("wide") scales
    loaded as int32 pairs: float32 exact, with a window, head_dim 64 (several words and two
    scale groups per row, so both halves of a pair), splits."""
    _with_word_options(monkeypatch, join_keys=join in ("keys", "both"),
                       join_values=join in ("values", "both"), wide_scales=join == "wide")
    out, ref = _outputs(mode, WINDOW, 64, torch.float32, device,
                        _backend(max_splits=3, programs_per_sm=8))
    torch.testing.assert_close(out, ref, rtol=2e-4, atol=2e-4)


@pytest.mark.parametrize("mode", ["q4", "q8"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_dot_half_precision(device: torch.device, monkeypatch: pytest.MonkeyPatch,
                                 mode: str, dtype: torch.dtype) -> None:
    """half_dot (float16 dots for the page blocks whatever the query dtype) with joined values:
    as close to the reference as the default kernel."""
    if dtype == torch.bfloat16 and interpreter_mode():
        pytest.skip("Triton's interpreter has no bfloat16 (numpy)")
    _with_word_options(monkeypatch, join_values=True, half_dot=True)
    out, ref = _outputs(mode, WINDOW, 64, dtype, device, _backend(max_splits=2))
    assert float((out - ref).norm() / ref.norm()) < 2e-2


@pytest.mark.parametrize("mode", ["q4", "q8"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("join_values", [False, True])
def test_fast_unpack_matches_plain_unpack(device: torch.device,
                                          monkeypatch: pytest.MonkeyPatch, mode: str,
                                          dtype: torch.dtype, join_values: bool) -> None:
    """The inline-PTX unpacking (CUDA only; with int32 scale loads) computes the same halves
    as the plain one, so the outputs agree to the dots' rounding; both stay as close to the
    reference."""
    if interpreter_mode():
        pytest.skip("inline PTX needs CUDA")
    results = []
    for fast in (False, True):
        _with_word_options(monkeypatch, join_values=join_values, half_dot=True,
                           fast_unpack=fast, wide_scales=fast)
        results.append(_outputs(mode, WINDOW, 64, dtype, device, _backend(max_splits=2)))
    (plain, ref), (fast_out, _) = results
    torch.testing.assert_close(fast_out, plain, rtol=1e-3, atol=1e-3)
    assert float((fast_out - ref).norm() / ref.norm()) < 2e-2


@pytest.mark.parametrize("mode", ["q4", "q8"])
@pytest.mark.parametrize("window", [0, WINDOW])
@pytest.mark.parametrize(("page", "page_window", "splits", "launches"),
                         [(PAGE, 2, 1, 2), (PAGE, 2, 3, 1), (32, 1, 3, 2), (32, 2, 1, 1)])
def test_page_window_matches_sdpa(device: torch.device, monkeypatch: pytest.MonkeyPatch,
                                  mode: str, window: int, page: int, page_window: int,
                                  splits: int, launches: int) -> None:
    """Page ids loaded ahead in windows of ``page_window`` pages: float32 exact, with and
    without the recent window. Contexts of up to 5 pages (16 slots) span several windows and
    end in a partial one; 32-slot pages hold two 16-key blocks each, so a block's id is picked
    at an offset inside its page, and 3 splits start mid-page; both launch kinds."""
    _with_word_options(monkeypatch, page_window=page_window)
    out, ref = _outputs(mode, window, 32, torch.float32, device,
                        _backend(max_splits=splits, programs_per_sm=8, word_launches=launches),
                        page=page)
    torch.testing.assert_close(out, ref, rtol=2e-4, atol=2e-4)


@pytest.mark.parametrize("mode", ["q4", "q8"])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_scale_rows_match_sdpa(device: torch.device, monkeypatch: pytest.MonkeyPatch,
                               mode: str, head_dim: int) -> None:
    """Scales loaded as each key's row and widened to the columns: float32 exact with page
    ids loaded ahead and the recent window; head_dim 64 pads the columns (masked groups),
    head_dim 128 fills them (the aligned rows path); keys transposed, values not."""
    _with_word_options(monkeypatch, scale_rows=True, page_window=2)
    out, ref = _outputs(mode, WINDOW, head_dim, torch.float32, device,
                        _backend(max_splits=3, programs_per_sm=8))
    torch.testing.assert_close(out, ref, rtol=2e-4, atol=2e-4)


def test_scale_rows_refuse_unaligned_rows() -> None:
    """scale_rows tells Triton every row of scales starts at a multiple of the group count;
    scales whose strides break that are refused instead of read misaligned."""
    pytest.importorskip("triton")
    from dyngen_core.kv.attention.triton.quant import check_scale_rows

    scales = torch.zeros(2, 16, 2, 4, dtype=torch.float16)
    check_scale_rows((None,) * 8 + (scales, scales) + scales.stride()[:3] * 2, 4)
    with pytest.raises(ValueError, match="scale_rows=False"):
        check_scale_rows((None,) * 8 + (scales, scales) + (128, 8, 6) * 2, 4)


def test_page_window_must_be_a_power_of_two(device: torch.device) -> None:
    """A window that is not 0 or a power of two is refused before any launch."""
    pytest.importorskip("triton")
    from dyngen_core.kv.attention.triton.quant import attend_word_decode

    q = torch.zeros(1, HEADS, 32, device=device)
    with pytest.raises(ValueError, match="power of two"):
        attend_word_decode(q, (), None, None, 1.0, key_bits=4,  # type: ignore[arg-type]
                           value_bits=4, num_kv_heads=KV_HEADS, block_n=16, splits=1,
                           warps=4, page_window=3)


def test_query_rows_must_be_one_per_sequence(device: torch.device) -> None:
    """The kernel takes sequence i's query as token i: a batch whose query rows are not one per
    sequence is refused before any launch."""
    pytest.importorskip("triton")
    from types import SimpleNamespace

    from dyngen_core.kv.attention.triton.quant import attend_word_decode

    q = torch.zeros(3, HEADS, 32, device=device)
    with pytest.raises(ValueError, match="one query row per sequence: 3 rows for 2"):
        attend_word_decode(q, (), SimpleNamespace(num_seqs=2),  # type: ignore[arg-type]
                           None, 1.0, key_bits=4, value_bits=4,  # type: ignore[arg-type]
                           num_kv_heads=KV_HEADS, block_n=16, splits=1, warps=4, tail_parts=1)


def test_word_flags_join_only_4bit_values_by_default() -> None:
    """The backend's defaults join 4-bit values (faster on an H200) but not 8-bit ones (slower
    there), unless asked to; every other flag passes through unchanged."""
    pytest.importorskip("triton")
    from dyngen_core.kv.attention.triton.quant import WordKernelFlags

    flags = WordKernelFlags()
    assert flags.keywords(4)["join_values"] and not flags.keywords(8)["join_values"]
    assert WordKernelFlags(join_8bit_values=True).keywords(8)["join_values"]
    assert not WordKernelFlags(join_values=False).keywords(4)["join_values"]
    assert "join_8bit_values" not in flags.keywords(4)
    assert flags.keywords(8)["half_dot"] == flags.half_dot
    assert WordKernelFlags(page_window=4, scale_rows=True, stages=4).keywords(4) == (
        flags.keywords(4) | {"page_window": 4, "scale_rows": True, "stages": 4})


@pytest.mark.parametrize("mode", ["q4", "q8"])
@pytest.mark.parametrize(("loop_flags", "launches"), [(3, 2), (2, 1), (15, 1), (8, 2)])
def test_key_loop_options_match_sdpa(device: torch.device, monkeypatch: pytest.MonkeyPatch,
                                     mode: str, loop_flags: int, launches: int) -> None:
    """The key loop's options (`attend_word_decode`): lazy_sum (bit 1: running sums per key,
    reduced after the loop), paired_values (bit 2: joined values in the unpack's pair order,
    put back in dim order after the loop), small_tail_rows (bit 4: the single tail's window in
    16-row tiles, here under 32-key blocks so the tiles differ), swapped_values (bit 8: the
    value tile's middle column quarters swapped, and back after the loop): float32 exact with
    the recent window, head_dim 64, page ids ahead, 3 splits, both launch kinds (the single
    tail in one)."""
    from dyngen_core.kv.attention.triton.paged import TritonPagedBackend

    _with_word_options(monkeypatch, join_values=True, page_window=2,
                       lazy_sum=bool(loop_flags & 1), paired_values=bool(loop_flags & 2),
                       small_tail_rows=bool(loop_flags & 4),
                       swapped_values=bool(loop_flags & 8))
    backend = TritonPagedBackend(block_n=16, word_block_n=32, max_splits=3, programs_per_sm=8,
                                 word_launches=launches)
    out, ref = _outputs(mode, WINDOW, 64, torch.float32, device, backend, page=32)
    torch.testing.assert_close(out, ref, rtol=2e-4, atol=2e-4)


def test_word_flags_turn_the_key_loop_options_on_by_default() -> None:
    """The key loop's options are on for both value widths (fastest on an H200 at every
    batch for q4 and q8); one turned off stays off."""
    pytest.importorskip("triton")
    from dyngen_core.kv.attention.triton.quant import WordKernelFlags

    names = ("lazy_sum", "paired_values", "swapped_values", "small_tail_rows")
    for bits in (4, 8):
        assert all(WordKernelFlags().keywords(bits)[name] for name in names)
    assert not WordKernelFlags(lazy_sum=False).keywords(4)["lazy_sum"]
