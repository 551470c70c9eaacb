"""A seeded soak of mixed traffic: random engine settings, random mixtures of jobs, cancellations,
a failing logits row and a job too large for the cache, all in one run.

Each round draws the engine's options (page size, batch and chunk sizes, overlapped steps, n-gram
drafting, dedup and the prompt cache, a cache small enough to preempt) and 8-12 jobs: greedy,
seeded sampled, stop strings, banned strings, a JSON schema, a choice, extra outputs and
min_new_tokens, some after a shared prefix, some cancelled while queued, prefilling or decoding.
After every step the page invariant holds; at the end every job has exactly one final result,
its streamed token ids are exactly its tokens and its streamed text its completion, what it
asked for (extra rows, no banned or stop string, a valid choice or JSON) is there, nothing is
left running, and every greedy job that ran to its end gives what it gives alone with default
options (or first differs at a near-tie of the logits).

CI runs the fixed ``SEEDS``; ``DYNGEN_SOAK_ROUNDS=N`` adds N rounds of fresh random seeds (a
failure names its seed: add it to ``SEEDS`` to keep it). It found two bugs when written: token
ids streamed before a banned-string rewind took them back, and jobs that a drafter's room made
too large at enqueue after `validate` had taken them.
"""

from __future__ import annotations

import json
import math
import os
import random
from collections.abc import Callable
from typing import Any

import pytest

from dyngen_core import Cache, DynamicGenerator, Job, SamplerSettings
from dyngen_core.errors import JobTooLargeError
from tests.engine.step_helpers import kill_row
from tests.engine.test_mixed_steps import SCHEMA
from tests.engine.test_speculative import assert_same_output, run_tokens

SEEDS = [0, 3, 6, 7, 21, 31, 36]
EXTRA_ROUNDS = int(os.environ.get("DYNGEN_SOAK_ROUNDS", "0"))
CHOICES = ["yes", "no", "maybe later"]
KINDS = ("greedy", "sampled", "stop", "banned", "schema", "choice", "extras", "min_tokens")


def _options(rng: random.Random) -> dict[str, Any]:
    page_size = rng.choice([16, 64, 256])
    return {
        "page_size": page_size,
        # The smaller caches preempt: a few jobs' worth of pages (the longest job takes 500).
        "cache_tokens": rng.choice([8192, 1024 if page_size == 256 else 512]),
        "max_batch_size": rng.choice([2, 4, 16, 256]),
        "max_chunk_size": rng.choice([16, 64, 512, 2048]),
        "overlap_steps": rng.random() < 0.5,
        "use_ngram_draft": rng.random() < 0.4,
        "dedup": rng.random() < 0.8,
        "prompt_cache": rng.random() < 0.8,
    }


