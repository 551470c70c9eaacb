"""Sequence slots: stable per running job, reassigned least-recently-used first."""

from __future__ import annotations

import pytest

from dyngen_core.runtime.runner import SequenceSlots


def test_jobs_keep_their_slots_across_steps() -> None:
    slots = SequenceSlots(4)
    first, fresh = slots.assign([10, 11, 12])
    assert sorted(first) == [0, 1, 2] and sorted(fresh) == sorted(first)
    again, fresh = slots.assign([12, 10, 11])
    assert again == [first[2], first[0], first[1]] and fresh == []


def test_the_least_recently_used_absent_job_gives_up_its_slot() -> None:
    slots = SequenceSlots(3)
    a, _ = slots.assign([1, 2, 3])
    slots.assign([2, 3])  # job 1 is now the least recently used
    slots.assign([3, 2])
    got, fresh = slots.assign([2, 3, 4])
    assert got[2] == a[0] and fresh == [a[0]]
    got, fresh = slots.assign([1, 3, 4])  # job 1 returns: job 2 (absent, oldest) yields
    assert got[0] == a[1] and fresh == [a[1]]


def test_more_jobs_than_slots_get_none_for_the_excess() -> None:
    slots = SequenceSlots(2)
    got, fresh = slots.assign([1, 2, 3])
    assert got[:2] == [0, 1] and got[2] == -1 and fresh == [0, 1]
    got, _ = slots.assign([3])
    assert got[0] in (0, 1)


def test_capacity_must_be_positive() -> None:
    with pytest.raises(ValueError, match="capacity"):
        SequenceSlots(0)
