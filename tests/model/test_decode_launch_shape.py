"""The decode launches' shape rules (`attention.triton.decode`): the split count from the batch
shape (at least one wave of `PROGRAMS_PER_SM` programs a multiprocessor, or at most one with
``one_wave``, the q8/q4 kernel's rule) and the q8/q4 kernel's register cap, which large launches
get and small ones do not. Pure arithmetic: runs without triton and without a GPU."""

from __future__ import annotations

import pytest
import torch

from dyngen_core.kv.attention.triton import decode

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
