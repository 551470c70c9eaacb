"""`Speculator.wants_tokens` (a step overlaps the next unless the next may draft) with drafters
that have nothing to offer: after a few misses, steps overlap again except the one before the
jobs' common probe steps."""

from __future__ import annotations

from collections.abc import Sequence

from dyngen_core import Job, SamplerSettings
from dyngen_core.engine.plan import SequenceSlice, StepPlan
from dyngen_core.engine.record import JobRecord
from dyngen_core.engine.speculation import DraftStats
from dyngen_core.runtime.drafters import Draft, DraftRequest
from dyngen_core.runtime.speculator import Speculator

GREEDY = SamplerSettings.greedy()


class NoStream:
    stop_token_ids: frozenset[int] = frozenset()
    completion = ""

    def advance(self, token_id: int) -> str:
        return ""


class EmptyDrafter:
    """A drafter that never finds a draft (prompt lookup over text that never repeats)."""

    cost_ratio = 0.0
    samples = False

    def __init__(self) -> None:
        self.asked = 0

    def follow(self, plan: StepPlan) -> None:
        return None

    def draft(self, requests: Sequence[DraftRequest]) -> list[Draft]:
        self.asked += len(requests)
        return [Draft([], None) for _ in requests]

    def settle(self, job_id: int, valid: int) -> None:
        return None

    def forget(self, job_id: int) -> None:
        return None


def test_a_drafter_with_nothing_to_offer_gives_overlap_back():
    jobs = 32
    records = {}
    for job_id in range(jobs):
        job = Job(input_ids=[1, 2, 3, job_id + 10], max_new_tokens=10_000, gen_settings=GREEDY)
        job.job_id = job_id
        records[job_id] = JobRecord(job=job, stream=NoStream(), settings=GREEDY, seed=job_id,
                                    speculative=True)
    drafter = EmptyDrafter()
    speculator = Speculator(drafter, 4, page_size=256)
    wanting = []
    for step in range(1, 401):
        plan = StepPlan(slices=[
            SequenceSlice(job_id, [r.history[-1]], len(r.history) - 1,
                          [2 * job_id, 2 * job_id + 1], True)  # room for every draft
            for job_id, r in records.items()])
        assert speculator.propose(plan, records) == 0
        wanting.append(speculator.wants_tokens())
        for record in records.values():  # every job decodes one token
            record.job.new_token_ids.append(7)
            record.on_token(step % 50 + 100)
    # Every job is asked MAX_MISSES times, then only at common probe steps.
    assert all(wanting[:DraftStats.MAX_MISSES - 1])
    later = wanting[2 * DraftStats.PROBE_INTERVAL:]
    assert sum(later) <= len(later) // DraftStats.PROBE_INTERVAL + 1
    probe_steps = (400 - 2 * DraftStats.PROBE_INTERVAL) // DraftStats.PROBE_INTERVAL
    assert drafter.asked <= jobs * (DraftStats.MAX_MISSES + probe_steps)
