"""Helpers shared by the engine tests that compare two ways of running the same jobs (the
plain-greedy fast path, overlapped steps, mixed steps, faults): prompts of mixed lengths, a
runner that kills one logits row at one step, running jobs to their final results, and one
mixture (greedy, seeded sampled, constrained, cancelled, a failing row) run to its tokens."""

from __future__ import annotations

import math
import random
import re
from typing import Any

import torch

from dyngen_core import DynamicGenerator, Job, SamplerSettings
from dyngen_core.engine.plan import StepPlan

LENGTHS = [3, 40, 300, 7, 90, 260, 12, 5]


def mixed_prompts(n: int, seed: int, shared: list[int] | None = None) -> list[list[int]]:
    """Up to 8 prompts of mixed lengths (3 to 300 tokens; two cross a 256-token page), each
    after the ``shared`` prefix if given."""
    rng = random.Random(seed)
    return [(shared or []) + [rng.randrange(10, 500) for _ in range(k)] for k in LENGTHS[:n]]


def kill_row(generator: DynamicGenerator, step: int, row: int, value: float) -> DynamicGenerator:
    """Make the generator's runner return ``value`` in every logit of ``row`` at its
    ``step``-th forward (1-based), as a broken model would."""
    run, steps = generator._runner.run, [0]

    def run_with_a_dead_row(plan: StepPlan, feed: Any = None) -> torch.Tensor | None:
        logits = run(plan, feed)
        steps[0] += 1
        if logits is not None and steps[0] == step:
            logits = logits.clone()
            logits[row] = value
        return logits

    generator._runner.run = run_with_a_dead_row  # type: ignore[method-assign]
    return generator


def run_to_finals(generator: DynamicGenerator, jobs: list[Any], limit: int = 500
                  ) -> dict[Any, Any]:
    """Enqueue ``jobs`` and run the generator until nothing remains; the final result of every
    job that ended, by identifier. At most ``limit`` steps: a hang fails the test."""
    generator.enqueue(jobs)
    finals = {}
    for _ in range(limit):
        if not generator.num_remaining_jobs():
            return finals
        for r in generator.iterate():
            if r["eos"]:
                finals[r["identifier"]] = r
    raise AssertionError(f"jobs still running after {limit} steps: {generator.stats()}")


def mixed_jobs() -> list[Job]:
    """Greedy jobs sharing a prefix, a seeded sampled job, a regex-constrained job and one the
    run cancels (`run_mixed_jobs`)."""
    rng = random.Random(5)
    shared = [rng.randrange(10, 500) for _ in range(300)]
    greedy = SamplerSettings.greedy()
    jobs = [Job(input_ids=shared + [rng.randrange(10, 500) for _ in range(9 + i)],
                max_new_tokens=6, stop_conditions=[], gen_settings=greedy, identifier=i)
            for i in range(3)]
    jobs.append(Job(input_ids=shared[:40], max_new_tokens=6, stop_conditions=[], seed=7,
                    gen_settings=SamplerSettings(temperature=0.9, top_p=0.9), identifier=3))
    jobs.append(Job(input_ids=shared[:20], max_new_tokens=8, gen_settings=greedy,
                    constraint=re.compile(r"[0-9]{3}-[a-c]{2}"), identifier=4))
    jobs.append(Job(input_ids=shared[:60], max_new_tokens=40, stop_conditions=[],
                    gen_settings=greedy, identifier=CANCELLED))
    return jobs


# The job `run_mixed_jobs` cancels after the first step.
CANCELLED = 5
# The forward (counted from the first of `run_mixed_jobs`) whose first logits row is NaN, failing
# that row's job.
FAULT_STEP = 3


def run_mixed_jobs(generator: DynamicGenerator) -> dict[int, tuple[str, list[int]]]:
    """Each job's end reason and tokens; `CANCELLED` is cancelled after the first step, and one
    row fails at forward `FAULT_STEP`."""
    kill_row(generator, FAULT_STEP, 0, math.nan)
    jobs = mixed_jobs()
    generator.enqueue(jobs)
    finals: dict[int, tuple[str, list[int]]] = {}
    tokens: dict[int, list[int]] = {job.identifier: [] for job in jobs}
    steps = 0
    while generator.num_remaining_jobs():
        for result in generator.iterate():
            tokens[result["identifier"]] += result.get("token_ids", [])
            if result["eos"]:
                identifier = result["identifier"]
                finals[identifier] = (result["eos_reason"], tokens[identifier])
        steps += 1
        if steps == 1:
            generator.cancel(jobs[CANCELLED])
    assert finals[CANCELLED][0] == "cancelled" and finals[4][0] != "cancelled"
    failed = [i for i, (reason, _) in finals.items() if reason == "error"]
    assert len(failed) == 1 and failed[0] != CANCELLED, finals
    # Every token of the others, not only the last one's.
    assert all(len(finals[i][1]) == 6 for i in range(4) if i not in failed), finals
    return finals