def _job(rng: random.Random, kind: str, name: str, prompt: list[int]) -> Job:
    greedy = SamplerSettings.greedy()
    sampled = SamplerSettings(temperature=rng.choice([0.7, 1.0]), top_p=rng.choice([0.8, 1.0]),
                              top_k=rng.choice([0, 40]))
    common: dict[str, Any] = {"input_ids": prompt, "identifier": name,
                              "max_new_tokens": rng.randint(4, 20), "stop_conditions": []}
    if kind == "sampled":
        return Job(gen_settings=sampled, seed=rng.randrange(1000), **common)
    if kind == "stop":
        common["stop_conditions"] = [rng.choice(["e", "th", " a", "in"])]
        return Job(gen_settings=greedy, **common)
    if kind == "banned":
        return Job(gen_settings=rng.choice([greedy, sampled]), seed=rng.randrange(1000),
                   banned_strings=rng.choice([["e"], ["a", "o"], ["the"]]),
                   return_probs=rng.random() < 0.5, **common)
    if kind == "schema":
        common["max_new_tokens"] = 40
        return Job(gen_settings=sampled, seed=rng.randrange(1000), constraint=SCHEMA, **common)
    if kind == "choice":
        return Job(gen_settings=greedy, constraint=CHOICES, **common)
    if kind == "extras":
        return Job(gen_settings=sampled, seed=rng.randrange(1000), return_probs=True,
                   return_top_tokens=3, **common)
    if kind == "min_tokens":
        return Job(gen_settings=sampled, seed=rng.randrange(1000),
                   min_new_tokens=common["max_new_tokens"] // 2, **common)
    return Job(gen_settings=greedy, **common)


def _mixture(rng: random.Random, tight: bool) -> list[Job]:
    """8-12 jobs, most after a shared prefix; ``tight``: short prompts, which a small cache
    admits together and then runs out of pages for as they grow (preemption)."""
    shared = [rng.randrange(10, 500) for _ in range(rng.choice([0, 40] if tight
                                                                else [0, 40, 300]))]
    jobs = []
    for i in range(rng.randint(8, 12)):
        lengths = [5, 30, 60] if tight else [1, 5, 30, 120]
        own = [rng.randrange(10, 500) for _ in range(rng.choice(lengths))]
        if rng.random() < 0.3:  # a repeated phrase: n-gram drafts find it
            own = (own[:6] or [7]) * rng.randint(3, 12)
        prompt = (shared if rng.random() < 0.6 else []) + own
        jobs.append(_job(rng, rng.choice(KINDS), f"{i}", prompt))
    return jobs


class _Round:
    """One round's jobs run to their ends: what each streamed, and its final result."""

    def __init__(self, generator: DynamicGenerator, jobs: list[Job], rng: random.Random) -> None:
        self.generator = generator
        self.jobs = {job.identifier: job for job in jobs}
        self.ids: dict[str, list[int]] = {name: [] for name in self.jobs}
        self.text = dict.fromkeys(self.jobs, "")
        self.rows = dict.fromkeys(self.jobs, 0)
        self.finals: dict[str, Any] = {}
        # Jobs cancelled at a step: before any (queued), early (prefilling) or later (decoding).
        self.cancel_at = {name: rng.choice([0, 1, 3, 8]) for name in self.jobs
                          if rng.random() < 0.2}

    def run(self, limit: int = 600) -> None:
        generator = self.generator
        for step in range(limit):
            for name, at in self.cancel_at.items():
                if at == step and name not in self.finals:
                    generator.cancel(self.jobs[name])
            if not generator.num_remaining_jobs():
                return
            for result in generator.iterate():
                self._take(result)
            generator.check_invariant()
        raise AssertionError(f"jobs still running after {limit} steps: {generator.stats()}")

    def _take(self, result: Any) -> None:
        name = result["identifier"]
        assert name not in self.finals, f"job {name}: a result after its final one"
        self.ids[name] += result.get("token_ids", [])
        self.text[name] += result.get("text", "")
        probs = result.get("token_probs")
        self.rows[name] += 0 if probs is None else len(probs)
        if result["eos"]:
            self.finals[name] = result


def _check_job(job: Job, final: Any, ids: list[int], text: str, rows: int) -> None:
    name, reason, completion = job.identifier, str(final["eos_reason"]), final["full_completion"]
    assert ids == job.new_token_ids, (name, reason)
    assert final["new_tokens"] == len(job.new_token_ids), name
    assert text == completion, (name, reason)
    if job.return_probs:
        assert rows == len(job.new_token_ids), (name, reason)
    for banned in job.banned_strings:
        assert banned.lower() not in completion.lower(), (name, banned)
    for stop in job.stop_strings:
        assert stop not in completion, (name, stop)
    if job.constraint is CHOICES and reason == "stop_token":
        assert completion in CHOICES, (name, completion)
    if job.constraint is SCHEMA and reason == "stop_token":
        assert set(json.loads(completion)) == {"name", "age"}, (name, completion)


def _soak(seed: int, make_generator: Callable[..., DynamicGenerator],
          engine_parts: Any) -> None:
    rng = random.Random(seed)
    options = _options(rng)
    model, tokenizer = engine_parts
    cache = Cache(model, max_tokens=options.pop("cache_tokens"),
                  page_size=options.pop("page_size"))
    tight = cache.max_tokens < 2048
    if tight:  # every job admitted at once, so that their growth preempts
        options["max_batch_size"] = 256
    generator = DynamicGenerator(model=model, cache=cache, tokenizer=tokenizer, **options)
    if generator.speculator is not None:  # drafts pay whatever this machine's timings say
        generator.speculator.measure_draft_cost = False
        generator.speculator.draft_cost_ratio = 0.0
        generator.speculator.costs.record = lambda tokens, seconds: None  # type: ignore
    jobs = _mixture(rng, tight)
    too_large = Job(input_ids=[5] * (generator.cache.max_tokens + 1), max_new_tokens=1,
                    identifier="too large")
    with pytest.raises(JobTooLargeError):
        generator.enqueue([jobs[0], too_large])  # refused whole: nothing of the list queued
    assert jobs[0].job_id is None and generator.num_remaining_jobs() == 0
    kill_row(generator, rng.randint(2, 12), 0, rng.choice([math.nan, math.inf]))
    generator.enqueue(jobs)
    soak = _Round(generator, jobs, rng)
    soak.run()
    assert set(soak.finals) == set(soak.jobs), f"seed {seed}: jobs without a final result"
    errors = [name for name, final in soak.finals.items() if final["eos_reason"] == "error"]
    assert len(errors) <= 1, (seed, errors)  # the failing row's job, if it had one
    for name, job in soak.jobs.items():
        _check_job(job, soak.finals[name], soak.ids[name], soak.text[name], soak.rows[name])
    stats = generator.stats()
    assert stats.jobs_active == stats.jobs_pending == stats.pages_referenced == 0, stats
    alone = make_generator()
    for name, job in soak.jobs.items():
        if (job.gen_settings.is_greedy and not job.banned_strings and job.constraint is None
                and soak.finals[name]["eos_reason"] in ("max_new_tokens", "stop_string")):
            twin = Job(input_ids=job.input_ids, max_new_tokens=job.max_new_tokens,
                       stop_conditions=list(job.stop_strings), identifier=name,
                       gen_settings=SamplerSettings.greedy())
            solo = run_tokens(alone, [twin])[name]
            assert_same_output(solo, {"tokens": soak.ids[name], "final": soak.finals[name]},
                               model, list(job.input_ids), (seed, name))


@pytest.mark.parametrize("seed", SEEDS + [random.randrange(1 << 30) for _ in range(EXTRA_ROUNDS)])
def test_mixed_traffic_soak(seed: int, make_generator, engine_parts) -> None:
    _soak(seed, make_generator, engine_parts)
