"""The q8/q4 decode kernel's tail in parts (`attend_word_decode`'s ``tail_parts``): the window's
last blocks, the page heads and the window's exact rows as separate programs give the output of
the single serial tail and of the sdpa reference over the same storage. Covered: no window, a
window of 4 and of 16 positions (the tail's blocks empty, one block or two), a sequence without
a window slot, contexts shorter than a page (down to the step's own token), one launch or two,
the splits merged in the kernel or by the second kernel, 2 to 4 parts, 64 and 128 page splits
(merge rounds over mostly empty partials); the counters are zero after every launch, and
unwritten partials or outputs (poisoned with NaN) would show. Runs on CUDA, or on the CPU under
TRITON_INTERPRET=1 (small shapes)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from dyngen_core.kv.attention.base import ForwardBatch
from dyngen_core.kv.attention.sdpa import SdpaBackend
from dyngen_core.kv.quant.storage import QuantStorage
from tests.gpu.quant_setup import decode_step

pytestmark = pytest.mark.gpu

PAGE, HEADS, KV_HEADS, HEAD_DIM = 16, 8, 2, 32
# (context after this step's token, has a window slot) per sequence, by window. With 16-key
# blocks the tail's blocks [bulk_hi, ctx) are: window 0, empty; window 4, ctx 1 one block
# whose only key is the fresh one, 33 two blocks (no slot), 70 one; window 16, ctx 12 one block
# inside the first page, 33 two blocks (no slot), 64 one block ending on a page boundary.
DECODES = {0: [(2, True), (33, False), (70, True)],
           4: [(1, True), (33, False), (70, True)],
           16: [(12, True), (33, False), (64, True)]}
# Batch 1: the tail's blocks span two (keys 32..48), the page programs' keys 0..31.
ONE_DECODE = [(49, True)]


def _setup(mode: str, window: int, decodes: list[tuple[int, bool]], device: torch.device,
           seed: int) -> tuple[QuantStorage, ForwardBatch, torch.Tensor, torch.Tensor]:
    """`quant_setup.decode_step` of ``decodes`` in float32 at this file's shapes."""
    return decode_step(mode, window, decodes, heads=HEADS, kv_heads=KV_HEADS,
                       head_dim=HEAD_DIM, page=PAGE, dtype=torch.float32, device=device,
                       seed=seed)


def _attend(backend: Any, mode: str, window: int, decodes: list[tuple[int, bool]],
            device: torch.device, seed: int = 0) -> torch.Tensor:
    """``backend``'s output for one decode step over a fresh storage (float32)."""
    gen = torch.Generator().manual_seed(seed + 1)
    q = torch.randn(len(decodes), HEADS, HEAD_DIM, generator=gen).to(device)
    storage, batch, k, v = _setup(mode, window, decodes, device, seed)
    return backend.attend(0, q, k, v, storage, batch, HEAD_DIM ** -0.5).float()


def _routed(monkeypatch: pytest.MonkeyPatch, merged: bool,
            **options: Any) -> list[dict[str, Any]]:
    """Route the backend's word decodes through `attend_word_decode` with ``options`` over
    its keywords; the partial buffers and the output are poisoned (NaN) before the kernels
    write them, and with ``merged`` the second-kernel merge must not run. Returns every
    kernel launch's grid and constexprs."""
    from dyngen_core.kv.attention.triton import paged as triton_paged
    from dyngen_core.kv.attention.triton import quant as triton_quant

    launches: list[dict[str, Any]] = []
    attend_word_decode, kernel = triton_quant.attend_word_decode, triton_quant.quant_decode_kernel
    empty, empty_like = torch.empty, torch.empty_like

    def poisoned(maker: Any) -> Any:
        return lambda *args, **kw: maker(*args, **kw).fill_(float("nan"))

    class Recorded:
        def __getitem__(self, grid: tuple[int, ...]) -> Any:
            def launch(*args: Any, **constexprs: Any) -> Any:
                launches.append({"grid": grid} | constexprs)
                return kernel[grid](*args, **constexprs)
            return launch

    def routed(*args: Any, **keywords: Any) -> torch.Tensor:
        with monkeypatch.context() as patch:
            patch.setattr(triton_quant.torch, "empty", poisoned(empty))
            patch.setattr(triton_quant.torch, "empty_like", poisoned(empty_like))
            return attend_word_decode(*args, **(keywords | options))

    def no_combine(*args: Any) -> None:
        raise AssertionError("combine_splits_kernel ran although the kernel merged")

    monkeypatch.setattr(triton_paged, "attend_word_decode", routed)
    monkeypatch.setattr(triton_quant, "quant_decode_kernel", Recorded())
    if merged:
        monkeypatch.setattr(triton_quant, "launch_combine", no_combine)
    return launches


