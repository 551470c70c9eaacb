"""No job can break another, nothing hangs, nothing is silently wrong (issue 21 §2, §3, §5,
§6): bad values are refused at enqueue with a clear error, a fault of one job ends that job
alone, a failed step never leaves relabelled pages without their data, and an interrupted
`generate()` cleans up after itself."""

from __future__ import annotations

import random
import threading
import time
from typing import Any

import pytest

from dyngen_core import Job, SamplerSettings
from dyngen_core.engine import scheduler as scheduler_module
from dyngen_core.engine.defrag import DefragPlan
from dyngen_core.engine.plan import PageCopy
from dyngen_core.errors import JobError, JobTooLargeError
from dyngen_core.sampling.sampler import Sampler
from tests.engine.step_helpers import run_to_finals

GREEDY = SamplerSettings.greedy()
SAMPLED = SamplerSettings(temperature=0.9, top_p=0.9)


def _prompt(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 500) for _ in range(length)]


def _jobs(n: int = 4) -> list[Job]:
    return [Job(input_ids=_prompt(i, 20 + 30 * i), max_new_tokens=8, stop_conditions=[],
                gen_settings=GREEDY if i % 2 else SAMPLED, seed=i, identifier=i)
            for i in range(n)]


# ---- §3: bad values are refused at enqueue ----------------------------------------------------

@pytest.mark.parametrize("seed", ["7", 1.5, True, [1]])
def test_a_seed_that_is_not_an_int_is_refused(seed: Any) -> None:
    with pytest.raises(JobError, match="seed must be an int"):
        Job(input_ids=[1, 2, 3], max_new_tokens=4, seed=seed)


@pytest.mark.parametrize("ids", [[1, 1.7, 3], [1, "2"], [True, 2]])
def test_prompt_ids_that_are_not_ints_are_refused(ids: list[Any]) -> None:
    with pytest.raises(JobError, match="integer token ids"):
        Job(input_ids=ids, max_new_tokens=4)


@pytest.mark.parametrize("bad", [10**9, -1, 512])
def test_token_ids_outside_the_vocabulary_are_refused_at_enqueue(make_generator, bad) -> None:
    generator = make_generator()
    with pytest.raises(JobError, match=r"input_ids holds token ids outside the vocabulary"):
        generator.enqueue(Job(input_ids=[5, bad, 6], max_new_tokens=4))
    stop = Job(input_ids=[5, 6], max_new_tokens=4, min_new_tokens=2, stop_conditions=[bad])
    with pytest.raises(JobError, match=r"stop_conditions holds token ids outside"):
        generator.enqueue(stop)
    assert generator.num_remaining_jobs() == 0
    assert run_to_finals(generator, _jobs(2)).keys() == {0, 1}  # the generator goes on


def test_prompts_longer_than_the_model_context_are_refused(make_generator) -> None:
    generator = make_generator(cache_tokens=16384)
    context = generator.model.config.max_position_embeddings
    with pytest.raises(JobTooLargeError, match=rf"{context + 2} positions .* context is "
                                               rf"{context}"):
        generator.enqueue(Job(input_ids=[5] * (context + 1), max_new_tokens=1))
    with pytest.raises(JobTooLargeError, match=rf"{context - 10} prompt \+ 20 new tokens"):
        generator.enqueue(Job(input_ids=[5] * (context - 10), max_new_tokens=20))


# ---- §3: a fault of one job ends that job alone ------------------------------------------------

def test_a_failing_text_stream_ends_its_job_alone(make_generator) -> None:
    alone = run_to_finals(make_generator(), _jobs())
    generator = make_generator()
    jobs = _jobs()
    generator.enqueue(jobs)
    stream = generator._records[jobs[2].job_id].stream
    advance, calls = stream.advance, [0]

    def broken(token_id: int) -> Any:
        calls[0] += 1
        if calls[0] == 3:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "a broken detokenizer")
        return advance(token_id)

    stream.advance = broken  # type: ignore[method-assign]
    finals = run_to_finals(generator, [])
    assert finals[2]["eos_reason"] == "error"
    assert isinstance(finals[2]["error"], UnicodeDecodeError)
    for i in (0, 1, 3):
        assert finals[i]["full_completion"] == alone[i]["full_completion"]
    generator.check_invariant()


def test_a_sampler_fault_of_one_job_fails_that_job_alone(make_generator, monkeypatch) -> None:
    alone = run_to_finals(make_generator(overlap_steps=False), _jobs())
    sample_tokens = Sampler.sample_tokens

    def broken(sampler: Sampler, logits: Any, requests: Any, **kw: Any) -> Any:
        if any(r.seed == 3 and r.counter == 2 for r in requests):
            raise RuntimeError("a fault in one job's sampling stage")
        return sample_tokens(sampler, logits, requests, **kw)

    monkeypatch.setattr(Sampler, "sample_tokens", broken)
    finals = run_to_finals(make_generator(overlap_steps=False), _jobs())
    assert finals[3]["eos_reason"] == "error" and finals[3]["new_tokens"] == 2
    for i in (0, 1, 2):
        assert finals[i]["full_completion"] == alone[i]["full_completion"]


