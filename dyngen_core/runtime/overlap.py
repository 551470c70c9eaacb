"""Overlapping a step's host work with the next step's forward: token feeds.

A step whose tokens the `StepSampler` left on the device (``SampledStep.ids``) is applied to the
scheduler with `PENDING_TOKEN`s; the generator plans and launches the next step at once, and
only then waits for the tokens (by then the device is busy with the next forward), resolves
them in the scheduler and emits them. The next step's decode inputs that are still pending are
read on the device from the step in flight's ids: a `TokenFeed` tells the runner which input
rows take which sampled row.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from dyngen_core.engine.plan import PENDING_TOKEN, SequenceSlice, StepPlan
from dyngen_core.engine.record import JobRecord
from dyngen_core.sampling.step import SampledStep

_PENDING_ONLY = [PENDING_TOKEN]


@dataclass
class InFlight:
    """A step applied to the scheduler with `PENDING_TOKEN`s whose real tokens are still on the
    device: its plan and its `SampledStep` (whose ``ids`` the next step reads)."""

    plan: StepPlan
    sampled: SampledStep


@dataclass
class TokenFeed:
    """Inputs of a step that are another step's sampled tokens, read on the device.

    ids: the pending step's device ids (-1, a row without a token, is read as token 0);
    targets: flat input rows of this step to fill;
    rows: for each target, the row of ``ids`` it takes; in_order: targets and rows are both
    0, 1, 2, ... (steady decoding: one contiguous copy).
    """

    ids: torch.Tensor
    targets: list[int]
    rows: list[int]
    in_order: bool = False

    def apply(self, input_ids: torch.Tensor, count: int) -> None:
        """Fill the targets of ``input_ids`` (the step's [count] inputs, then padding rows that
        repeat the last input, as CUDA-graph buckets have) from ``ids``."""
        targets, rows = self.targets, self.rows
        # The clamp reads -1 as token 0 in the copy itself (a separate clamp of the sampled ids
        # was one more launch every step).
        if self.in_order:
            torch.clamp(self.ids[: len(targets)], min=0, out=input_ids[: len(targets)])
        else:
            device = input_ids.device
            index = torch.tensor(targets, dtype=torch.int64).to(device, non_blocking=True)
            source = torch.tensor(rows, dtype=torch.int64).to(device, non_blocking=True)
            input_ids.index_copy_(0, index, self.ids.index_select(0, source).clamp_(min=0))
        if input_ids.shape[0] > count and targets and targets[-1] == count - 1:
            input_ids[count:].copy_(input_ids[count - 1].expand(input_ids.shape[0] - count))


def token_feed(plan: StepPlan, in_flight: InFlight | None) -> TokenFeed | None:
    """The feed of ``plan``'s pending inputs from the step in flight, or None when ``plan`` has
    no pending input. Targets count every input of the slices before, drafts included (ask once
    the plan has its drafts).

    Only decode slices carry a pending token (a prefill's tokens are the prompt's, and a
    preempted job is re-admitted only after its tokens were resolved)."""
    if in_flight is None or in_flight.sampled.ids is None:
        return None
    ids, pending_plan, records = in_flight.sampled.ids, in_flight.plan, in_flight.sampled.records
    if _steady(plan.slices, records):
        every = list(range(len(records)))
        return TokenFeed(ids, every, every, in_order=True)
    row_of = {}
    row = 0
    for sl in pending_plan.slices:
        if sl.sample:
            row_of[sl.job_id] = row
            row += 1
    targets: list[int] = []
    rows: list[int] = []
    flat = 0
    for sl in plan.slices:
        if sl.token_ids[-1] == PENDING_TOKEN:
            if len(sl.token_ids) != 1 or sl.job_id not in row_of:
                raise RuntimeError(f"job {sl.job_id}: a pending token outside a decode of the "
                                   "previous step; resolve the previous step first")
            targets.append(flat)
            rows.append(row_of[sl.job_id])
        flat += len(sl.token_ids) + len(sl.draft_ids)
    return TokenFeed(ids, targets, rows) if targets else None


def _steady(slices: list[SequenceSlice], records: Sequence[JobRecord]) -> bool:
    """Steady decoding: the slices are the step in flight's jobs, in the same order, each
    feeding only its pending token (one pass: this runs every step over every job)."""
    if len(slices) != len(records):
        return False
    for sl, r in zip(slices, records):
        if sl.job_id != r.job_id or sl.token_ids != _PENDING_ONLY:
            return False
    return True
