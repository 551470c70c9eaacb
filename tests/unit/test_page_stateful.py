"""Hypothesis state machine over the scheduler: random enqueue / step / finish / cancel / rewind /
defragment on a small cache (so jobs wait, share pages and get preempted). After every step the
page invariant holds and every computed slot of every running job holds the right value."""

from __future__ import annotations

import random

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from dyngen_core.config import CacheConfig, SchedulerConfig
from dyngen_core.engine.scheduler import Scheduler
from dyngen_core.engine.sequence import SequenceStatus
from dyngen_core.errors import JobTooLargeError
from tests.unit.fake_engine import VOCAB, FakeEngine, true_continuation

PS = 32
BASES = [[random.Random(b).randrange(VOCAB) for _ in range(160)] for b in range(3)]


def half_right_drafts(job: int, tokens: list[int], n: int) -> list[int]:
    right = true_continuation(tokens, n)
    cut = (job + len(tokens)) % (n + 1)
    return right[:cut] + [(t + 1) % VOCAB for t in right[cut:]]


class SchedulerMachine(RuleBasedStateMachine):
    @initialize(pages=st.integers(5, 14), chunk=st.sampled_from([8, 40, 100, 512]),
                batch=st.integers(1, 6), dedup=st.booleans(), prompt_cache=st.booleans(),
                skips=st.integers(0, 3))
    def setup(self, pages: int, chunk: int, batch: int, dedup: bool, prompt_cache: bool,
              skips: int) -> None:
        config = SchedulerConfig(max_batch_size=batch, max_chunk_size=chunk, max_skips=skips,
                                 dedup=dedup, prompt_cache=prompt_cache)
        self.e = FakeEngine(Scheduler(CacheConfig(pages * PS, page_size=PS), config),
                            drafts=half_right_drafts)
        self.limits: dict[int, tuple[list[int], int]] = {}
        self.next_id = 0

    @rule(base=st.integers(0, 2), prefix=st.integers(0, 160),
          suffix=st.lists(st.integers(0, VOCAB - 1), max_size=40),
          new=st.integers(1, 60), drafts=st.integers(0, 3))
    def enqueue(self, base: int, prefix: int, suffix: list[int], new: int, drafts: int) -> None:
        prompt = BASES[base][:prefix] + suffix or [1]
        job = self.next_id
        self.next_id += 1
        try:
            self.e.add(job, prompt, new, num_draft_tokens=drafts)
        except JobTooLargeError:
            assert -(-(len(prompt) + new + drafts) // PS) > self.e.s.pool.num_pages
            return
        self.limits[job] = (prompt, new)

    @rule(steps=st.integers(1, 12))
    def step(self, steps: int) -> None:
        for _ in range(steps):
            self.e.step()
            self._finish_done()

    @precondition(lambda self: self.limits)
    @rule(data=st.data(), cancel=st.booleans())
    def stop_a_job(self, data: st.DataObject, cancel: bool) -> None:
        job = data.draw(st.sampled_from(sorted(self.limits)))
        assert (self.e.s.cancel if cancel else self.e.s.finish)(job)
        del self.limits[job]
        assert self.e.s.sequence(job) is None

    @precondition(lambda self: self.limits)
    @rule(data=st.data(), n=st.integers(1, 70))
    def rewind(self, data: st.DataObject, n: int) -> None:
        job = data.draw(st.sampled_from(sorted(self.limits)))
        before = self.e.s.sequence(job)
        assert before is not None
        expected = before.num_tokens - min(n, before.num_generated)
        self.e.s.rewind(job, n)
        assert self.e.s.sequence(job).num_tokens == expected

    @rule()
    def defragment(self) -> None:
        moved = self.e.s.defragment(max_moves=self.e.s.pool.num_pages)
        plan = self.e.step()  # the copies lead this plan; the cache is checked after it
        assert len(plan.copies) >= moved
        self._finish_done()

    @rule()
    def drain(self) -> None:
        """Every queued job completes (no deadlock) with exactly the tokens it would get alone."""
        for _ in range(3000):
            if not self.limits:
                return
            self.e.step()
            self._finish_done()
        raise AssertionError(f"jobs stuck: {self.e.s.stats()}")

    @invariant()
    def pages_and_cache_contents_are_consistent(self) -> None:
        if hasattr(self, "e"):
            self.e.verify()

    def _finish_done(self) -> None:
        for job, (prompt, new) in list(self.limits.items()):
            seq = self.e.s.sequence(job)
            assert seq is not None
            if seq.num_generated >= new:
                got = list(seq.token_ids[len(prompt):])[:new]
                assert got == true_continuation(prompt, new), f"job {job} generated wrong tokens"
                assert self.e.s.finish(job)
                del self.limits[job]
            elif seq.status is SequenceStatus.RUNNING:
                assert seq.num_computed <= seq.num_tokens - 1


SchedulerMachine.TestCase.settings = settings(
    max_examples=60, stateful_step_count=40, deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestSchedulerStateful = SchedulerMachine.TestCase
