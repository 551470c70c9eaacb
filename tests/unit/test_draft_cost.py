"""The drafter's measured cost decides whether drafting pays: a drafter slower than its
estimate (a draft model whose passes cost several target steps) is switched off within a few
passes and then only probes as rarely as its probes' cost asks (their own measured cost where a
probe pays more than a draft position, as a draft model's catch-up forward makes it); a pass
that pays a one-time cost (the first indexing of long prompts) does not switch a cheap drafter
off; and wrong drafts stop after a few offers even where the step timings make extra tokens
look free."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import pytest

from dyngen_core import Job, SamplerSettings
from dyngen_core.engine.plan import SequenceSlice, StepPlan
from dyngen_core.engine.record import JobRecord
from dyngen_core.engine.speculation import DraftStats, accept_run
from dyngen_core.runtime import speculator as speculator_module
from dyngen_core.runtime.drafters import Draft, DraftRequest
from dyngen_core.runtime.speculator import Speculator

GREEDY = SamplerSettings.greedy()
TEXT = [(7 * i) % 50 + 100 for i in range(10_000)]  # what every job decodes
STEP_SECONDS = 1.6e-3  # a step's fixed cost; each token fed adds 20 us


class Clock:
    """A fake `time.perf_counter` that only the drafter moves."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class TimedDrafter:
    """Drafts that are always right (the job's next tokens; ``wrong``: never), each pass
    costing ``seconds`` on the clock (``first_seconds`` for the first pass)."""

    cost_ratio = 0.3  # what it claims: a third of a step per draft position
    samples = False

    def __init__(self, clock: Clock, seconds: float, first_seconds: float | None = None,
                 wrong: bool = False) -> None:
        self.clock, self.seconds, self.wrong = clock, seconds, wrong
        self.first_seconds = seconds if first_seconds is None else first_seconds
        self.passes = self.positions = 0

    def follow(self, plan: StepPlan) -> None:
        return None

    def draft(self, requests: Sequence[DraftRequest]) -> list[Draft]:
        self.clock.now += self.first_seconds if not self.passes else self.seconds
        self.passes += 1
        self.positions += max(r.length for r in requests)
        drafts = [TEXT[len(r.history) - 4:len(r.history) - 4 + r.length] for r in requests]
        return [Draft([1] * len(d) if self.wrong else d) for d in drafts]

    def settle(self, job_id: int, valid: int) -> None:
        return None

    def forget(self, job_id: int) -> None:
        return None


class NoStream:
    stop_token_ids: frozenset[int] = frozenset()
    completion = ""

    def advance(self, token_id: int) -> str:
        return ""


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Iterator[Clock]:
    fake = Clock()
    monkeypatch.setattr(speculator_module.time, "perf_counter", fake)
    yield fake


def run(drafter: TimedDrafter, steps: int, jobs: int = 1, per_token: float = 20e-6
        ) -> tuple[Speculator, list[int]]:
    """Decode ``jobs`` greedy jobs for ``steps`` steps through a speculator whose cost model
    has seen steps of a memory-bound model (``per_token`` seconds a token fed); returns it and
    the steps that drafted."""
    speculator = Speculator(drafter, 4, page_size=256)
    for _ in range(4):
        for tokens in (1, 5):
            speculator.costs.record(tokens, STEP_SECONDS + per_token * tokens)
    records = {}
    for job_id in range(jobs):
        job = Job(input_ids=TEXT[:4], max_new_tokens=100_000, gen_settings=GREEDY)
        job.job_id = job_id
        records[job_id] = JobRecord(job=job, stream=NoStream(), settings=GREEDY, seed=job_id,
                                    speculative=True, history=list(TEXT[:4]))
    drafted = []
    for step in range(steps):
        plan = StepPlan(slices=[SequenceSlice(job_id, [r.history[-1]], len(r.history) - 1,
                                              list(range(8)), True)
                                for job_id, r in records.items()])
        if speculator.propose(plan, records):
            drafted.append(step)
        for record in records.values():
            at, drafts = len(record.history) - 4, list(record.draft_ids)
            run_tokens = accept_run(drafts, TEXT[at:at + len(drafts) + 1])
            for token in run_tokens:
                record.job.new_token_ids.append(token)
                record.on_token(token)
            speculator.settle(record, len(run_tokens))
    return speculator, drafted


