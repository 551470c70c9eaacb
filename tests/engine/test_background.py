"""BackgroundGenerator and JobHandle: threads, event loops, cancellation, shared engines."""

from __future__ import annotations

import asyncio
import inspect
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from dyngen_core import (
    BackgroundGenerator,
    DynamicGenerator,
    EngineOptions,
    Job,
    JobHandle,
    SamplerSettings,
    shared_generator,
)
from dyngen_core.errors import EngineStoppedError, JobTooLargeError

GREEDY = SamplerSettings.greedy()


def _job(seed: int, n: int = 40, new: int = 6) -> Job:
    return Job(input_ids=[(seed * 31 + i * 7) % 480 + 10 for i in range(n)], max_new_tokens=new,
               stop_conditions=[], gen_settings=GREEDY, identifier=seed)


class NativePanic(BaseException):
    """What a native library's panic surfaces as (pyo3's PanicException is a BaseException)."""


class StuckStep:
    """Makes every engine step wait for `release()` first, as a hung native call would."""

    def __init__(self, engine: BackgroundGenerator, monkeypatch: pytest.MonkeyPatch) -> None:
        self.entered = threading.Event()
        self.released = threading.Event()
        iterate = engine.generator.iterate

        def stuck_iterate():
            self.entered.set()
            self.released.wait(120)
            return iterate()

        monkeypatch.setattr(engine.generator, "iterate", stuck_iterate)

    def release(self) -> None:
        self.released.set()


def _fail_next_step(engine: BackgroundGenerator, monkeypatch: pytest.MonkeyPatch,
                    fault: BaseException) -> None:
    def failing_iterate():
        raise fault

    monkeypatch.setattr(engine.generator, "iterate", failing_iterate)


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


def test_engine_options_defaults_are_the_generators_own() -> None:
    """Defaults are what users get: the engine `shared_generator` (and so every adapter) builds
    from ``EngineOptions()`` hands `DynamicGenerator` exactly the generator's own defaults, and
    leaves the options it does not name (overlapped steps, the skinny matmul) at theirs, so
    nobody needs a tuning argument to reach the generator's speed."""
    from dyngen_core.runtime.background import _generator_options

    defaults = EngineOptions()
    generator = inspect.signature(DynamicGenerator.__init__).parameters
    passed = _generator_options(defaults)
    assert passed, "the engine passes its generator options"
    for name, value in passed.items():
        assert value == generator[name].default, name
    loader = inspect.signature(DynamicGenerator.from_model_dir).parameters
    for name in ("cache_tokens", "cache_mode", "tensor_parallel"):
        assert getattr(defaults, name) == loader[name].default, name


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


@pytest.mark.parametrize("fault", [SystemExit(3), KeyboardInterrupt(), NativePanic("panicked")],
                         ids=["SystemExit", "KeyboardInterrupt", "native panic"])
def test_a_base_exception_in_a_step_fails_every_pending_and_future_call(
        engine, monkeypatch, fault):
    running = engine.submit(_job(10, new=400))
    next(iter(running))  # admitted: the engine runs it
    _fail_next_step(engine, monkeypatch, fault)
    with pytest.raises(EngineStoppedError, match=type(fault).__name__) as stopped:
        running.result(timeout=30)
    assert stopped.value.__cause__ is fault
    assert not engine.running
    with pytest.raises(EngineStoppedError, match=type(fault).__name__):
        engine.submit(_job(11))
    with pytest.raises(EngineStoppedError, match=type(fault).__name__):
        engine.submit_many([_job(12), _job(13)])


def test_jobs_waiting_for_admission_fail_when_the_engine_dies(engine, monkeypatch):
    stuck = StuckStep(engine, monkeypatch)
    first = engine.submit(_job(14))
    assert stuck.entered.wait(30)
    waiting = engine.submit_many([_job(15), _job(16)])  # handed over, not yet admitted

    def panic_then_iterate():
        raise NativePanic("panicked")

    monkeypatch.setattr(engine.generator, "iterate", panic_then_iterate)
    stuck.release()  # the stuck step returns; the next one panics
    for handle in [first, *waiting]:
        with pytest.raises(EngineStoppedError, match="NativePanic"):
            handle.result(timeout=30)


def test_an_exception_in_a_step_fails_its_jobs_and_the_engine_keeps_serving(engine, monkeypatch):
    _fail_next_step(engine, monkeypatch, RuntimeError("device lost"))
    with pytest.raises(RuntimeError, match="device lost"):
        engine.submit(_job(17)).result(timeout=30)
    monkeypatch.undo()
    assert engine.running
    assert engine.submit(_job(18)).result(timeout=60)["eos_reason"] == "max_new_tokens"


