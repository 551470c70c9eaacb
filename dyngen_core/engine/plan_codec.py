"""A `StepPlan` as a flat list of integers, and back: the form a tensor-parallel rank 0 sends
its plans in (one tensor broadcast a step, no pickling).

Layout: ``[num_slices, num_copies]``, then per slice ``[job_id, start_pos, sample, num_tokens,
num_pages, num_drafts]`` followed by its token ids, page table and draft ids, then per copy
``[src, dst, num_slots]``. Every value is an int (token ids may be `PENDING_TOKEN`).
"""

from __future__ import annotations

from collections.abc import Sequence

from dyngen_core.engine.plan import PageCopy, SequenceSlice, StepPlan

_SLICE_HEADER = 6


def encode_plan(plan: StepPlan, out: list[int]) -> None:
    """Append ``plan``'s words to ``out``."""
    out += (len(plan.slices), len(plan.copies))
    for s in plan.slices:
        out += (s.job_id, s.start_pos, int(s.sample), len(s.token_ids), len(s.page_table),
                len(s.draft_ids))
        out += s.token_ids
        out += s.page_table
        out += s.draft_ids
    for c in plan.copies:
        out += (c.src, c.dst, c.num_slots)


def decode_plan(words: Sequence[int], start: int = 0) -> tuple[StepPlan, int]:
    """The plan whose words begin at ``words[start]``, and the index just past them. Raises
    ValueError when the words end before the plan does (a truncated message)."""
    num_slices, num_copies = words[start], words[start + 1]
    at = start + 2
    slices = []
    for _ in range(num_slices):
        job_id, start_pos, sample, tokens, pages, drafts = words[at:at + _SLICE_HEADER]
        at += _SLICE_HEADER
        token_ids = list(words[at:at + tokens])
        at += tokens
        page_table = list(words[at:at + pages])
        at += pages
        draft_ids = list(words[at:at + drafts])
        at += drafts
        slices.append(SequenceSlice(job_id, token_ids, start_pos, page_table, bool(sample),
                                    draft_ids))
    copies = []
    for _ in range(num_copies):
        src, dst, slots = words[at:at + 3]
        copies.append(PageCopy(src, dst, slots))
        at += 3
    if at > len(words):
        raise ValueError(f"a step plan's words end at {len(words)} but the plan needs {at}; "
                         "the message was cut short")
    return StepPlan(slices, copies), at
