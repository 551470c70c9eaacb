"""Token feeds of overlapped steps: which inputs of a step read the step in flight's tokens.

A pending input's target is its flat row in the step's forward, where every slice before it
feeds its tokens and then its drafts (a speculative step can draft for one job while another's
token is still on the device)."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from dyngen_core.engine.plan import PENDING_TOKEN, SequenceSlice, StepPlan
from dyngen_core.runtime.overlap import InFlight, TokenFeed, token_feed
from dyngen_core.sampling.step import SampledStep


def _in_flight(job_ids: list[int]) -> InFlight:
    records = [SimpleNamespace(job_id=j) for j in job_ids]
    sampled = SampledStep(records, ids=torch.tensor([11, 12, 13]))  # type: ignore[arg-type]
    plan = StepPlan([SequenceSlice(j, [5], 9, [0], True) for j in job_ids])
    return InFlight(plan, sampled)


def test_pending_inputs_after_drafted_slices_count_the_drafts() -> None:
    in_flight = _in_flight([1, 2, 3])
    plan = StepPlan([
        SequenceSlice(7, [40], 3, [4], True, draft_ids=[41, 42, 43]),  # rows 0..3
        SequenceSlice(2, [PENDING_TOKEN], 10, [1], True),  # row 4
        SequenceSlice(8, [50], 6, [5], True, draft_ids=[51]),  # rows 5, 6
        SequenceSlice(3, [PENDING_TOKEN], 10, [2], True),  # row 7
    ])
    feed = token_feed(plan, in_flight)
    assert isinstance(feed, TokenFeed)
    assert feed.targets == [4, 7] and feed.rows == [1, 2] and not feed.in_order
    inputs = torch.tensor([40, 41, 42, 43, PENDING_TOKEN, 50, 51, PENDING_TOKEN])
    feed.apply(inputs, len(inputs))
    assert inputs.tolist() == [40, 41, 42, 43, 12, 50, 51, 13]


def test_steady_decoding_is_one_copy_in_order() -> None:
    in_flight = _in_flight([1, 2, 3])
    plan = StepPlan([SequenceSlice(j, [PENDING_TOKEN], 10, [0], True) for j in (1, 2, 3)])
    feed = token_feed(plan, in_flight)
    assert feed is not None and feed.in_order
    inputs = torch.full((4,), PENDING_TOKEN)  # a bucket of 4: the padding row repeats the last
    feed.apply(inputs, 3)
    assert inputs.tolist() == [11, 12, 13, 13]
