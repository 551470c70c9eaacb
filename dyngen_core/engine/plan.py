"""What one engine step must compute (`StepPlan`) and what it produced (`StepOutcome`).

The scheduler writes a plan; the runner and sampler execute it; the scheduler applies the outcome.
Plans are plain data over integers so the control plane stays free of torch. Tensors requested by a
job (probabilities, top-k, logits) travel in the outcome as opaque objects.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class PageCopy:
    """Copy the first ``num_slots`` slots of page ``src`` into page ``dst`` before the forward
    (partial-page reuse and defragmentation)."""

    src: int
    dst: int
    num_slots: int


# A token id in a slice that stands for a sampled token still on the device (an overlapped
# step's, see `Scheduler.resolve_tokens`): never a valid id; the runner reads it on the device.
PENDING_TOKEN = -1


@dataclass(slots=True)
class SequenceSlice:
    """One job's share of a step.

    token_ids: the tokens fed this step, at positions ``start_pos ...``: a prefill chunk, or the
        last sampled token for a decode, followed by ``draft_ids`` (speculative tokens).
    page_table: the job's page ids covering every position up to the end of this slice.
    sample: True when logits are needed (the slice reaches the end of the known tokens); then
        ``1 + len(draft_ids)`` logit rows come back, one per draft position plus the bonus one.

    A slice's lists are never changed in place once planned (assign a new list instead): the
    scheduler hands a job's consecutive decode slices the same lists while they are equal.
    """

    job_id: int
    token_ids: list[int]
    start_pos: int
    page_table: list[int]
    sample: bool
    draft_ids: list[int] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids) + len(self.draft_ids)

    @property
    def end_pos(self) -> int:
        """Context length once this slice is in the cache."""
        return self.start_pos + self.num_tokens

    @property
    def num_logits(self) -> int:
        return 1 + len(self.draft_ids) if self.sample else 0

    @property
    def is_prefill(self) -> bool:
        return len(self.token_ids) > 1 or not self.sample


@dataclass
class StepPlan:
    """Everything one forward computes: ``copies`` run first, then all ``slices`` in one batch."""

    slices: list[SequenceSlice] = field(default_factory=list)
    copies: list[PageCopy] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.slices)

    @property
    def is_empty(self) -> bool:
        return not self.slices and not self.copies


# The job id of the warm-up plans' slices (no job has it).
WARM_UP_JOB_ID = -1


def warm_up_plans(max_tokens: int, page_size: int, num_pages: int,
                  short_lengths: Iterable[int] = ()) -> list[StepPlan]:
    """Prefills for a generator to run before its first job, each sampling its last row: one of
    ``min(max_tokens, num_pages * page_size)`` tokens (id 0) from position 0 through pages
    ``0, 1, ...``, then one of each of ``short_lengths`` (the runner's
    `short_prefill_lengths`: prompt lengths whose prefills take launch shapes of their own;
    each at most that many tokens, repeats dropped) from position 0 of page 0. They write only
    those pages' slots, which no job reads before writing its own, so the engine's first real
    prefills of those sizes no longer pay the device's one-time costs (kernel compiles among
    them)."""
    if max_tokens < 1 or page_size < 1 or num_pages < 1:
        raise ValueError(f"a warm-up prefill needs tokens, pages and slots; got max_tokens="
                         f"{max_tokens}, page_size={page_size}, num_pages={num_pages}")
    tokens = min(max_tokens, num_pages * page_size)
    shorts = sorted({min(n, tokens) for n in short_lengths} - {tokens})
    return [StepPlan(slices=[SequenceSlice(WARM_UP_JOB_ID, [0] * n, 0,
                                           list(range(-(-n // page_size))), True)])
            for n in (tokens, *shorts)]


@dataclass
class SampledTokens:
    """What sampling produced for one slice: the accepted tokens (one, or several with drafts),
    and what the job asked to see, one row per accepted token."""

    job_id: int
    token_ids: list[int]
    num_draft_accepted: int = 0
    probs: Any = None
    top_k_tokens: Any = None
    top_k_probs: Any = None
    logits: Any = None


@dataclass
class StepOutcome:
    """The result of running a plan: sampled tokens for every slice with ``sample=True``."""

    sampled: dict[int, SampledTokens] = field(default_factory=dict)
