"""BackgroundGenerator and JobHandle: threads, event loops, cancellation, shared engines."""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from dyngen_core import BackgroundGenerator, Job, SamplerSettings, shared_generator
from dyngen_core.errors import JobTooLargeError

GREEDY = SamplerSettings.greedy()


def _job(seed: int, n: int = 40, new: int = 6) -> Job:
    return Job(input_ids=[(seed * 31 + i * 7) % 480 + 10 for i in range(n)], max_new_tokens=new,
               stop_conditions=[], gen_settings=GREEDY, identifier=seed)


@pytest.fixture
def engine(make_generator):
    background = BackgroundGenerator(make_generator(cache_tokens=4096))
    yield background
    background.close()


def test_submit_from_many_threads_matches_direct_generation(engine, make_generator):
    direct = make_generator()
    expected = {}
    for i in range(6):
        job = _job(i)
        direct.enqueue(job)
        while direct.num_remaining_jobs():
            direct.iterate()
        expected[i] = job.new_token_ids
    with ThreadPoolExecutor(6) as pool:
        finals = list(pool.map(lambda i: engine.submit(_job(i)).result(timeout=120), range(6)))
    for final in finals:
        assert final["job"].new_token_ids == expected[final["identifier"]]
        assert final["eos_reason"] == "max_new_tokens"


def test_sync_iteration_streams_chunks(engine):
    handle = engine.submit(_job(1, new=8))
    results = list(handle)
    assert results[0]["stage"] == "started"
    assert results[-1]["eos"]
    assert "".join(r.get("text", "") for r in results) == results[-1]["full_completion"]


def test_async_consumers_run_concurrently_on_one_loop(engine):
    async def main():
        handles = engine.submit_many([_job(i, new=5) for i in range(16)])
        seen_active = 0

        async def consume(handle):
            nonlocal seen_active
            async for _ in handle:
                seen_active = max(seen_active, engine.stats().jobs_active)
            return await handle.aresult()

        finals = await asyncio.gather(*(consume(h) for h in handles))
        return finals, seen_active

    finals, seen_active = asyncio.run(main())
    assert len(finals) == 16 and all(f["new_tokens"] == 5 for f in finals)
    assert seen_active > 1  # jobs ran batched, not one after another


def test_cancel_frees_pages_and_engine_keeps_serving(engine):
    long_job = _job(2, n=300, new=10_000 // 4)
    handle = engine.submit(long_job)
    for result in handle:
        if result["stage"] == "streaming":
            break
    handle.cancel()
    final = handle.result(timeout=60)
    assert final["eos_reason"] == "cancelled"
    deadline = time.time() + 30
    while engine.stats().pages_referenced and time.time() < deadline:
        time.sleep(0.01)
    assert engine.stats().pages_referenced == 0
    assert engine.submit(_job(3)).result(timeout=60)["eos_reason"] == "max_new_tokens"
    engine.generator.check_invariant()


def test_job_that_can_never_fit_raises_in_the_caller(engine):
    with pytest.raises(JobTooLargeError):
        engine.submit(_job(4, n=4000, new=200))


def test_submitting_twice_is_an_error_reported_to_that_handle(engine):
    job = _job(5)
    engine.submit(job).result(timeout=60)
    with pytest.raises(Exception, match="already enqueued"):
        engine.submit(job).result(timeout=60)


def test_shared_generator_is_one_engine_per_folder_and_options(engine_model_dir):
    a = shared_generator(engine_model_dir, cache_tokens=2048, device="cpu")
    b = shared_generator(str(engine_model_dir), cache_tokens=2048, device="cpu")
    c = shared_generator(engine_model_dir, cache_tokens=4096, device="cpu")
    assert a is b
    assert c is not a
    assert c.generator.model is a.generator.model  # weights are loaded once per folder
    assert threading.active_count() >= 2


def test_a_consumer_whose_loop_closed_does_not_stop_the_engine(engine):
    handle = engine.submit(_job(6, new=40))

    async def consume_then_give_up():
        async def consume():
            async for _ in handle:
                pass

        task = asyncio.ensure_future(consume())
        await asyncio.sleep(0)
        task.cancel()

    asyncio.run(consume_then_give_up())  # the consumer's loop is closed now
    assert handle.result(timeout=60)["eos"]
    assert engine.submit(_job(7)).result(timeout=60)["eos_reason"] == "max_new_tokens"
