"""`SharedPrefixTracker`: the plan of every decode step equals `plan_shared_prefixes`' for it,
whatever happened since the previous step (jobs joining and leaving, tables growing, copy-on-write
divergence, preemption, defragmentation relabelling pages, the batch reordered), and steps that
change no shared page are not planned again."""

from __future__ import annotations

import random
from dataclasses import dataclass

from hypothesis import given, settings
from hypothesis import strategies as st

from dyngen_core.engine.cascade import (
    CascadePlan,
    CascadePolicy,
    SharedPrefixTracker,
    plan_shared_prefixes,
)
from dyngen_core.engine.plan import SequenceSlice

PS = 4
ANY = CascadePolicy(min_saved_keys=0)


@dataclass
class _Seq:
    table: list[int]
    ctx: int


class _Batch:
    """Running decodes (job -> `_Seq`), their page tables drawn from a few stems."""

    def __init__(self, rng: random.Random, stems: int) -> None:
        self.rng = rng
        self.next_page = 1000
        self.next_job = 0
        self.stems = [self.fresh(rng.randint(1, 6)) for _ in range(stems)]
        self.jobs: dict[int, _Seq] = {}
        self.order: list[int] = []

    def fresh(self, count: int) -> list[int]:
        self.next_page += count
        return list(range(self.next_page - count, self.next_page))

    def join(self, job: int | None = None) -> None:
        stem = self.rng.choice(self.stems)
        table = stem[:self.rng.randint(0, len(stem))]
        table += self.fresh(self.rng.randint(0 if table else 1, 3))
        ctx = self.rng.randint((len(table) - 1) * PS + 1, len(table) * PS)
        if job is None:
            job, self.next_job = self.next_job, self.next_job + 1
        self.jobs[job] = _Seq(table, ctx)
        self.order.append(job)

    def leave(self, job: int) -> None:
        del self.jobs[job]
        self.order.remove(job)

    def grow(self, job: int, tokens: int) -> None:
        """Decode ``tokens`` more; a new page is fresh, or (dedup) another job's page there."""
        seq = self.jobs[job]
        seq.ctx += tokens
        table = seq.table
        while (seq.ctx - 1) // PS >= len(table):
            others = [other.table for j, other in self.jobs.items()
                      if j != job and len(other.table) > len(table)
                      and other.table[:len(table)] == table]
            table.append(self.rng.choice(others)[len(table)] if others and self.rng.random() < 0.5
                         else self.fresh(1)[0])

    def step(self) -> list[SequenceSlice]:
        return [SequenceSlice(job, [7], self.jobs[job].ctx - 1, list(self.jobs[job].table), True)
                for job in self.order]


def _event(batch: _Batch, kind: str) -> None:
    rng, jobs = batch.rng, batch.order
    if kind == "join" or not jobs:
        batch.join()
        return
    job = rng.choice(jobs)
    seq = batch.jobs[job]
    table = seq.table
    if kind == "leave":
        batch.leave(job)
    elif kind == "grow":
        batch.grow(job, rng.choice([1, 1, PS - 1, PS, 2 * PS + 1]))
    elif kind == "cow":  # copy-on-write: a page of the table replaced by the job's own copy
        table[rng.randrange(len(table))] = batch.fresh(1)[0]
    elif kind == "preempt":  # out, then back on its recomputed (mostly cached) prefix
        batch.leave(job)
        batch.join(job)
    elif kind == "defrag":  # every table relabelled through one permutation of the pages
        pages = sorted({p for other in batch.jobs.values() for p in other.table})
        moved = dict(zip(pages, rng.sample(pages, len(pages)), strict=True))
        for other in batch.jobs.values():
            other.table = [moved[p] for p in other.table]
    elif kind == "dedup":  # fills its page with what another job's page there holds: takes it
        k = (seq.ctx - 1) // PS
        others = [other.table for j, other in batch.jobs.items()
                  if j != job and len(other.table) > k and other.table[:k] == table[:k]]
        if others:
            table[k] = rng.choice(others)[k]
            seq.ctx = (k + 1) * PS
    elif kind == "shuffle":
        rng.shuffle(jobs)
    elif kind == "shrink":  # a rewind: drops its last tokens and pages
        seq.ctx = rng.randint(1, seq.ctx)
        seq.table = table[:(seq.ctx - 1) // PS + 1]


EVENTS = ["join", "leave", "grow", "grow", "grow", "dedup", "dedup", "cow", "preempt", "defrag",
          "shuffle", "shrink"]


def _expected(slices: list[SequenceSlice], policy: CascadePolicy) -> CascadePlan | None:
    return plan_shared_prefixes([s.page_table for s in slices], [s.start_pos + 1 for s in slices],
                                [1] * len(slices), PS, policy)


@settings(max_examples=150, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), stems=st.integers(1, 4),
       steps=st.lists(st.lists(st.sampled_from(EVENTS), max_size=4), min_size=1, max_size=25),
       policy=st.sampled_from([ANY, CascadePolicy(3, 1, 0), CascadePolicy(2, 2, 0),
                               CascadePolicy(2, 1, 3 * PS)]))
