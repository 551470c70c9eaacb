"""Helpers shared by the engine tests that compare two ways of running the same jobs (the
plain-greedy fast path, overlapped steps, mixed steps, faults): prompts of mixed lengths, a
runner that kills one logits row at one step, and running jobs to their final results."""

from __future__ import annotations

import random
from typing import Any

import torch

from dyngen_core import DynamicGenerator
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
