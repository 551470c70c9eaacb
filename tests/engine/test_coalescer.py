"""SubmissionCoalescer: how jobs submitted from event loops reach the engine (recorded by a fake
engine), and that a real engine runs a coalesced group in one step."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest

from dyngen_core import BackgroundGenerator, Job, SamplerSettings, SubmissionCoalescer


class FakeHandle:
    def __init__(self, job: object) -> None:
        self.job, self.cancelled = job, False

    def cancel(self) -> None:
        self.cancelled = True


class FakeEngine:
    """Records how jobs arrive; refuses the job "too big" as the real engine refuses a job
    that can never fit."""

    def __init__(self) -> None:
        self.calls: list[list[object]] = []
        self.handles: list[FakeHandle] = []

    def submit_many(self, jobs: list[object]) -> list[FakeHandle]:
        self.calls.append(list(jobs))
        if "too big" in jobs:
            raise ValueError("a job is too big")
        self.handles += [FakeHandle(j) for j in jobs]
        return self.handles[-len(jobs):]

    def submit(self, job: object) -> FakeHandle:
        self.calls.append([job])
        if job == "too big":
            raise ValueError("job too big for the cache")
        self.handles.append(FakeHandle(job))
        return self.handles[-1]


def test_one_loop_iteration_of_submissions_reaches_the_engine_together() -> None:
    engine = FakeEngine()
    coalescer = SubmissionCoalescer()

    async def run() -> list[Any]:
        first = await asyncio.gather(*(coalescer.submit(engine, f"job {i}") for i in range(5)))
        second = await asyncio.gather(*(coalescer.submit(engine, f"late {i}") for i in range(2)))
        return [*first, *second]

    handles = asyncio.run(run())
    assert engine.calls == [[f"job {i}" for i in range(5)], ["late 0", "late 1"]]
    assert [h.job for h in handles] == [*(f"job {i}" for i in range(5)), "late 0", "late 1"]


def test_each_engine_gets_its_own_group() -> None:
    first, second = FakeEngine(), FakeEngine()
    coalescer = SubmissionCoalescer()

    async def run() -> None:
        await asyncio.gather(coalescer.submit(first, "a"), coalescer.submit(second, "b"),
                             coalescer.submit(first, "c"))

    asyncio.run(run())
    assert first.calls == [["a", "c"]] and second.calls == [["b"]]


def test_a_refused_job_fails_only_its_submitter() -> None:
    engine = FakeEngine()
    coalescer = SubmissionCoalescer()

    async def run() -> list[Any]:
        return list(await asyncio.gather(coalescer.submit(engine, "ok"),
                                         coalescer.submit(engine, "too big"),
                                         return_exceptions=True))

    ok, refused = asyncio.run(run())
    assert engine.calls == [["ok", "too big"], ["ok"], ["too big"]]  # a group, then one by one
    assert ok.job == "ok" and isinstance(refused, ValueError)


def test_a_submitter_cancelled_before_the_group_goes_out_submits_nothing() -> None:
    engine = FakeEngine()
    coalescer = SubmissionCoalescer()

    async def run() -> None:
        abandoned = asyncio.ensure_future(coalescer.submit(engine, "abandoned"))
        kept = asyncio.ensure_future(coalescer.submit(engine, "kept"))
        await asyncio.sleep(0)  # both submitted; the group goes out at the end of the iteration
        abandoned.cancel()
        await kept
        with pytest.raises(asyncio.CancelledError):
            await abandoned

    asyncio.run(run())
    assert engine.calls == [["kept"]]


def test_a_submitter_cancelled_after_the_group_went_out_cancels_its_job() -> None:
    engine = FakeEngine()
    coalescer = SubmissionCoalescer()

    async def run() -> None:
        abandoned = asyncio.ensure_future(coalescer.submit(engine, "abandoned"))
        kept = asyncio.ensure_future(coalescer.submit(engine, "kept"))
        await asyncio.sleep(0)
        # Runs after the group went out and before `abandoned` resumes with its handle.
        asyncio.get_running_loop().call_soon(abandoned.cancel)
        assert (await kept).job == "kept"
        with pytest.raises(asyncio.CancelledError):
            await abandoned

    asyncio.run(run())
    assert engine.calls == [["abandoned", "kept"]]
    assert [h.cancelled for h in engine.handles] == [True, False]


def test_expected_participants_are_waited_for_across_loop_iterations() -> None:
    engine = FakeEngine()
    coalescer = SubmissionCoalescer(expected=4)

    async def participant(i: int) -> Any:
        for _ in range(i):  # participants get ready in different loop iterations
            await asyncio.sleep(0)
        if i == 2:
            coalescer.withdraw()  # failed before building its job
            return None
        return await coalescer.submit(engine, f"job {i}")

    async def run() -> list[Any]:
        results = await asyncio.gather(*(participant(i) for i in range(4)))
        results.append(await coalescer.submit(engine, "after"))  # settled: per iteration again
        return results

    handles = asyncio.run(run())
    assert engine.calls == [["job 0", "job 1", "job 3"], ["after"]]
    assert [h.job for h in handles if h is not None] == ["job 0", "job 1", "job 3", "after"]


def test_loops_on_several_threads_share_one_coalescer() -> None:
    engine = FakeEngine()
    coalescer = SubmissionCoalescer()
    barrier = threading.Barrier(3)

    def run_loop(name: str) -> None:
        async def run() -> None:
            barrier.wait()
            await asyncio.gather(*(coalescer.submit(engine, f"{name} {i}") for i in range(3)))

        asyncio.run(run())

    threads = [threading.Thread(target=run_loop, args=(n,)) for n in "abc"]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert sorted(sorted(call) for call in engine.calls) == [
        [f"{n} {i}" for i in range(3)] for n in "abc"]


def test_negative_expected_is_refused() -> None:
    with pytest.raises(ValueError, match="expected"):
        SubmissionCoalescer(expected=-1)


def test_a_real_engine_gets_one_loop_iterations_jobs_in_one_submit_many(
        make_generator: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    engine = BackgroundGenerator(make_generator(cache_tokens=4096))
    groups: list[int] = []
    submit_many = engine.submit_many

    def recorded(jobs: list[Job]) -> Any:
        groups.append(len(jobs))
        return submit_many(jobs)

    monkeypatch.setattr(engine, "submit_many", recorded)
    coalescer = SubmissionCoalescer()
    greedy = SamplerSettings.greedy()

    async def run() -> list[Any]:
        jobs = [Job(input_ids=[10 + i, 20, 30], max_new_tokens=4, gen_settings=greedy)
                for i in range(8)]
        handles = await asyncio.gather(*(coalescer.submit(engine, job) for job in jobs))
        return [await handle.aresult(timeout=60) for handle in handles]

    try:
        finals = asyncio.run(run())
    finally:
        engine.close()
    assert groups == [8]
    assert [f["new_tokens"] for f in finals] == [4] * 8