def test_every_step_plans_what_the_planner_would(seed: int, stems: int, steps: list[list[str]],
                                                  policy: CascadePolicy) -> None:
    batch = _Batch(random.Random(seed), stems)
    for _ in range(batch.rng.randint(0, 8)):
        batch.join()
    tracker = SharedPrefixTracker(PS, policy)
    for events in steps:
        for kind in events:
            _event(batch, kind)
        slices = batch.step()
        assert tracker.plan(slices) == _expected(slices, policy), events
        assert tracker.plan(slices) == _expected(slices, policy)  # the same step again


def test_steps_that_share_no_new_page_reuse_the_plan() -> None:
    """Jobs on one document grow into pages of their own, and a job sharing nothing comes and
    goes: one plan for all of it; a job reading the document joining is planned again."""
    document = [1, 2, 3]
    jobs = {i: _Seq(document + [100 + i], 3 * PS + 1 + i) for i in range(4)}

    def step() -> list[SequenceSlice]:
        return [SequenceSlice(j, [7], seq.ctx - 1, list(seq.table), True)
                for j, seq in jobs.items()]

    tracker = SharedPrefixTracker(PS, ANY)
    first = tracker.plan(step())
    assert first is not None and first.groups[0].members == (0, 1, 2, 3)
    for _ in range(3 * PS):  # into their own pages (each a fresh page when reached)
        for j, seq in jobs.items():
            seq.ctx += 1
            if (seq.ctx - 1) // PS >= len(seq.table):
                seq.table.append(200 + 10 * j + len(seq.table))
        assert tracker.plan(step()) is first
    jobs[9] = _Seq([50, 51], 2 * PS)  # shares nothing
    assert tracker.plan(step()) == first
    del jobs[9]
    assert tracker.plan(step()) == first
    assert tracker.replans == 1
    jobs[5] = _Seq(document + [300], 3 * PS + 2)  # reads the document
    plan = tracker.plan(step())
    assert plan is not None and plan.groups[0].members == (0, 1, 2, 3, 4)
    assert tracker.replans == 2


def test_growing_into_a_page_another_job_holds_is_planned_again() -> None:
    """Job 1 sees only the shared [1, 2]; once its table takes job 0's page 5 (dedup of a filled
    page) and its context covers it, both share three pages."""
    tracker = SharedPrefixTracker(PS, ANY)
    step = [SequenceSlice(0, [7], 3 * PS, [1, 2, 5, 8], True),
            SequenceSlice(1, [7], 2 * PS + 1, [1, 2, 9], True)]
    plan = tracker.plan(step)
    assert plan is not None and plan.groups[0].prefix_pages == 2
    step[1] = SequenceSlice(1, [7], 3 * PS - 1, [1, 2, 5], True)
    plan = tracker.plan(step)
    assert plan is not None and plan.groups[0].prefix_pages == 3


def test_steps_that_are_not_all_decodes_plan_nothing_and_change_nothing() -> None:
    tables = [[1, 2], [1, 3]]
    decodes = [SequenceSlice(j, [7], 2 * PS - 1, t, True) for j, t in enumerate(tables)]
    tracker = SharedPrefixTracker(PS, ANY)
    plan = tracker.plan(decodes)
    assert plan is not None
    prefill = [decodes[0], SequenceSlice(1, [7, 8], 2 * PS - 2, tables[1], True)]
    assert tracker.plan(prefill) is None
    drafted = [decodes[0], SequenceSlice(1, [7], 2 * PS - 1, tables[1], True, [5])]
    assert tracker.plan(drafted) is None
    assert tracker.plan(decodes) is plan and tracker.replans == 1


def test_a_job_twice_in_a_step_is_planned_from_scratch() -> None:
    twice = [SequenceSlice(0, [7], 2 * PS - 1, [1, 2], True),
             SequenceSlice(0, [7], 2 * PS - 1, [1, 3], True)]
    tracker = SharedPrefixTracker(PS, ANY)
    for _ in range(2):
        assert tracker.plan(twice) == _expected(twice, ANY) is not None
    assert tracker.replans == 2
