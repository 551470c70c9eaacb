"""`SleepingJobs`: the jobs whose drafts do not pay and whose probe is not due, woken in one
step for all of them, exactly when `DraftStats.pays` or `DraftStats.next_probe` would wake
each."""

from __future__ import annotations

import random

import pytest

from dyngen_core.engine.speculation import DraftStats
from dyngen_core.runtime.speculator import _NO_PROBE, SleepingJobs


def random_stats(rng: random.Random) -> DraftStats:
    stats = DraftStats()
    for _ in range(rng.randrange(6)):  # a history of offers, misses and probes
        if rng.random() < 0.3:
            stats.miss()
        else:
            proposed = rng.randint(1, 4)
            stats.record(proposed, rng.randint(0, proposed))
    stats.last_offer = rng.randrange(2000)
    stats.probe_interval = rng.choice([16, 32, 64, 128, 256])
    stats.misses = rng.choice([0, 3, DraftStats.MAX_MISSES, DraftStats.MAX_MISSES + 2])
    return stats


@pytest.mark.parametrize("jobs", [5, SleepingJobs.ARRAY_FROM + 40])
def test_jobs_wake_when_each_job_s_own_rule_says(jobs):
    """Through steps of changing thresholds and probe costs (a cost model moving, a probe cost
    measured above 1), with jobs added and forgotten between them, `wake` takes out exactly
    the jobs that pay or whose probe is due, and returns the earliest due step of the rest."""
    rng = random.Random(jobs)
    asleep, stats_of = SleepingJobs(), {}
    for job in range(jobs):
        stats_of[job] = random_stats(rng)
        asleep.add(job, stats_of[job])
    next_job = jobs
    for step in range(0, 2400, 16):  # probes fall on multiples of 16: dues meet steps
        threshold = rng.choice([0.1, 0.3, 0.55, 0.8, 1.4, 6.0])
        probe = max(threshold, rng.choice([0.0, 0.5, 3.0, 40.0]))
        sleeping = dict(asleep.rows)
        expected_awake = {job for job in sleeping
                          if stats_of[job].pays(threshold)
                          or stats_of[job].next_probe(probe) <= step}
        staying = [stats_of[job].next_probe(probe) for job in sleeping
                   if job not in expected_awake]
        earliest = asleep.wake(threshold, probe, step)
        assert set(sleeping) - set(asleep.rows) == expected_awake
        assert earliest == (min(staying) if staying else _NO_PROBE)
        assert len(asleep) == len(asleep.rows)
        for job in rng.sample(sorted(expected_awake), k=len(expected_awake) // 2):
            asleep.add(job, stats_of[job])  # back to sleep: nothing changed its statistics
        if asleep.rows and rng.random() < 0.3:
            asleep.remove(rng.choice(sorted(asleep.rows)))  # a job that ended
        stats_of[next_job] = random_stats(rng)
        asleep.add(next_job, stats_of[next_job])
        next_job += 1
    asleep.remove(-1)  # not asleep: nothing happens
