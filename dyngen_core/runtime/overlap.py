"""Overlapping a step's host work with the next step's forward: pending tokens and token feeds.

A step's tokens chosen on the device (plain greedy: `Sampler.greedy_on_device`; sampled:
`SamplingBridge.launch`) are copied to a pinned host buffer without waiting
(`TokenLauncher.launch`): the step becomes a `PendingStep`. The generator applies it to
the scheduler with `PENDING_TOKEN`s, plans and launches the next step at once, and only then
waits for the tokens (by then the device is busy with the next forward), resolves them in the
scheduler and emits them. The next step's decode inputs that are still pending are read on the
device from the pending step's ids: a `TokenFeed` tells the runner which input rows take which
sampled row.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dyngen_core.engine.plan import PENDING_TOKEN, SequenceSlice, StepPlan
from dyngen_core.runtime.active_job import ActiveJob

_PENDING_ONLY = [PENDING_TOKEN]


@dataclass
class PendingStep:
    """A launched step whose sampled tokens are still on their way to the host.

    plan: the step's plan; active: its sampling jobs, in plan order (row i is active[i]);
    ids: [rows] int64 on the device, what the next step reads: each row's token, or -1 for a
        row without one, which a `TokenFeed` reads as token 0 (its job fails when resolved;
        its next input is computed and dropped);
    host: the rows being copied to the host, -1 where a row had no finite logit;
    ready: recorded after the copy (None on the CPU).
    """

    plan: StepPlan
    active: list[ActiveJob]
    ids: torch.Tensor
    host: torch.Tensor
    ready: torch.cuda.Event | None

    @property
    def job_ids(self) -> list[int]:
        """The sampling jobs' ids, row by row."""
        return [a.job_id for a in self.active]

    def tokens(self) -> list[int]:
        """The sampled tokens (waits for the copy); -1 where a row had no finite logit."""
        if self.ready is not None:
            self.ready.synchronize()
        return self.host[: len(self.active)].tolist()


class TokenLauncher:
    """Starts the copy of a step's device-chosen tokens to the host, without waiting.

    device: where the tokens live; on CUDA the copy goes to one of two pinned buffers (the
        previous step's may still be read), grown as needed.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._buffers: list[torch.Tensor] = []
        self._events: list[torch.cuda.Event] = []
        self._turn = 0

    def launch(self, ids: torch.Tensor, plan: StepPlan, active: list[ActiveJob],
               fed: torch.Tensor | None = None) -> PendingStep:
        """A `PendingStep` of ``ids`` ([rows] int64 on the device, -1 for a row without a
        token); ``fed``: what the next step reads instead, default ``ids`` (a feed reads -1 as
        token 0, so no clamp is launched here: its job fails when resolved, that row is
        dropped)."""
        if fed is None:
            fed = ids
        if self.device.type != "cuda":
            return PendingStep(plan, active, fed, ids, None)
        host, ready = self._buffer(ids.shape[0])
        host[: ids.shape[0]].copy_(ids, non_blocking=True)
        ready.record()
        return PendingStep(plan, active, fed, host, ready)

    def _buffer(self, rows: int) -> tuple[torch.Tensor, torch.cuda.Event]:
        """One of two (pinned buffer, event) pairs, in turn: a step's pair is reused two steps
        later, after it was resolved."""
        if len(self._buffers) < 2 or self._buffers[0].shape[0] < rows:
            size = max(rows, 256)
            self._buffers = [torch.empty(size, dtype=torch.int64).pin_memory() for _ in range(2)]
            self._events = [torch.cuda.Event(), torch.cuda.Event()]
        self._turn ^= 1
        return self._buffers[self._turn], self._events[self._turn]


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


def token_feed(plan: StepPlan, pending: PendingStep | None) -> TokenFeed | None:
    """The feed of ``plan``'s pending inputs from ``pending`` (None when it has none).

    Only decode slices carry a pending token (a prefill's tokens are the prompt's, and a
    preempted job is re-admitted only after its tokens were resolved)."""
    if pending is None:
        return None
    if _steady(plan.slices, pending.active):
        every = list(range(len(pending.active)))
        return TokenFeed(pending.ids, every, every, in_order=True)
    row_of = {}
    row = 0
    for sl in pending.plan.slices:
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
        flat += len(sl.token_ids)
    return TokenFeed(pending.ids, targets, rows) if targets else None


def _steady(slices: list[SequenceSlice], active: list[ActiveJob]) -> bool:
    """Steady decoding: the slices are the pending step's jobs, in the same order, each
    feeding only its pending token (one pass: this runs every step over every job)."""
    if len(slices) != len(active):
        return False
    for sl, a in zip(slices, active):
        if sl.job_id != a.job_id or sl.token_ids != _PENDING_ONLY:
            return False
    return True
