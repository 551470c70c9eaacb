"""`plan_codec`: a step plan survives its flat integer form, field for field."""

from __future__ import annotations

import pytest

from dyngen_core.engine.plan import PENDING_TOKEN, PageCopy, SequenceSlice, StepPlan
from dyngen_core.engine.plan_codec import decode_plan, encode_plan


def test_a_plan_round_trips_after_a_prefix_and_before_a_suffix() -> None:
    plan = StepPlan(
        slices=[
            SequenceSlice(7, list(range(40, 90)), 0, [3, 9], sample=False),
            SequenceSlice(2**40, [PENDING_TOKEN], 300, [0, 1], sample=True, draft_ids=[5, 6, 8]),
            SequenceSlice(3, [11], 17, [4], sample=True),
        ],
        copies=[PageCopy(1, 2, 200), PageCopy(5, 6, 3)],
    )
    words = [99, 98]
    encode_plan(plan, words)
    words += [-5]
    decoded, end = decode_plan(words, 2)
    assert decoded == plan
    assert words[end:] == [-5]
    assert decoded.slices[1].sample and not decoded.slices[0].sample


def test_an_empty_plan_round_trips() -> None:
    words: list[int] = []
    encode_plan(StepPlan(), words)
    assert words == [0, 0]
    assert decode_plan(words) == (StepPlan(), 2)


def test_cut_words_are_refused() -> None:
    words: list[int] = []
    encode_plan(StepPlan([SequenceSlice(1, [1, 2, 3], 0, [0], sample=True)]), words)
    with pytest.raises(ValueError):
        decode_plan(words[:-2])
