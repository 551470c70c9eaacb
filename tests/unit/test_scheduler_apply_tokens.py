"""`Scheduler.apply_tokens` (the generator's fast path: one token per sampling slice, no
`SampledTokens`) leaves the scheduler exactly as `apply` does.

Two fake engines run the same jobs in lockstep, one applying outcomes with `apply`, the other
with `apply_tokens`; after every step their plans, sequences, pages and counters must agree, and
the fake KV store checks every computed slot (see `fake_engine`).
"""

from __future__ import annotations

import random

import pytest

from dyngen_core.config import CacheConfig, SchedulerConfig
from dyngen_core.plan import StepPlan
from dyngen_core.scheduler import Scheduler
from tests.unit.fake_engine import FakeEngine, true_continuation

PS = 32


class TokensEngine(FakeEngine):
    """A `FakeEngine` that applies each step's outcome through `apply_tokens`."""

    def step(self) -> StepPlan:
        plan = self.s.schedule()
        outcome = self.run(plan)
        tokens = [outcome.sampled[sl.job_id].token_ids[0] for sl in plan.slices if sl.sample]
        self.s.apply_tokens(plan, tokens)
        for job_id, sampled in outcome.sampled.items():
            self.generated[job_id].extend(sampled.token_ids)
        self.verify()
        self.last_plan = plan
        return plan


def _pair(pages: int, **config: object) -> tuple[FakeEngine, FakeEngine]:
    cache = CacheConfig(max_tokens=pages * PS, page_size=PS)
    return (FakeEngine(Scheduler(cache, SchedulerConfig(**config))),  # type: ignore[arg-type]
            TokensEngine(Scheduler(cache, SchedulerConfig(**config))))  # type: ignore[arg-type]


def _state(engine: FakeEngine) -> object:
    s = engine.s
    views = [s.sequence(j) for j in sorted(engine.generated)]
    return ([None if v is None else (v.token_ids, v.num_computed, v.page_table, v.status)
             for v in views], s.stats(), s.pool.num_free)


def _plan(plan: StepPlan) -> object:
    return [(sl.job_id, sl.token_ids, sl.start_pos, sl.page_table, sl.sample)
            for sl in plan.slices], plan.copies


@pytest.mark.parametrize("seed", range(4))
def test_apply_tokens_matches_apply_step_by_step(seed: int) -> None:
    rng = random.Random(seed)
    # A tiny cache (preemption), shared prefixes (dedup, prompt cache), chunked prefill.
    general, fast = _pair(6, max_chunk_size=40, max_batch_size=5)
    shared = [rng.randrange(50) for _ in range(40)]
    jobs = {}
    for j in range(9):
        prompt = (shared if j % 3 == 0 else []) + [rng.randrange(50) for _ in range(3 + 5 * j)]
        jobs[j] = (prompt, 30 + rng.randrange(60))  # growing jobs get preempted
        general.add(j, prompt, jobs[j][1])
        fast.add(j, prompt, jobs[j][1])
    done: set[int] = set()
    for _ in range(2000):
        for j, (_, limit) in jobs.items():
            seq = general.s.sequence(j)
            if j not in done and seq is not None and seq.num_generated >= limit:
                general.s.finish(j)
                fast.s.finish(j)
                done.add(j)
        if len(done) == len(jobs):
            break
        assert _plan(general.step()) == _plan(fast.step())
        assert _state(general) == _state(fast)
    assert len(done) == len(jobs)
    assert fast.s.stats().preemptions > 0 and fast.s.stats().prefill_tokens_reused > 0
    for j, (prompt, limit) in jobs.items():
        assert fast.generated[j][:limit] == true_continuation(prompt, limit)


def test_apply_tokens_skips_finished_jobs_and_rejects_drafts() -> None:
    _, engine = _pair(8)
    engine.add(0, [1, 2, 3], 5)
    engine.add(1, [4, 5, 6], 5)
    engine.step()
    plan = engine.s.schedule()
    engine.s.finish(0)
    engine.s.apply_tokens(plan, [7, 8])  # job 0's token is consumed and ignored
    seq = engine.s.sequence(1)
    assert seq is not None and seq.token_ids[-1] == 8
    plan = engine.s.schedule()
    plan.slices[0].draft_ids = [9]
    with pytest.raises(ValueError, match="drafts"):
        engine.s.apply_tokens(plan, [1])
    assert engine.s.sequence(1).num_computed == seq.num_computed  # type: ignore[union-attr]


def test_outcome_and_tokens_give_the_same_plan_after_a_page_fills() -> None:
    general, fast = _pair(8)
    prompt = list(range(PS - 2))
    for e in (general, fast):
        e.add(0, prompt, 10)
    for _ in range(6):  # crosses the first page boundary while decoding
        assert _plan(general.step()) == _plan(fast.step())
    assert _state(general) == _state(fast)
    assert fast.s.sequence(0).num_computed > PS  # type: ignore[union-attr]


@pytest.mark.parametrize("seed", range(3))
def test_apply_tokens_matches_apply_across_rewinds(seed: int) -> None:
    # Rewinds (banned strings) leave jobs recomputing several tokens, sometimes from inside a
    # page they gave up because another job shares it.
    rng = random.Random(seed)
    general, fast = _pair(16)
    prompt = [rng.randrange(50) for _ in range(20)]
    for j in range(3):
        general.add(j, prompt, 200)
        fast.add(j, prompt, 200)
    for step in range(120):
        if step % 9 == 8:
            job = rng.randrange(3)
            seq = general.s.sequence(job)
            assert seq is not None
            back = rng.randrange(1, max(2, min(seq.num_generated, PS + 5)))
            general.s.rewind(job, back)
            fast.s.rewind(job, back)
        assert _plan(general.step()) == _plan(fast.step())
        assert _state(general) == _state(fast)