def test_a_job_submitted_while_close_runs_is_answered(engine, monkeypatch):
    stuck = StuckStep(engine, monkeypatch)
    admitted = engine.submit(_job(19, new=400))
    assert stuck.entered.wait(30)
    handed_over = engine.submit(_job(20))  # the engine thread is inside a step
    closing = threading.Thread(target=engine.close)
    closing.start()
    deadline = time.monotonic() + 30
    while engine.running and time.monotonic() < deadline:
        time.sleep(0.001)
    stuck.release()
    closing.join(60)
    for handle in (admitted, handed_over):
        with pytest.raises(EngineStoppedError, match="closed"):
            handle.result(timeout=30)


def test_submit_and_submit_many_after_close_raise(engine):
    engine.close()
    with pytest.raises(EngineStoppedError, match="closed"):
        engine.submit(_job(21))
    with pytest.raises(EngineStoppedError, match="closed"):
        engine.submit_many([_job(22), _job(23)])
    engine.close()  # closing twice is harmless


def test_submissions_racing_close_all_end(engine):
    handles: list = []
    refused: list[BaseException] = []
    start = threading.Barrier(5)

    def submit_until_closed(seed: int) -> None:
        start.wait()
        for i in range(200):
            try:
                handles.extend(engine.submit_many([_job(seed * 1000 + i, new=2)]))
            except BaseException as exc:  # noqa: BLE001 - collected and checked below
                refused.append(exc)
                return

    threads = [threading.Thread(target=submit_until_closed, args=(s,)) for s in range(4)]
    for thread in threads:
        thread.start()
    start.wait()
    time.sleep(0.05)
    engine.close()
    for thread in threads:
        thread.join(60)
    assert all(isinstance(exc, EngineStoppedError) for exc in refused)
    for handle in handles:
        try:
            final = handle.result(timeout=30)
        except EngineStoppedError:
            continue
        assert final["eos"]


def test_a_stream_with_a_timeout_raises_when_the_engine_is_stuck(engine, monkeypatch):
    stuck = StuckStep(engine, monkeypatch)
    handle = engine.submit(_job(24))
    started = time.monotonic()
    with pytest.raises(TimeoutError, match="0.2"):
        list(handle.stream(timeout=0.2))
    with pytest.raises(TimeoutError):
        handle.result(timeout=0.2)

    async def read_async():
        async for _ in handle.astream(timeout=0.2):
            pass

    with pytest.raises(TimeoutError):
        asyncio.run(read_async())
    with pytest.raises(TimeoutError):
        asyncio.run(handle.aresult(timeout=0.2))
    assert time.monotonic() - started < 20
    assert not handle.done  # a timeout leaves the job to its caller: cancel it to give up
    handle.cancel()
    stuck.release()
    assert handle.result(timeout=60)["eos_reason"] == "cancelled"


def test_shared_generator_replaces_a_closed_or_dead_engine(engine_model_dir, monkeypatch):
    options = {"cache_tokens": 1024, "device": "cpu"}
    first = shared_generator(engine_model_dir, **options)
    first.close()
    second = shared_generator(engine_model_dir, **options)
    assert second is not first and second.running
    assert second.generator.model is first.generator.model  # the weights are reused
    assert second.submit(_job(25)).result(timeout=60)["eos"]
    _fail_next_step(second, monkeypatch, NativePanic("panicked"))
    with pytest.raises(EngineStoppedError):
        second.submit(_job(26)).result(timeout=30)
    third = shared_generator(engine_model_dir, **options)
    assert third is not second and third.running
    assert third.submit(_job(27)).result(timeout=60)["eos"]
    third.close()


def test_a_handle_cancels_through_the_callable_it_was_given():
    calls: list[int] = []
    handle = JobHandle(_job(28), cancel=lambda: calls.append(1))
    handle.cancel()
    assert calls == [1] and handle.cancel_requested


def test_generation_defaults_and_the_largest_job_come_from_the_engine(engine):
    config = engine.generator.model.config
    assert dict(engine.generation_defaults) == config.generation_defaults
    assert engine.max_job_tokens == min(config.max_position_embeddings,
                                        engine.generator.cache.max_tokens)
    engine.submit(_job(29, n=engine.max_job_tokens - 10, new=10)).cancel()
    with pytest.raises(JobTooLargeError):
        engine.submit(_job(30, n=engine.max_job_tokens - 10, new=11))


def test_a_consumer_side_exception_never_stops_the_engine(engine, monkeypatch):
    push = JobHandle._push

    def push_or_fail(handle, result, *rest):
        if handle.job.identifier == 31:
            raise RuntimeError("the consumer broke")
        push(handle, result, *rest)

    monkeypatch.setattr(JobHandle, "_push", push_or_fail)
    engine.submit(_job(31))
    beside = engine.submit(_job(32))
    assert beside.result(timeout=60)["eos_reason"] == "max_new_tokens"
    assert engine.running
    assert engine.submit(_job(33)).result(timeout=60)["eos_reason"] == "max_new_tokens"