def _backend(splits: int, merged: bool, **options: Any) -> Any:
    """The Triton backend at this file's tiles with ``splits`` page splits (triton imported
    only when called)."""
    from dataclasses import replace

    from dyngen_core.kv.attention.triton.paged import TritonPagedBackend  # needs triton
    from dyngen_core.kv.attention.triton.quant import WordKernelFlags

    flags = replace(options.pop("word_flags", None) or WordKernelFlags(), merge_in_kernel=merged)
    return TritonPagedBackend(block_n=16, word_block_n=16, max_splits=splits,
                              programs_per_sm=64, merge_in_kernel=merged, word_flags=flags,
                              **options)


def _word_output(monkeypatch: pytest.MonkeyPatch, device: torch.device, mode: str,
                 window: int, decodes: list[tuple[int, bool]], splits: int, merged: bool,
                 **options: Any) -> tuple[torch.Tensor, list[dict[str, Any]]]:
    """The word kernel's output with ``options`` and its launches; with ``merged``, checks
    the counters are back to zero."""
    with monkeypatch.context() as patch:
        launches = _routed(patch, merged, **options)
        backend = _backend(splits, merged)
        out = _attend(backend, mode, window, decodes, device)
    assert launches and torch.isfinite(out).all()
    if merged:
        held = backend.split_counters.held(device)
        assert held and all(int(buffer.abs().sum()) == 0 for buffer in held)
    return out, launches


