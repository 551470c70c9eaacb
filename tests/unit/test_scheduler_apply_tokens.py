"""`Scheduler.apply_tokens` (the generator's fast path: one token per sampling slice, no
`SampledTokens`) leaves the scheduler exactly as `apply` does.

Two fake engines run the same jobs in lockstep, one applying outcomes with `apply`, the other
with `apply_tokens`; after every step their plans, sequences, pages and counters must agree, and
the fake KV store checks every computed slot (see `fake_engine`).
"""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from dyngen_core.config import CacheConfig, SchedulerConfig
from dyngen_core.engine.plan import PENDING_TOKEN, StepPlan
from dyngen_core.engine.scheduler import Scheduler
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


class PendingEngine(TokensEngine):
    """Overlapped steps as the generator runs them: plan step k, run it with its pending inputs
    taken from step k-1's outcome (the device feed), resolve step k-1, then apply step k with
    `PENDING_TOKEN`s."""

    def __init__(self, scheduler: Scheduler) -> None:
        super().__init__(scheduler)
        self.pending: tuple[StepPlan, list[int]] | None = None

    def step(self) -> StepPlan:
        plan = self.s.schedule()
        fed = self._fed(plan)
        outcome = self.run(fed)
        if self.pending is not None:
            self.s.resolve_tokens(*self.pending)
        tokens = [outcome.sampled[sl.job_id].token_ids[0] for sl in plan.slices if sl.sample]
        self.s.apply_tokens(plan, [PENDING_TOKEN] * len(tokens))
        self.pending = (plan, tokens)
        for job_id, sampled in outcome.sampled.items():
            self.generated[job_id].extend(sampled.token_ids)
        self.last_plan = fed
        return fed

    def _fed(self, plan: StepPlan) -> StepPlan:
        """``plan`` with its pending inputs replaced by the previous step's tokens."""
        if self.pending is None:
            return plan
        previous, tokens = self.pending
        by_job = dict(zip([sl.job_id for sl in previous.slices if sl.sample], tokens,
                          strict=True))
        slices = [replace(sl, token_ids=[by_job[sl.job_id] if t == PENDING_TOKEN else t
                                         for t in sl.token_ids]) for sl in plan.slices]
        return StepPlan(slices=slices, copies=plan.copies)

    def resolved_state(self) -> object:
        """`_state` once the pending step is resolved (on a copy of nothing: resolves now)."""
        if self.pending is not None:
            self.s.resolve_tokens(*self.pending)
            self.pending = None
        self.verify()
        return _state(self)


@pytest.mark.parametrize("seed", range(4))
def test_overlapped_steps_match_apply_step_by_step(seed: int) -> None:
    rng = random.Random(seed)
    cache = CacheConfig(max_tokens=6 * PS, page_size=PS)
    config = SchedulerConfig(max_chunk_size=40, max_batch_size=5)
    general = FakeEngine(Scheduler(cache, config))
    overlapped = PendingEngine(Scheduler(cache, config))
    shared = [rng.randrange(50) for _ in range(40)]
    limits = {}
    for j in range(9):
        prompt = (shared if j % 3 == 0 else []) + [rng.randrange(50) for _ in range(3 + 5 * j)]
        limits[j] = 30 + rng.randrange(60)
        general.add(j, prompt, limits[j])
        overlapped.add(j, prompt, limits[j])
    done: set[int] = set()
    for _ in range(2000):
        for j, limit in limits.items():
            seq = general.s.sequence(j)
            if j not in done and seq is not None and seq.num_generated >= limit:
                general.s.finish(j)
                overlapped.s.finish(j)  # its pending token, if any, is never resolved
                done.add(j)
        if len(done) == len(limits):
            break
        assert _plan(general.step()) == _plan(overlapped.step())
        if rng.random() < 0.2:  # now and then, compare the states with nothing pending
            assert _state(general) == overlapped.resolved_state()
    assert len(done) == len(limits)
    stats = overlapped.s.stats()
    assert stats.preemptions > 0 and stats.prefill_tokens_reused > 0
    for j, limit in limits.items():
        assert overlapped.generated[j][:limit] == general.generated[j][:limit]


def test_resolving_twice_or_out_of_order_is_an_error() -> None:
    _, engine = _pair(8)
    engine.add(0, [1, 2, 3], 5)
    engine.step()
    plan = engine.s.schedule()
    engine.s.apply_tokens(plan, [PENDING_TOKEN])
    engine.s.resolve_tokens(plan, [9])
    assert engine.s.sequence(0).token_ids[-1] == 9  # type: ignore[union-attr]
    with pytest.raises(RuntimeError, match="no pending token"):
        engine.s.resolve_tokens(plan, [9])