# ---- §2: a failed step never leaves relabelled pages without their data ------------------------

def test_a_failed_step_after_defragmentation_serves_no_lost_page(make_generator,
                                                                 monkeypatch) -> None:
    prompt = _prompt(9, 600)  # two full 256-token pages, then a partial one

    def job() -> Job:
        return Job(input_ids=prompt, max_new_tokens=6, stop_conditions=[], gen_settings=GREEDY,
                   identifier="doc")

    generator = make_generator()
    expected = run_to_finals(generator, [job()])["doc"]["full_completion"]
    scheduler = generator._scheduler
    cached = scheduler.pool.cached_pages()
    assert len(cached) >= 2
    # Defragmentation relabels the two full pages to free ids; their copies go into the next
    # plan, and that step fails before the runner runs them.
    targets = [p for p in range(scheduler.pool.num_pages) if p not in cached][-2:]
    forced = DefragPlan([PageCopy(src, dst, 256) for src, dst in zip(cached[:2], targets)],
                        dict(zip(cached[:2], targets)))
    monkeypatch.setattr(scheduler_module, "plan_defrag", lambda *a, **k: forced)
    assert scheduler.defragment() == 2
    run = generator._runner.run

    def out_of_memory(plan: Any, feed: Any = None) -> Any:
        generator._runner.run = run  # type: ignore[method-assign]
        raise MemoryError("out of memory before the page copies ran")

    generator._runner.run = out_of_memory  # type: ignore[method-assign]
    failed = run_to_finals(generator, [Job(input_ids=[5, 6, 7], max_new_tokens=2, identifier="x")])
    assert failed["x"]["eos_reason"] == "error"
    generator.check_invariant()
    again = run_to_finals(generator, [job()])["doc"]
    assert again["full_completion"] == expected
    assert again["cached_tokens"] < 512  # the lost pages were not served as cache hits


# ---- §5: generate() cleans up after itself -----------------------------------------------------

def test_an_interrupted_generate_leaves_no_job_queued(make_generator, monkeypatch) -> None:
    generator = make_generator()
    iterate, calls = generator.iterate, [0]

    def interrupted() -> Any:
        calls[0] += 1
        if calls[0] == 3:
            raise KeyboardInterrupt
        return iterate()

    monkeypatch.setattr(generator, "iterate", interrupted)
    with pytest.raises(KeyboardInterrupt):
        generator.generate(prompt=["one two", "three four"], max_new_tokens=8)
    monkeypatch.setattr(generator, "iterate", iterate)
    assert generator.num_remaining_jobs() == 0
    assert isinstance(generator.generate(prompt="one two", max_new_tokens=4), str)


def test_a_wrong_abort_event_is_refused_before_anything_is_queued(make_generator) -> None:
    generator = make_generator()
    with pytest.raises(JobError, match="abort_event must be a threading.Event"):
        generator.generate(prompt="one two", max_new_tokens=4, abort_event=True)
    assert generator.num_remaining_jobs() == 0
    event = threading.Event()
    event.set()
    assert generator.generate(prompt="one two", max_new_tokens=4, abort_event=event) is None
    assert generator.num_remaining_jobs() == 0


def test_a_background_submit_refuses_bad_token_ids_at_once(make_generator) -> None:
    from dyngen_core import BackgroundGenerator

    engine = BackgroundGenerator(make_generator())
    try:
        with pytest.raises(JobError, match="outside the vocabulary"):
            engine.submit(Job(input_ids=[5, 10**9], max_new_tokens=2))
        assert engine.submit(Job(input_ids=[5, 6], max_new_tokens=2)).result(timeout=60)["eos"]
        assert engine.wait_idle(timeout=60).jobs_active == 0
    finally:
        engine.close()


def test_wait_idle_returns_only_once_every_submitted_job_has_its_result(make_generator) -> None:
    from dyngen_core import BackgroundGenerator

    generator = make_generator()
    enqueue = generator.enqueue

    def slow_enqueue(job: Any) -> None:  # widens the window between hand-over and the step
        time.sleep(0.2)
        enqueue(job)

    generator.enqueue = slow_enqueue  # type: ignore[method-assign]
    engine = BackgroundGenerator(generator)
    try:
        for _ in range(3):
            handles = engine.submit_many(_jobs())
            stats = engine.wait_idle(timeout=120)
            assert all(h.done for h in handles)
            assert stats.jobs_active == stats.jobs_pending == stats.pages_referenced == 0
    finally:
        engine.close()
