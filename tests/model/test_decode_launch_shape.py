"""The decode launches' shape rules (`attention.triton.decode`): the split count from the batch
shape (at least one wave of `PROGRAMS_PER_SM` programs a multiprocessor, or at most one with
``one_wave``, the q8/q4 kernel's rule in one launch) and the q8/q4 kernel's register cap, which
large launches get and small ones do not; and the q8/q4 kernel's launches as they come out of
`attend_word_decode` for an H200 (captured, not run). Runs without triton and without a GPU."""

from __future__ import annotations

import pytest
import torch

from benchmarks.kernels import quant_sass
from dyngen_core.kv.attention.triton import decode, quant_decode

H200 = 132


@pytest.fixture
def h200(monkeypatch: pytest.MonkeyPatch) -> torch.device:
    """A device the rules see as an H200: 132 multiprocessors, 4 programs each, 32 splits."""
    monkeypatch.setattr(decode, "multiprocessors", lambda device: H200)
    monkeypatch.setattr(decode, "PROGRAMS_PER_SM", 4)
    monkeypatch.setattr(decode, "MAX_SPLITS", 32)
    return torch.device("cpu")


@pytest.mark.parametrize(("pairs", "up", "down"), [
    (8, 32, 32),      # batch 1 of 8 KV heads: MAX_SPLITS either way
    (64, 9, 8),       # batch 8: 528 / 64 = 8.25
    (256, 3, 2),      # batch 32: 528 / 256 = 2.06
    (528, 1, 1),      # exactly one program a slot
    (2048, 1, 1),     # more pairs than slots: one split, never zero
])
def test_split_count_rounds_up_or_down_to_a_wave(h200: torch.device, pairs: int, up: int,
                                                  down: int) -> None:
    assert decode.decode_splits(pairs, h200) == up
    assert decode.decode_splits(pairs, h200, one_wave=True) == down


def test_one_wave_never_exceeds_the_slots(h200: torch.device) -> None:
    for pairs in range(1, 600):
        splits = decode.decode_splits(pairs, h200, one_wave=True)
        assert splits >= 1
        assert pairs * splits <= 4 * H200 or splits == 1


def test_register_cap_only_for_launches_past_three_programs_a_multiprocessor(
        h200: torch.device) -> None:
    # 4 programs of 4 warps share 64K registers: 128 a thread.
    assert decode.register_cap(3 * H200, 4, h200) is None
    assert decode.register_cap(3 * H200 + 1, 4, h200) == 128
    assert decode.register_cap(256 * 3, 4, h200) == 128  # q8 batch 32: 2 splits + the tail
    assert decode.register_cap(8 * 33, 4, h200) is None  # batch 1: one wave either way
    assert decode.register_cap(3 * H200 + 1, 8, h200) == 64


@pytest.mark.parametrize(("batch", "splits"), [(1, 32), (8, 8), (32, 2), (48, 2), (64, 2)])
def test_page_splits_fill_one_wave_in_one_launch_only(h200: torch.device, batch: int,
                                                       splits: int) -> None:
    # Above `ONE_LAUNCH_MAX_SEQS` (two launches) the split count rounds up: one split a
    # (sequence, head) lost at batch 64.
    assert quant_decode.page_splits(batch, 8, h200) == splits


@pytest.mark.parametrize(("bits", "batch", "launches"), [
    (8, 1, [(0, 32, None)]),
    (8, 32, [(0, 2, 128)]),
    (4, 32, [(0, 2, 128)]),
    (8, 64, [(1, 2, None), (2, 2, None)]),
])
def test_the_word_kernel_is_capped_only_in_one_large_launch(
        bits: int, batch: int, launches: list[tuple[int, int, int | None]]) -> None:
    captured = quant_sass.captured_launches(bits, batch)
    assert [(k["PROGRAMS"], k["NUM_SPLITS"], k["maxnreg"]) for _, k in captured] == launches
