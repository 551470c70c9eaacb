"""A plan stays what it was when it was made, though decode slices share lists.

`Scheduler.schedule` hands a job's decode slice the fed-token, page-table and draft lists of its
previous decode slice while they still equal the job's (no list is allocated per decode in
steady decoding). Every plan must keep its contents after later steps, whatever happens to the
job since (new pages, preemption, rewinds, folded pages, defragmentation), and each slice must
hold the job's state at planning time.
"""

from __future__ import annotations

import copy
import random
from collections.abc import Callable

import pytest

from dyngen_core.config import CacheConfig, SchedulerConfig
from dyngen_core.engine.plan import PENDING_TOKEN, StepPlan
from dyngen_core.engine.scheduler import Scheduler
from tests.unit.fake_engine import FakeEngine
from tests.unit.test_scheduler_apply_tokens import PendingEngine

PS = 32


def _contents(plan: StepPlan) -> list[tuple[int, list[int], int, list[int], bool, list[int]]]:
    return [(sl.job_id, list(sl.token_ids), sl.start_pos, list(sl.page_table), sl.sample,
             list(sl.draft_ids)) for sl in plan.slices]


class Recorder:
    """Wraps a scheduler's `schedule`: keeps every plan with a copy of its contents and checks
    each decode slice against the job's state at planning time."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.plans: list[tuple[StepPlan, object]] = []
        self.shared = 0
        self._schedule: Callable[[], StepPlan] = scheduler.schedule
        self._scheduler = scheduler
        self._last: dict[int, object] = {}
        scheduler.schedule = self  # type: ignore[method-assign]

    def __call__(self) -> StepPlan:
        plan = self._schedule()
        for sl in plan.slices:
            seq = self._scheduler.sequence(sl.job_id)
            assert seq is not None
            assert tuple(sl.page_table[:len(seq.page_table)]) == seq.page_table
            if len(sl.token_ids) == 1 and sl.sample:
                assert sl.token_ids == [seq.token_ids[-1]]
                self.shared += sl.page_table is self._last.get(sl.job_id)
                self._last[sl.job_id] = sl.page_table
        self.plans.append((plan, copy.deepcopy(_contents(plan))))
        return plan

    def check_unchanged(self) -> None:
        for k, (plan, contents) in enumerate(self.plans):
            assert _contents(plan) == contents, f"plan {k} changed after it was made"


@pytest.mark.parametrize("overlapped", [False, True])
@pytest.mark.parametrize("seed", range(3))
def test_plans_keep_their_contents(overlapped: bool, seed: int) -> None:
    rng = random.Random(seed)
    cache = CacheConfig(max_tokens=8 * PS, page_size=PS)
    scheduler = Scheduler(cache, SchedulerConfig(max_chunk_size=40, max_batch_size=5))
    engine = PendingEngine(scheduler) if overlapped else FakeEngine(scheduler)
    recorder = Recorder(scheduler)
    shared = [rng.randrange(50) for _ in range(40)]
    for j in range(7):
        prompt = (shared if j % 2 == 0 else []) + [rng.randrange(50) for _ in range(3 + 4 * j)]
        engine.add(j, prompt, 40 + rng.randrange(60))
    for step in range(400):
        if step % 11 == 10:  # a rewind, as a banned string makes
            job = rng.randrange(7)
            seq = scheduler.sequence(job)
            if seq is not None and seq.num_generated > 2 and PENDING_TOKEN not in seq.token_ids:
                scheduler.rewind(job, rng.randrange(1, seq.num_generated))
        if step % 50 == 49:
            scheduler.defragment(max_moves=4)
        for j in range(7):
            seq = scheduler.sequence(j)
            if seq is not None and seq.num_generated >= 40 and rng.random() < 0.05:
                scheduler.finish(j)
        if scheduler.num_running == 0 and scheduler.num_waiting == 0:
            break
        engine.step()
    recorder.check_unchanged()
    assert scheduler.stats().preemptions > 0
    assert recorder.shared > 50  # steady decodes reuse their lists