@pytest.mark.parametrize("mode", ["q4", "q8"])
@pytest.mark.parametrize("window", [0, 4, 16])
@pytest.mark.parametrize("launches", [1, 2])
def test_three_tail_parts_match_one_and_sdpa(device: torch.device,
                                             monkeypatch: pytest.MonkeyPatch, mode: str,
                                             window: int, launches: int) -> None:
    """Batch 3, 3 page splits, merged in the kernel: three tail parts give the single tail's
    output to rounding, and the reference's."""
    decodes = DECODES[window]
    one, _ = _word_output(monkeypatch, device, mode, window, decodes, 3, True,
                          launches=launches, tail_parts=1)
    three, used = _word_output(monkeypatch, device, mode, window, decodes, 3, True,
                               launches=launches, tail_parts=3)
    reference = _attend(SdpaBackend(), mode, window, decodes, device)
    assert [launch["TAIL_PARTS"] for launch in used] == [3] * launches
    torch.testing.assert_close(three, one, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(three, reference, rtol=2e-4, atol=2e-4)


@pytest.mark.parametrize("tail_parts", [2, 3, 4])
@pytest.mark.parametrize("launches", [1, 2])
def test_tail_parts_merged_either_way(device: torch.device, monkeypatch: pytest.MonkeyPatch,
                                      tail_parts: int, launches: int) -> None:
    """Batch 1 whose tail blocks span two (each its own program with 4 parts), 8 page
    splits: merged in the kernel (2 partials a round) and by the second kernel, both equal
    the single tail's output; the one-launch kernel is held to 3 programs' registers."""
    from dyngen_core.kv.attention.triton.quant import PARTS_MAX_REGISTERS

    one, _ = _word_output(monkeypatch, device, "q4", 4, ONE_DECODE, 8, False, launches=1,
                          tail_parts=1)
    for merged in (False, True):
        out, used = _word_output(monkeypatch, device, "q4", 4, ONE_DECODE, 8, merged,
                                 launches=launches, tail_parts=tail_parts, merge_rows=8)
        grids = [launch["grid"][2] for launch in used]
        assert grids == ([8 + tail_parts] if launches == 1 else [8, tail_parts])
        caps = [launch.get("maxnreg") for launch in used]
        assert caps == ([PARTS_MAX_REGISTERS] if launches == 1 else [None, None])
        torch.testing.assert_close(out, one, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("splits", [64, 128])
def test_many_page_splits(device: torch.device, monkeypatch: pytest.MonkeyPatch,
                          splits: int) -> None:
    """64 and 128 page splits (almost all empty at this context) with three tail parts,
    merged in the kernel over 5 and 9 rounds of 16 partials, or by the second kernel over a
    power-of-two pad of 128 / 256: both equal the reference."""
    reference = _attend(SdpaBackend(), "q4", 16, ONE_DECODE, device)
    for merged in (True, False):
        out, used = _word_output(monkeypatch, device, "q4", 16, ONE_DECODE, splits, merged,
                                 launches=1, tail_parts=3)
        assert used[0]["NUM_SPLITS"] == splits and used[0]["grid"][2] == splits + 3
        torch.testing.assert_close(out, reference, rtol=2e-4, atol=2e-4)


def test_tail_parts_follow_the_window_and_the_flags(device: torch.device,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """By default the tail runs in three parts when the cache has a recent window and the
    tail has its own launch (batches of 3 here), in one in a single launch (batch 1) or
    without a window; a one-launch kernel with its tail in parts is held to 3 programs a
    multiprocessor's registers; `WordKernelFlags.tail_parts` and ``max_registers`` reach the
    kernel through the backend."""
    from dyngen_core.kv.attention.triton import paged as triton_paged
    from dyngen_core.kv.attention.triton import quant as triton_quant
    from dyngen_core.kv.attention.triton.quant import PARTS_MAX_REGISTERS, WordKernelFlags

    def parts_used(window: int, flags: WordKernelFlags | None,
                   decodes: list[tuple[int, bool]] = ONE_DECODE) -> list[tuple[int, Any]]:
        launches: list[dict[str, Any]] = []
        kernel = triton_quant.quant_decode_kernel

        class Recorded:
            def __getitem__(self, grid: tuple[int, ...]) -> Any:
                def launch(*args: Any, **constexprs: Any) -> Any:
                    launches.append(constexprs)
                    return kernel[grid](*args, **constexprs)
                return launch

        with monkeypatch.context() as patch:
            patch.setattr(triton_quant, "quant_decode_kernel", Recorded())
            backend = _backend(2, True, word_flags=flags)
            out = _attend(backend, "q4", window, decodes, device)
        assert torch.isfinite(out).all()
        return [(launch["TAIL_PARTS"], launch.get("maxnreg")) for launch in launches]

    assert triton_paged.attend_word_decode is triton_quant.attend_word_decode
    assert parts_used(4, None) == [(1, None)]
    assert parts_used(4, None, DECODES[4]) == [(3, None), (3, None)]  # page, tail launch
    assert parts_used(0, None, DECODES[0]) == [(1, None), (1, None)]
    assert parts_used(4, WordKernelFlags(tail_parts=3)) == [(3, PARTS_MAX_REGISTERS)]
    assert parts_used(0, None) == [(1, None)]
    assert parts_used(4, WordKernelFlags(tail_parts=1)) == [(1, None)]
    assert parts_used(0, WordKernelFlags(tail_parts=2)) == [(2, PARTS_MAX_REGISTERS)]
    assert parts_used(4, WordKernelFlags(tail_parts=3, max_registers=0)) == [(3, None)]
    assert parts_used(4, WordKernelFlags(tail_parts=1, max_registers=200)) == [(1, 200)]
    assert WordKernelFlags(tail_parts=1).keywords(4)["tail_parts"] == 1


@pytest.mark.parametrize(("options", "message"), [
    ({"tail_parts": 0}, "tail_parts must be 1 to 4"),
    ({"tail_parts": 5}, "tail_parts must be 1 to 4"),
    ({"max_registers": -1}, "max_registers must be 0")])
def test_bad_tail_options_are_refused(device: torch.device, options: dict[str, Any],
                                      message: str) -> None:
    """Tail parts outside 1..4 and negative register caps are refused before any launch."""
    pytest.importorskip("triton")
    from dyngen_core.kv.attention.triton.quant import attend_word_decode

    q = torch.zeros(1, HEADS, HEAD_DIM, device=device)
    with pytest.raises(ValueError, match=message):
        attend_word_decode(q, (), SimpleNamespace(num_seqs=1),  # type: ignore[arg-type]
                           SimpleNamespace(window=4), 1.0,  # type: ignore[arg-type]
                           key_bits=4, value_bits=4, num_kv_heads=KV_HEADS, block_n=16,
                           splits=1, warps=4, **options)
