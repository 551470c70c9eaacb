"""Greedy outputs do not depend on how jobs are batched, cached, deduplicated or preempted."""

from __future__ import annotations

import random

from dyngen_core import Job, SamplerSettings

GREEDY = SamplerSettings.greedy()


def _prompts(n: int, seed: int = 0, lo: int = 5, hi: int = 300) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, 500) for _ in range(rng.randrange(lo, hi))] for _ in range(n)]


def _run(generator, prompts, max_new_tokens=12, **job_options):
    jobs = [
        Job(input_ids=p, max_new_tokens=max_new_tokens, stop_conditions=[], gen_settings=GREEDY,
            identifier=i, **job_options)
        for i, p in enumerate(prompts)
    ]
    generator.enqueue(jobs)
    tokens: dict[int, list[int]] = {i: [] for i in range(len(prompts))}
    finals = {}
    while generator.num_remaining_jobs():
        for r in generator.iterate():
            if r["stage"] == "streaming":
                tokens[r["identifier"]].extend(r.get("token_ids", []))
            if r["eos"]:
                finals[r["identifier"]] = r
    return [tokens[i] for i in range(len(prompts))], finals


def _one_at_a_time(generator, prompts, max_new_tokens=12):
    return [_run(generator, [p], max_new_tokens)[0][0] for p in prompts]


def test_batched_equals_one_at_a_time(make_generator):
    prompts = _prompts(6)
    alone = _one_at_a_time(make_generator(prompt_cache=False), prompts)
    together, finals = _run(make_generator(), prompts)
    assert together == alone
    assert all(len(t) == 12 for t in together)
    assert all(f["eos_reason"] == "max_new_tokens" for f in finals.values())


def test_small_cache_waits_and_preempts_with_same_outputs(make_generator):
    # 250-token prompts cross a page boundary while decoding: with 4 pages, jobs must wait and
    # running ones get preempted when they grow.
    prompts = _prompts(6, seed=1, lo=240, hi=252)
    alone = _one_at_a_time(make_generator(prompt_cache=False), prompts, max_new_tokens=16)
    small = make_generator(cache_tokens=1024)
    together, _ = _run(small, prompts, max_new_tokens=16)
    assert together == alone
    assert small.stats().preemptions > 0


def test_prompt_cache_and_dedup_keep_outputs(make_generator):
    shared = _prompts(1, seed=2, lo=600, hi=601)[0]
    prompts = [shared + tail for tail in _prompts(4, seed=3, lo=3, hi=20)]
    alone = _one_at_a_time(make_generator(prompt_cache=False, dedup=False), prompts)
    generator = make_generator()
    first, _ = _run(generator, prompts)  # dedup among running jobs
    again, finals = _run(generator, prompts)  # prompt-cache hits
    assert first == alone
    assert again == alone
    assert all(f["cached_tokens"] >= 512 for f in finals.values())


def test_hundred_prompts_through_four_pages(make_generator):
    prompts = _prompts(100, seed=4, lo=5, hi=120)
    alone = _one_at_a_time(make_generator(prompt_cache=False), prompts, max_new_tokens=4)
    together, finals = _run(make_generator(cache_tokens=1024), prompts, max_new_tokens=4)
    assert len(finals) == 100
    assert together == alone


def test_streamed_chunks_concatenate_to_final_text(make_generator):
    generator = make_generator()
    prompts = _prompts(3, seed=5)
    jobs = [Job(input_ids=p, max_new_tokens=20, stop_conditions=[], gen_settings=GREEDY,
                identifier=i) for i, p in enumerate(prompts)]
    generator.enqueue(jobs)
    chunks: dict[int, str] = {0: "", 1: "", 2: ""}
    stages: dict[int, list[str]] = {0: [], 1: [], 2: []}
    finals = {}
    while generator.num_remaining_jobs():
        for r in generator.iterate():
            stages[r["identifier"]].append(r["stage"])
            chunks[r["identifier"]] += r.get("text", "")
            if r["eos"]:
                finals[r["identifier"]] = r
    for i, job in enumerate(jobs):
        assert chunks[i] == finals[i]["full_completion"]
        assert finals[i]["full_completion"] == generator.tokenizer.decode(job.new_token_ids)
        assert stages[i][0] == "started"
        assert finals[i]["new_tokens"] == 20
        assert finals[i]["prompt_tokens"] == len(prompts[i])
        for key in ("time_enqueued", "time_prefill", "time_generate", "cached_pages",
                    "accepted_draft_tokens", "rejected_draft_tokens"):
            assert key in finals[i]
