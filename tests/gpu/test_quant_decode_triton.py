"""The q8/q4 decode kernel (`attention.triton.quant_decode`) against the sdpa reference over the
same storage: decodes of mixed context lengths (a single token, lengths below and across pages
and blocks), with and without a recent window, sequences without a window slot, key offsets,
page heads, the keys before the window split several ways, page ids loaded ahead in windows of
several sizes, scale rows padded and full, 32-key blocks, one launch and two, and (CUDA) the
inline-PTX unpack against the plain one. Runs on CUDA, or on the CPU under TRITON_INTERPRET=1
(small shapes)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from dyngen_core.kv.attention.base import ForwardBatch
from dyngen_core.kv.attention.sdpa import SdpaBackend
from dyngen_core.kv.quant.storage import QuantStorage
from tests.gpu.conftest import interpreter_mode
from tests.gpu.quant_setup import decode_step, int8_exact_queries

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
             backend: object, seed: int = 0, page: int = PAGE, exact_queries: bool = True
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """(backend output, sdpa output) of one decode step over identical storages; queries the
    kernel's int8 query codes hold exactly (`int8_exact_queries`) unless not
    ``exact_queries`` (random normal ones)."""
    gen = torch.Generator().manual_seed(seed + 1)
    if exact_queries:
        q = int8_exact_queries(len(DECODES), HEADS, head_dim, gen).to(device, dtype)
    else:
        q = torch.randn(len(DECODES), HEADS, head_dim, generator=gen).to(device, dtype)
    results = []
    for attend in (backend, SdpaBackend()):
        storage, batch, k, v = _setup(mode, window, head_dim, dtype, device, seed, page)
        results.append(attend.attend(0, q, k, v, storage, batch,  # type: ignore[attr-defined]
                                     head_dim ** -0.5).float())
    assert torch.isfinite(results[0]).all()
    return results[0], results[1]


def _backend(monkeypatch: pytest.MonkeyPatch, splits: int, programs_per_sm: int = 8,
             launches: int | None = None, page_window: int | None = None,
             block_n: int = 16) -> Any:
    """The Triton backend with this file's tiles (``block_n`` keys a word-kernel block), at
    most ``splits`` page splits; ``launches`` 1 or 2 forces the word kernel's launches (None:
    its rule), ``page_window`` its page ids ahead (None: the default). Triton is imported only
    when called."""
    from dyngen_core.kv.attention.triton import decode, quant_decode  # needs triton
    from dyngen_core.kv.attention.triton.paged import TritonPagedBackend

    monkeypatch.setattr(decode, "BLOCK_N", 16)
    monkeypatch.setattr(decode, "MAX_SPLITS", splits)
    monkeypatch.setattr(decode, "PROGRAMS_PER_SM", programs_per_sm)
    monkeypatch.setattr(quant_decode, "BLOCK_N", block_n)
    if launches is not None:
        limit = 1 << 20 if launches == 1 else 0
        monkeypatch.setattr(quant_decode, "ONE_LAUNCH_MAX_SEQS", limit)
    if page_window is not None:
        monkeypatch.setattr(quant_decode, "PAGE_WINDOW", page_window)
    return TritonPagedBackend()


@pytest.mark.parametrize("mode", ["q4", "q8"])
@pytest.mark.parametrize("window", [0, WINDOW])
@pytest.mark.parametrize("head_dim", [32, 64, 96])
def test_word_decode_matches_sdpa(device: torch.device, monkeypatch: pytest.MonkeyPatch,
                                  mode: str, window: int, head_dim: int) -> None:
    """float32 (exact dots): the kernel and the reference agree to rounding."""
    backend = _backend(monkeypatch, 3)
    from dyngen_core.kv.attention.triton.quant_decode import word_decode_fits

    storage, batch, _, _ = _setup(mode, window, head_dim, torch.float32, device, 0)
    assert word_decode_fits(batch, storage.key_format.bits, storage.value_format.bits,
                            object())  # type: ignore[arg-type]
    out, ref = _outputs(mode, window, head_dim, torch.float32, device, backend)
    torch.testing.assert_close(out, ref, rtol=2e-4, atol=2e-4)


@pytest.mark.parametrize("mode", ["q4", "q8"])
def test_word_decode_query_codes(device: torch.device, monkeypatch: pytest.MonkeyPatch,
                                 mode: str) -> None:
    """Random queries (float32): the page blocks' int8 query codes (one scale a row and group
    of 32) move the output by about the codes' rounding, 1/254 of a group's largest value,
    not more (queries the codes hold exactly agree to rounding: the tests above)."""
    out, ref = _outputs(mode, WINDOW, 64, torch.float32, device, _backend(monkeypatch, 2),
                        exact_queries=False)
    error = float((out - ref).norm() / ref.norm())
    assert 1e-5 < error < 1e-2  # the codes round (not exact), and only that much


@pytest.mark.parametrize("mode", ["q4", "q8"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_word_decode_half_precision(device: torch.device, monkeypatch: pytest.MonkeyPatch,
                                    mode: str, dtype: torch.dtype) -> None:
    """fp16 and bf16 queries: the page blocks' float16 dots and the codes' exponent trick."""
    if dtype == torch.bfloat16 and interpreter_mode():
        pytest.skip("Triton's interpreter has no bfloat16 (numpy)")
    out, ref = _outputs(mode, WINDOW, 64, dtype, device, _backend(monkeypatch, 2))
    assert float((out - ref).norm() / ref.norm()) < 2e-2


@pytest.mark.parametrize("mode", ["q4", "q8"])
def test_register_capped_launch_matches_the_compilers_own(device: torch.device,
                                                          monkeypatch: pytest.MonkeyPatch,
                                                          mode: str) -> None:
    """fp16 queries: a launch compiled under the register cap (`decode.register_cap`, which
    production gives large one-launch batches; q8's kernel then holds fewer registers than it
    would) gives the output of the uncapped compile. The interpreter ignores the cap."""
    from dyngen_core.kv.attention.triton import quant_decode

    caps: list[int | None] = []

    def forced(cap: int | None) -> Any:
        def register_cap(programs: int, warps: int, on: torch.device) -> int | None:
            caps.append(cap)
            return cap
        return register_cap

    monkeypatch.setattr(quant_decode, "register_cap", forced(None))
    free, ref = _outputs(mode, WINDOW, 64, torch.float16, device, _backend(monkeypatch, 2))
    monkeypatch.setattr(quant_decode, "register_cap", forced(128))
    capped, _ = _outputs(mode, WINDOW, 64, torch.float16, device, _backend(monkeypatch, 2))
    assert caps and caps[-1] == 128  # both launches went through the rule
    torch.testing.assert_close(capped, free, rtol=1e-3, atol=1e-3)
    assert float((capped - ref).norm() / ref.norm()) < 2e-2


@pytest.mark.parametrize("launches", [1, 2])
def test_word_decode_splits_agree(device: torch.device, monkeypatch: pytest.MonkeyPatch,
                                  launches: int) -> None:
    """One split and many give the same output (the tail program merged as one more), with
    the page and tail programs in one launch or two."""
    one, ref = _outputs("q4", WINDOW, 32, torch.float32, device,
                        _backend(monkeypatch, 1, launches=launches))
    many, _ = _outputs("q4", WINDOW, 32, torch.float32, device,
                       _backend(monkeypatch, 8, programs_per_sm=64, launches=launches))
    torch.testing.assert_close(one, ref, rtol=2e-4, atol=2e-4)
    torch.testing.assert_close(many, one, rtol=2e-4, atol=2e-4)


@pytest.mark.parametrize("mode", ["q4", "q8"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_fast_unpack_matches_plain_unpack(device: torch.device,
                                          monkeypatch: pytest.MonkeyPatch, mode: str,
                                          dtype: torch.dtype) -> None:
    """The inline-PTX unpacking (CUDA only) computes the same halves as the plain one (the
    interpreter's), so the outputs agree to the dots' rounding; both stay as close to the
    reference."""
    if interpreter_mode():
        pytest.skip("inline PTX needs CUDA")
    from dyngen_core.kv.attention.triton import quant_decode

    kernel = quant_decode.quant_decode_kernel
    results = []
    for fast in (False, True):
        with monkeypatch.context() as patch:
            patch.setattr(quant_decode, "quant_decode_kernel", _Recorded(
                kernel, [], {"FAST_UNPACK": fast}))
            results.append(_outputs(mode, WINDOW, 64, dtype, device, _backend(patch, 2)))
    (plain, ref), (fast_out, _) = results
    torch.testing.assert_close(fast_out, plain, rtol=1e-3, atol=1e-3)
    assert float((fast_out - ref).norm() / ref.norm()) < 2e-2


class _Recorded:
    """Stands in for `quant_decode_kernel`: records each launch's grid and constexprs in
    ``launches`` and launches the kernel with ``overrides`` over its constexprs."""

    def __init__(self, kernel: Any, launches: list[dict[str, Any]],
                 overrides: dict[str, Any] | None = None) -> None:
        self.kernel, self.launches, self.overrides = kernel, launches, overrides or {}

    def __getitem__(self, grid: tuple[int, ...]) -> Any:
        def launch(*args: Any, **constexprs: Any) -> Any:
            constexprs = constexprs | self.overrides
            self.launches.append({"grid": grid} | constexprs)
            return self.kernel[grid](*args, **constexprs)
        return launch


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
    backend = _backend(monkeypatch, splits, launches=launches, page_window=page_window)
    out, ref = _outputs(mode, window, 32, torch.float32, device, backend, page=page)
    torch.testing.assert_close(out, ref, rtol=2e-4, atol=2e-4)


@pytest.mark.parametrize("mode", ["q4", "q8"])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_scale_rows_match_sdpa(device: torch.device, monkeypatch: pytest.MonkeyPatch,
                               mode: str, head_dim: int) -> None:
    """Scales loaded as each key's row and widened to the columns: float32 exact with page
    ids loaded ahead and the recent window; head_dim 64 pads the columns (masked groups),
    head_dim 128 fills them (the aligned rows path); keys transposed, values not."""
    out, ref = _outputs(mode, WINDOW, head_dim, torch.float32, device,
                        _backend(monkeypatch, 3, page_window=2))
    torch.testing.assert_close(out, ref, rtol=2e-4, atol=2e-4)


def test_scale_rows_refuse_unaligned_rows() -> None:
    """The kernel tells Triton every row of scales starts at a multiple of the group count;
    scales whose strides break that are refused instead of read misaligned."""
    pytest.importorskip("triton")
    from dyngen_core.kv.attention.triton.quant_decode import check_scale_rows

    scales = torch.zeros(2, 16, 2, 4, dtype=torch.float16)
    check_scale_rows((None,) * 8 + (scales, scales) + scales.stride()[:3] * 2, 4)
    with pytest.raises(ValueError, match="aligned to 4 scales"):
        check_scale_rows((None,) * 8 + (scales, scales) + (128, 8, 6) * 2, 4)


def test_query_rows_must_be_one_per_sequence(device: torch.device) -> None:
    """The kernel takes sequence i's query as token i: a batch whose query rows are not one per
    sequence is refused before any launch."""
    pytest.importorskip("triton")
    from types import SimpleNamespace

    from dyngen_core.kv.attention.triton.quant_decode import attend_word_decode

    q = torch.zeros(3, HEADS, 32, device=device)
    with pytest.raises(ValueError, match="one query row per sequence: 3 rows for 2"):
        attend_word_decode(q, (), SimpleNamespace(num_seqs=2),  # type: ignore[arg-type]
                           None, 1.0, key_bits=4, value_bits=4,  # type: ignore[arg-type]
                           num_kv_heads=KV_HEADS, splits=1)


@pytest.mark.parametrize("mode", ["q4", "q8"])
@pytest.mark.parametrize("launches", [1, 2])
def test_32_key_blocks_match_sdpa(device: torch.device, monkeypatch: pytest.MonkeyPatch,
                                  mode: str, launches: int) -> None:
    """32-key blocks over 32-slot pages: the key loop's per-key running sums, the joined 4-bit
    values in pair order with swapped quarters (put back after the loop), the single tail's
    16-row window tiles unlike its blocks: float32 exact with the recent window, head_dim 64,
    page ids ahead, 3 splits, both launch kinds."""
    backend = _backend(monkeypatch, 3, launches=launches, page_window=2, block_n=32)
    out, ref = _outputs(mode, WINDOW, 64, torch.float32, device, backend, page=32)
    torch.testing.assert_close(out, ref, rtol=2e-4, atol=2e-4)
