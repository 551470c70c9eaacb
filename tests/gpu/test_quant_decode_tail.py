"""The q8/q4 decode kernel's tail in three parts (two launches with a recent window,
`quant_decode.tail_parts_for`): the window's last blocks, the page heads and the window's exact
rows as separate programs give the output of the single serial tail (one launch) and of the
sdpa reference over the same storage. Covered: no window, a window of 4 and of 16 positions
(the tail's blocks empty, one block or two), a sequence without a window slot, contexts
shorter than a page (down to the step's own token), 8, 64 and 128 page splits (mostly empty
partials); unwritten partials or outputs (poisoned with NaN) would show. Runs on CUDA, or on
the CPU under TRITON_INTERPRET=1 (small shapes)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from dyngen_core.kv.attention.base import ForwardBatch
from dyngen_core.kv.attention.sdpa import SdpaBackend
from dyngen_core.kv.quant.storage import QuantStorage
from tests.gpu.quant_setup import decode_step, int8_exact_queries

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
    """``backend``'s output for one decode step over a fresh storage (float32), for queries
    the kernel's int8 query codes hold exactly."""
    gen = torch.Generator().manual_seed(seed + 1)
    q = int8_exact_queries(len(decodes), HEADS, HEAD_DIM, gen).to(device)
    storage, batch, k, v = _setup(mode, window, decodes, device, seed)
    return backend.attend(0, q, k, v, storage, batch, HEAD_DIM ** -0.5).float()


def _routed(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """Poison (NaN) the word kernel's partial buffers and output before the kernels write
    them (inside `attend_word_decode` only); returns every kernel launch's grid and
    constexprs."""
    from dyngen_core.kv.attention.triton import paged, quant_decode
    from tests.gpu.test_quant_decode_triton import _Recorded

    launches: list[dict[str, Any]] = []
    attend_word_decode = quant_decode.attend_word_decode
    empty, empty_like = torch.empty, torch.empty_like

    def poisoned(maker: Any) -> Any:
        return lambda *args, **kw: maker(*args, **kw).fill_(float("nan"))

    def routed(*args: Any, **keywords: Any) -> torch.Tensor:
        with monkeypatch.context() as patch:
            patch.setattr(quant_decode.torch, "empty", poisoned(empty))
            patch.setattr(quant_decode.torch, "empty_like", poisoned(empty_like))
            return attend_word_decode(*args, **keywords)

    monkeypatch.setattr(paged, "attend_word_decode", routed)
    monkeypatch.setattr(quant_decode, "quant_decode_kernel",
                        _Recorded(quant_decode.quant_decode_kernel, launches))
    return launches


def _word_output(monkeypatch: pytest.MonkeyPatch, device: torch.device, mode: str,
                 window: int, decodes: list[tuple[int, bool]], splits: int,
                 launches: int) -> tuple[torch.Tensor, list[dict[str, Any]]]:
    """The word kernel's output over ``splits`` page splits in ``launches`` launches, and
    its kernel launches."""
    from tests.gpu.test_quant_decode_triton import _backend

    with monkeypatch.context() as patch:
        backend = _backend(patch, splits, programs_per_sm=64, launches=launches)
        used = _routed(patch)
        out = _attend(backend, mode, window, decodes, device)
    assert used and torch.isfinite(out).all()
    return out, used


@pytest.mark.parametrize("mode", ["q4", "q8"])
@pytest.mark.parametrize("window", [0, 4, 16])
def test_three_tail_parts_match_one_and_sdpa(device: torch.device,
                                             monkeypatch: pytest.MonkeyPatch, mode: str,
                                             window: int) -> None:
    """Batch 3, 3 page splits: in two launches the tail runs in three parts (one without a
    window), in one launch as a single program; both give the reference's output."""
    decodes = DECODES[window]
    one, single = _word_output(monkeypatch, device, mode, window, decodes, 3, launches=1)
    parts, used = _word_output(monkeypatch, device, mode, window, decodes, 3, launches=2)
    reference = _attend(SdpaBackend(), mode, window, decodes, device)
    assert [launch["TAIL_PARTS"] for launch in single] == [1]
    assert [launch["TAIL_PARTS"] for launch in used] == [3 if window else 1] * 2
    torch.testing.assert_close(parts, one, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(parts, reference, rtol=2e-4, atol=2e-4)


@pytest.mark.parametrize("splits", [8, 64, 128])
def test_many_page_splits(device: torch.device, monkeypatch: pytest.MonkeyPatch,
                          splits: int) -> None:
    """Batch 1 whose tail blocks span two, over 8, 64 and 128 page splits (almost all empty
    at this context): one launch with the single tail and two with three tail parts, merged
    over a power-of-two pad of the partials, both equal the reference."""
    reference = _attend(SdpaBackend(), "q4", 16, ONE_DECODE, device)
    for launches, parts in ((1, 1), (2, 3)):
        out, used = _word_output(monkeypatch, device, "q4", 16, ONE_DECODE, splits, launches)
        grids = [launch["grid"][2] for launch in used]
        assert grids == ([splits + parts] if launches == 1 else [splits, parts])
        assert used[0]["NUM_SPLITS"] == splits
        torch.testing.assert_close(out, reference, rtol=2e-4, atol=2e-4)


def test_tail_parts_follow_the_window_and_the_batch(device: torch.device,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """The backend's rule: batches of up to `ONE_LAUNCH_MAX_SEQS` sequences run one launch
    with the single tail (q4 and q8 alike), larger ones two, the tail in three parts when the
    cache has a recent window (a smaller limit here stands for a batch above it)."""
    from dyngen_core.kv.attention.triton import quant_decode
    from tests.gpu.test_quant_decode_triton import _backend

    def parts_used(window: int, decodes: list[tuple[int, bool]], mode: str = "q4",
                   limit: int | None = None) -> list[int]:
        with monkeypatch.context() as patch:
            backend = _backend(patch, 2)
            if limit is not None:
                patch.setattr(quant_decode, "ONE_LAUNCH_MAX_SEQS", limit)
            used = _routed(patch)
            assert torch.isfinite(_attend(backend, mode, window, decodes, device)).all()
        return [launch["TAIL_PARTS"] for launch in used]

    assert len(DECODES[4]) <= quant_decode.ONE_LAUNCH_MAX_SEQS
    assert parts_used(4, ONE_DECODE) == [1]
    assert parts_used(4, DECODES[4]) == [1]
    assert parts_used(4, DECODES[4], "q8") == [1]  # q8: one launch, its tail in one part
    assert parts_used(4, DECODES[4], limit=2) == [3, 3]  # page launch, tail launch
    assert parts_used(4, DECODES[4], "q8", limit=2) == [3, 3]
    assert parts_used(0, DECODES[0], limit=2) == [1, 1]
    assert parts_used(0, ONE_DECODE, limit=2) == [1]
    assert quant_decode.tail_parts_for(4, 2) == 3 and quant_decode.tail_parts_for(4, 1) == 1
    assert quant_decode.launches_for(1) == 1
    assert quant_decode.launches_for(quant_decode.ONE_LAUNCH_MAX_SEQS) == 1
    assert quant_decode.launches_for(quant_decode.ONE_LAUNCH_MAX_SEQS + 1) == 2