def test_a_drafter_slower_than_its_estimate_is_switched_off_and_probes_rarely(clock):
    # Every pass costs 10 ms, six steps' worth: no draft can pay, however often accepted.
    drafter = TimedDrafter(clock, seconds=10e-3)
    speculator, drafted = run(drafter, steps=3000)
    assert speculator.draft_cost_ratio > 1.0
    assert drafter.passes <= Speculator.DRAFT_COST_PRIOR + 8  # switched off within a few
    late = [step for step in drafted if step >= 100]
    # Its probes are spaced by their cost: a 1-token probe costs the threshold (> 1 step).
    gaps = [b - a for a, b in zip(late, late[1:], strict=False)]
    assert all(gap >= 2 * DraftStats.PROBE_INTERVAL for gap in gaps)
    spent = drafter.seconds * len(late) / (3000 - 100)
    assert spent / STEP_SECONDS <= 3 * DraftStats.PROBE_BUDGET * speculator.draft_cost_ratio


def test_a_cheap_drafter_stays_on_after_an_expensive_first_pass(clock):
    # 20 us a pass, but 70 ms for the first (every prompt indexed at once).
    drafter = TimedDrafter(clock, seconds=20e-6, first_seconds=70e-3)
    speculator, drafted = run(drafter, steps=200, jobs=4)
    assert speculator.draft_cost_ratio < 0.3
    assert len(drafted) >= 190  # drafts pay for a cheap drafter whose drafts are right


def test_an_always_wrong_drafter_stops_even_where_tokens_seem_free(clock):
    """At batch 1 a step's time barely grows with its tokens, and a fit can find them free
    (here, five tokens a little faster than one): drafts must still survive
    `StepCostModel.MIN_SURVIVAL` of the time, so wrong ones stop after a few offers (each also
    costs the next step's overlap) and the job only probes."""
    drafter = TimedDrafter(clock, seconds=1e-6, wrong=True)
    speculator, drafted = run(drafter, steps=1000, per_token=-1e-6)
    assert speculator.costs.ratio() > 1e5  # the fit says a token costs nothing
    # A few offers until its acceptance falls under MIN_SURVIVAL (not the dozens it takes
    # to fall under the fit's threshold of ~1e-6), then probes spaced 16, 32, 64 ... apart.
    assert len([step for step in drafted if step < 100]) <= 8
    assert speculator.rejected <= 20


class CatchUpDrafter(TimedDrafter):
    """A draft model's cost: each pass first feeds what the job gained since it last drafted
    (a catch-up forward, ``catch_up`` seconds), then one forward a draft position."""

    def __init__(self, clock: Clock, catch_up: float, per_position: float) -> None:
        super().__init__(clock, seconds=0.0)
        self.catch_up, self.per_position = catch_up, per_position

    def draft(self, requests: Sequence[DraftRequest]) -> list[Draft]:
        self.seconds = self.first_seconds = (
            self.catch_up + self.per_position * max(r.length for r in requests))
        return super().draft(requests)


def test_probes_that_cost_more_than_draft_positions_are_spaced_by_their_own_cost(clock):
    """A draft model's probe pays its catch-up forward: ~4 steps for one position, where a
    4-token pass costs ~1.5 steps a position. Probes are spaced by what probe passes measured,
    not by the threshold the drafts' average cost gives."""
    drafter = CatchUpDrafter(clock, catch_up=5e-3, per_position=1.2e-3)
    speculator, drafted = run(drafter, steps=1500)
    assert speculator.probe_cost > 3.0  # (5 + 1.2) ms over a 1.6 ms step
    late = [step for step in drafted if step >= 100]
    gaps = [b - a for a, b in zip(late, late[1:], strict=False)]
    assert gaps and min(gaps) >= 250  # (probe cost 3.8 - acceptance ~0.9) / 1 %
