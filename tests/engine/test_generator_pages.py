"""Page accounting seen through the generator: dedup, prompt cache, cancel, abort, size errors."""

from __future__ import annotations

import random
import threading

import pytest

from dyngen_core import Job, SamplerSettings
from dyngen_core.errors import JobTooLargeError

GREEDY = SamplerSettings.greedy()


def _ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 500) for _ in range(n)]


def _drain(generator, on_result=None) -> dict:
    finals = {}
    while generator.num_remaining_jobs():
        for r in generator.iterate():
            if on_result is not None:
                on_result(r)
            if r["eos"]:
                finals[r["identifier"]] = r
    return finals


def test_dedup_holds_and_computes_shared_prefix_once(make_generator):
    generator = make_generator(cache_tokens=16384, prompt_cache=False)
    prefix = _ids(1024, seed=1)
    jobs = [Job(input_ids=prefix + _ids(20, seed=100 + i), max_new_tokens=4,
                stop_conditions=[], gen_settings=GREEDY, identifier=i) for i in range(8)]
    generator.enqueue(jobs)
    peak_referenced = 0

    def watch(_):
        nonlocal peak_referenced
        peak_referenced = max(peak_referenced, generator.stats().pages_referenced)

    finals = _drain(generator, watch)
    stats = generator.stats()
    # 4 shared prefix pages once, plus one tail page per job.
    assert peak_referenced <= 4 + 8
    # The prefix is computed once; each job computes its own 20-token tail (plus a little).
    assert stats.prefill_tokens_computed <= 1024 + 8 * 21
    assert stats.prefill_tokens_reused >= 7 * 1024
    assert len(finals) == 8
    assert stats.pages_referenced == 0


def test_without_dedup_prefix_is_computed_per_job(make_generator):
    generator = make_generator(cache_tokens=16384, prompt_cache=False, dedup=False)
    prefix = _ids(512, seed=1)
    generator.enqueue([Job(input_ids=prefix + _ids(10, seed=7 + i), max_new_tokens=2,
                           stop_conditions=[], identifier=i) for i in range(3)])
    _drain(generator)
    assert generator.stats().prefill_tokens_computed >= 3 * 512


def test_repeat_prompt_hits_prompt_cache(make_generator):
    generator = make_generator()
    prompt = _ids(700, seed=2)
    first = _drain_one(generator, prompt)
    second = _drain_one(generator, prompt)
    assert first["cached_tokens"] == 0
    assert second["cached_tokens"] >= 512
    assert second["cached_pages"] >= 2
    assert second["full_completion"] == first["full_completion"]


def test_two_turn_chat_reuses_turn_one(make_generator):
    generator = make_generator()
    turn_one = _ids(600, seed=3)
    first = _drain_one(generator, turn_one, max_new_tokens=8)
    job_tokens = first["job"].new_token_ids
    turn_two = turn_one + job_tokens + _ids(30, seed=4)
    second = _drain_one(generator, turn_two)
    assert second["cached_tokens"] >= 512


def _drain_one(generator, prompt, max_new_tokens=6):
    generator.enqueue(Job(input_ids=prompt, max_new_tokens=max_new_tokens, stop_conditions=[],
                          gen_settings=GREEDY, identifier="x"))
    return _drain(generator)["x"]


def test_cancel_running_and_pending_jobs(make_generator):
    generator = make_generator(cache_tokens=1024)
    jobs = [Job(input_ids=_ids(200, seed=i), max_new_tokens=50, stop_conditions=[],
                identifier=i) for i in range(8)]
    generator.enqueue(jobs)
    for _ in range(3):
        generator.iterate()
    generator.cancel(jobs[0])  # running
    generator.cancel(jobs[7])  # still waiting
    generator.check_invariant()
    finals = _drain(generator)
    assert finals[0]["eos_reason"] == "cancelled"
    assert finals[7]["eos_reason"] == "cancelled"
    assert all(finals[i]["eos_reason"] == "max_new_tokens" for i in range(1, 7))
    assert generator.stats().pages_referenced == 0


def test_clear_queue_mid_generation_leaves_generator_usable(make_generator):
    generator = make_generator()
    generator.enqueue([Job(input_ids=_ids(300, seed=i), max_new_tokens=40, stop_conditions=[])
                       for i in range(4)])
    for _ in range(4):
        generator.iterate()
    generator.clear_queue()
    generator.check_invariant()
    assert generator.num_remaining_jobs() == 0
    assert generator.stats().pages_referenced == 0
    assert isinstance(generator.generate("hello", max_new_tokens=3), str)


def test_abort_event_returns_none_and_clears(make_generator):
    generator = make_generator()
    event = threading.Event()
    calls = 0
    original = generator.iterate

    def iterate_then_abort():
        nonlocal calls
        calls += 1
        if calls == 3:
            event.set()
        return original()

    generator.iterate = iterate_then_abort  # type: ignore[method-assign]
    assert generator.generate(["a b c"] * 3, max_new_tokens=50, abort_event=event) is None
    del generator.iterate
    generator.check_invariant()
    assert generator.num_remaining_jobs() == 0
    assert generator.stats().pages_referenced == 0


def test_job_that_can_never_fit_is_rejected_at_enqueue(make_generator):
    generator = make_generator(cache_tokens=512)
    with pytest.raises(JobTooLargeError, match=r"needs 3 pages.*2 pages"):
        generator.enqueue(Job(input_ids=_ids(500, seed=1), max_new_tokens=100))
    assert generator.num_remaining_jobs() == 0
