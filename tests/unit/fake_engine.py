"""A fake runner and KV store that drive a `Scheduler` the way the real engine does, as a test
oracle for the page machinery.

The "model" is a rolling hash: the value stored at a slot is ``mix(value at the previous
position, token)``, read back *through the page table* like attention reads the cache, so a wrong
page, a missed copy or a bad remap changes every later value. The next token is a function of
the value at the last position. `verify` recomputes what every computed slot of every running
job must hold from its token ids alone and compares.
"""

from __future__ import annotations

from collections.abc import Callable

from dyngen_core.engine.plan import SampledTokens, StepOutcome, StepPlan
from dyngen_core.engine.scheduler import Scheduler
from dyngen_core.engine.sequence import SequenceStatus

VOCAB = 50
ROOT_VALUE = 17


def mix(prev: int, token: int) -> int:
    return hash((prev, token)) & 0xFFFFFFFF


def next_token(value: int) -> int:
    return (value >> 7) % VOCAB


def prefix_values(tokens: list[int]) -> list[int]:
    values, prev = [], ROOT_VALUE
    for tok in tokens:
        prev = mix(prev, tok)
        values.append(prev)
    return values


def true_continuation(tokens: list[int], n: int) -> list[int]:
    """What the fake model generates after ``tokens`` (greedy), computed without any cache."""
    out, prev = [], prefix_values(tokens)[-1]
    for _ in range(n):
        tok = next_token(prev)
        out.append(tok)
        prev = mix(prev, tok)
    return out


class FakeEngine:
    """Runs plans against a dict KV store and checks every write and every computed slot.

    drafts: optional function (job_id, token_ids, max_drafts) -> draft ids for decode slices.
    """

    def __init__(self, scheduler: Scheduler,
                 drafts: Callable[[int, list[int], int], list[int]] | None = None) -> None:
        self.s = scheduler
        self.ps = scheduler.page_size
        self.kv: dict[int, int] = {}
        self.drafts = drafts
        self.generated: dict[int, list[int]] = {}
        self.num_drafts: dict[int, int] = {}
        self.last_plan = StepPlan()

    def add(self, job_id: int, prompt: list[int], max_new_tokens: int, **kw: int) -> None:
        self.s.add(job_id, prompt, max_new_tokens, **kw)
        self.generated[job_id] = []
        self.num_drafts[job_id] = kw.get("num_draft_tokens", 0)

    def step(self) -> StepPlan:
        plan = self.s.schedule()
        if self.drafts is not None:
            for sl in plan.slices:
                seq = self.s.sequence(sl.job_id)
                assert seq is not None
                room = min(len(sl.page_table) * self.ps - sl.end_pos, self.num_drafts[sl.job_id])
                if sl.sample and len(sl.token_ids) == 1 and room > 0:
                    sl.draft_ids = self.drafts(sl.job_id, list(seq.token_ids), room)
        outcome = self.run(plan)
        self.s.apply(plan, outcome)
        for job_id, sampled in outcome.sampled.items():
            self.generated[job_id].extend(sampled.token_ids)
        self.verify()
        self.last_plan = plan
        return plan

    def run(self, plan: StepPlan) -> StepOutcome:
        for copy in plan.copies:
            for i in range(copy.num_slots):
                src, dst = copy.src * self.ps + i, copy.dst * self.ps + i
                if src in self.kv:
                    self.kv[dst] = self.kv[src]
                else:
                    self.kv.pop(dst, None)
        outcome = StepOutcome()
        for sl in plan.slices:
            values = self._write(sl.page_table, sl.start_pos, sl.token_ids + sl.draft_ids)
            if sl.sample:
                outcome.sampled[sl.job_id] = self._sample(sl.job_id, sl.draft_ids,
                                                          values[len(sl.token_ids) - 1:])
        return outcome

    def _write(self, table: list[int], start: int, tokens: list[int]) -> list[int]:
        prev = ROOT_VALUE if start == 0 else self.kv[self._slot(table, start - 1)]
        values = []
        for i, tok in enumerate(tokens):
            slot = self._slot(table, start + i)
            page = slot // self.ps
            assert self.s.pool.ref_count(page) == 1, f"write into shared page {page}"
            assert self.s.pool.page_hash(page) is None, f"write into registered page {page}"
            prev = mix(prev, tok)
            self.kv[slot] = prev
            values.append(prev)
        return values

    def _sample(self, job_id: int, drafts: list[int], values: list[int]) -> SampledTokens:
        accepted = 0
        while accepted < len(drafts) and drafts[accepted] == next_token(values[accepted]):
            accepted += 1
        tokens = drafts[:accepted] + [next_token(values[accepted])]
        return SampledTokens(job_id, tokens, num_draft_accepted=accepted)

    def _slot(self, table: list[int], pos: int) -> int:
        return table[pos // self.ps] * self.ps + pos % self.ps

    def verify(self) -> None:
        """The scheduler's invariant, and every computed slot of every running job."""
        self.s.check_invariant()
        for job_id in self.generated:
            seq = self.s.sequence(job_id)
            if seq is None or seq.status is not SequenceStatus.RUNNING:
                continue
            tokens, table = list(seq.token_ids), list(seq.page_table)
            expected = prefix_values(tokens[:seq.num_computed])
            for pos, value in enumerate(expected):
                got = self.kv.get(self._slot(table, pos))
                assert got == value, f"job {job_id}: wrong cache value at position {pos}"
            gen = tokens[seq.prompt_len:]
            assert gen == true_continuation(tokens[:seq.prompt_len], len(gen)), (
                f"job {job_id} generated tokens that do not follow from its prompt")

    def run_until_done(self, max_new: dict[int, int], max_steps: int = 10_000) -> dict[int, list]:
        """Step, finishing each job once it has ``max_new[job]`` new tokens; returns them."""
        results: dict[int, list[int]] = {}
        for _ in range(max_steps):
            for job_id, limit in max_new.items():
                seq = self.s.sequence(job_id)
                if seq is not None and seq.num_generated >= limit:
                    results[job_id] = list(seq.token_ids[seq.prompt_len:])[:limit]
                    self.s.finish(job_id)
            if len(results) == len(max_new):
                return results
            self.step()
        raise AssertionError(f"jobs not done after {max_steps} steps: {self.s.stats()}")
