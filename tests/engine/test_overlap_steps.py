"""Overlapped steps (``overlap_steps=True``, the default) give exactly what synchronous steps
give.

With overlap, a step whose sampling jobs are all plain greedy leaves its tokens on the device:
the scheduler holds `PENDING_TOKEN`s, the next step reads those inputs on the device
(`overlap.TokenFeed`), and the tokens are resolved and emitted by the next `iterate`. Each test
runs the same jobs with and without overlap and compares every result (all keys but timings)
in order, checking the page invariant after every step (pending tokens included).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import pytest
import torch

from dyngen_core import DynamicGenerator, Job, SamplerSettings
from dyngen_core.runtime.overlap import TokenFeed
from dyngen_core.sampling.step import SampledStep, StepSampler
from tests.engine.step_helpers import kill_row, mixed_prompts

GREEDY = SamplerSettings.greedy()
TIMINGS = {"time_enqueued", "time_prefill", "time_generate"}


def _results(generator: DynamicGenerator, jobs: list[Job],
             cancel: dict[int, int] | None = None) -> list[dict[str, Any]]:
    """Every result in order. ``cancel``: job index -> cancel it once it has streamed that many
    tokens (by what the caller saw, not by step count: overlapped steps emit one step later)."""
    generator.enqueue(jobs)
    out: list[dict[str, Any]] = []
    streamed: dict[Any, int] = {job.identifier: 0 for job in jobs}
    while generator.num_remaining_jobs():
        for r in generator.iterate():
            row = {k: v for k, v in r.items() if k not in TIMINGS and k != "job"}
            if "error" in row:
                row["error"] = type(row["error"]).__name__
            out.append(row)
            if r["stage"] == "streaming" and not r["eos"]:
                streamed[r["identifier"]] += 1
        for index, after in (cancel or {}).items():
            if streamed[jobs[index].identifier] == after and not jobs[index].finished:
                generator.cancel(jobs[index])
        generator.check_invariant()
    return out


def _both(make: Callable[..., DynamicGenerator], monkeypatch: pytest.MonkeyPatch,
          jobs: Callable[[], list[Job]], cancel: dict[int, int] | None = None,
          **options: Any) -> tuple[list[Any], list[Any], int]:
    """(overlapped results, synchronous results, overlapped steps launched)."""
    launches = [0]
    start = StepSampler.start

    def counted(self: StepSampler, *args: Any, **kw: Any) -> SampledStep:
        sampled = start(self, *args, **kw)
        launches[0] += sampled.ids is not None and bool(sampled.records)
        return sampled

    with monkeypatch.context() as patch:
        patch.setattr(StepSampler, "start", counted)
        overlapped = _results(make(overlap_steps=True, **options), jobs(), cancel)
    synchronous = _results(make(overlap_steps=False, **options), jobs(), cancel)
    return overlapped, synchronous, launches[0]


def _greedy_jobs(prompts: list[list[int]], budget: int = 10, **extra: Any) -> list[Job]:
    return [Job(input_ids=p, max_new_tokens=budget, stop_conditions=[], gen_settings=GREEDY,
                identifier=i, **extra) for i, p in enumerate(prompts)]


def test_stops_budgets_and_chunked_prefills_match(make_generator, monkeypatch):
    prompts = mixed_prompts(8, seed=1)

    def jobs() -> list[Job]:
        out = []
        for i, p in enumerate(prompts):
            stops: list[int | str] = [p[-1], 7, "e"] if i % 3 == 0 else []
            out.append(Job(input_ids=p, max_new_tokens=3 + 2 * i, stop_conditions=stops,
                           gen_settings=GREEDY, identifier=i))
        return out

    overlapped, synchronous, launches = _both(make_generator, monkeypatch, jobs,
                                              max_chunk_size=64)
    assert overlapped == synchronous
    assert launches > 5


def test_cancel_while_a_step_is_pending_matches(make_generator, monkeypatch):
    prompts = mixed_prompts(5, seed=3)
    overlapped, synchronous, launches = _both(
        make_generator, monkeypatch, lambda: _greedy_jobs(prompts, 12), cancel={1: 4, 3: 9})
    assert overlapped == synchronous and launches > 0
    assert [r["eos_reason"] for r in overlapped if r["eos"]].count("cancelled") == 2


def test_plain_and_other_jobs_in_one_batch_match(make_generator, monkeypatch):
    prompts = mixed_prompts(6, seed=2)

    def jobs() -> list[Job]:
        out = _greedy_jobs(prompts, 10)
        # Sampled (seeded: overlapped too, drawn on the device), a stop-token ban
        # (min_new_tokens) and extra outputs (these steps sample synchronously, after the
        # pending step before them is resolved).
        out.append(Job(input_ids=prompts[0], max_new_tokens=6, stop_conditions=[],
                       gen_settings=SamplerSettings(temperature=0.9, top_p=0.8), seed=5,
                       identifier=99))
        out.append(Job(input_ids=prompts[1], max_new_tokens=4, min_new_tokens=2,
                       stop_conditions=[7], gen_settings=GREEDY, identifier=98))
        out.append(Job(input_ids=prompts[2], max_new_tokens=3, stop_conditions=[],
                       gen_settings=GREEDY, identifier=97, return_probs=True))
        return out

    overlapped, synchronous, launches = _both(make_generator, monkeypatch, jobs)
    assert overlapped == synchronous and launches > 0


def test_preemption_and_shared_prefixes_match(make_generator, monkeypatch):
    # A small cache forces preemptions (a preempted job's pending token is resolved before it
    # is prefilled again); a shared 300-token prefix exercises dedup and the prompt cache.
    shared = [random.Random(9).randrange(10, 500) for _ in range(300)]
    prompts = mixed_prompts(6, seed=4, shared=shared)
    overlapped, synchronous, launches = _both(
        make_generator, monkeypatch, lambda: _greedy_jobs(prompts, 40), cache_tokens=3 * 1024,
        max_chunk_size=256)
    assert overlapped == synchronous and launches > 0


def test_a_dead_row_fails_only_its_job(make_generator, monkeypatch):
    prompts = mixed_prompts(4, seed=4)

    def make(**options: Any) -> DynamicGenerator:
        return kill_row(make_generator(**options), step=6, row=1, value=float("nan"))

    overlapped, synchronous, launches = _both(make, monkeypatch, lambda: _greedy_jobs(prompts, 9))
    assert overlapped == synchronous and launches > 0
    errors = [r for r in overlapped if r["eos"] and r["eos_reason"] == "error"]
    assert len(errors) == 1 and errors[0]["error"] == "SamplingError"


@pytest.mark.parametrize("budget", [1, 2, 3])
def test_tiny_budgets_end_with_and_without_overlap(make_generator, monkeypatch, budget):
    # A job whose last token is in flight at max_new_tokens is not scheduled again: the tiny
    # budgets are where a wrong count would show (a hang, or a token too many).
    prompts = mixed_prompts(3, seed=6)
    overlapped, synchronous, _ = _both(make_generator, monkeypatch,
                                       lambda: _greedy_jobs(prompts, budget))
    assert overlapped == synchronous
    finals = [r for r in overlapped if r["eos"]]
    assert len(finals) == 3 and all(r["new_tokens"] == budget for r in finals)


@pytest.mark.parametrize("in_order", [True, False])
def test_a_feed_reads_a_row_without_a_token_as_token_zero(in_order: bool) -> None:
    """-1 (a row the sampler found no token for) enters the next step's inputs as token 0, in
    the copy itself; other rows are copied as they are, and padding repeats the last input."""
    ids = torch.tensor([7, -1, 9])
    inputs = torch.full((5,), 99, dtype=torch.int64)
    targets, rows = ([0, 1, 2], [0, 1, 2]) if in_order else ([0, 1, 2], [2, 1, 0])
    TokenFeed(ids, targets, rows, in_order=in_order).apply(inputs, 3)
    expected = [7, 0, 9] if in_order else [9, 0, 7]
    assert inputs.tolist() == expected + [expected[-1]] * 2
    assert ids.tolist() == [7, -1, 9]  # the pending step's ids are not changed
