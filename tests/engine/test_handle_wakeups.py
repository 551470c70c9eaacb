"""How the engine thread wakes event loops waiting on job handles: a step's results wake each
loop once (`Wakeups`), and a task awaiting only the final result is not woken by the others."""

from __future__ import annotations

import asyncio
from typing import Any

from dyngen_core import Job, JobHandle, SamplerSettings
from dyngen_core.engine.results import EosReason, Result
from dyngen_core.runtime.handle import Wakeups


def _result(job: Job, eos: bool) -> Result:
    return Result(job=job, identifier=job.identifier, stage="streaming", eos=eos,
                  eos_reason=EosReason.MAX_NEW_TOKENS if eos else None,
                  full_completion="", new_tokens=0, prompt_tokens=3, cached_tokens=0,
                  cached_pages=0, time_enqueued=0.0, time_prefill=0.0, time_generate=0.0,
                  accepted_draft_tokens=0, rejected_draft_tokens=0)


def _handle(identifier: int) -> JobHandle:
    job = Job(input_ids=[1, 2, 3], max_new_tokens=4, gen_settings=SamplerSettings.greedy(),
              identifier=identifier)
    return JobHandle(job, cancel=lambda: None)


class CountingLoop:
    """Stands in for an event loop: counts the wake-ups sent to it and runs them."""

    def __init__(self) -> None:
        self.calls = 0

    def is_closed(self) -> bool:
        return False

    def call_soon_threadsafe(self, callback: Any, *args: Any) -> None:
        self.calls += 1
        callback(*args)


def test_a_step_wakes_each_event_loop_once_whatever_its_jobs() -> None:
    loops = [CountingLoop(), CountingLoop()]
    events = [asyncio.Event() for _ in range(5)]
    wakeups = Wakeups()
    wakeups.add([(loops[0], events[0]), (loops[1], events[1]), (loops[0], events[2])])
    wakeups.add([(loops[0], events[3]), (loops[1], events[4])])  # type: ignore[list-item]
    assert not any(event.is_set() for event in events)
    wakeups.send()
    assert [loop.calls for loop in loops] == [1, 1]
    assert all(event.is_set() for event in events)
    wakeups.send()  # sent once: nothing left
    assert [loop.calls for loop in loops] == [1, 1]


def test_awaiting_the_final_result_wakes_once_not_per_result() -> None:
    async def scenario() -> None:
        handle = _handle(1)
        streamed = _handle(2)
        final = asyncio.ensure_future(handle.aresult(timeout=30))
        stream = streamed.astream(timeout=30)
        first = asyncio.ensure_future(anext(stream))
        await asyncio.sleep(0)
        (end_waiter,) = handle._end_waiters
        assert not handle._waiters and len(streamed._waiters) == 1
        wakeups = Wakeups()
        for _ in range(3):  # results that do not end the job
            handle._push(_result(handle.job, eos=False), wakeups)
        streamed._push(_result(streamed.job, eos=False), wakeups)
        wakeups.send()
        await asyncio.sleep(0)
        assert not end_waiter[1].is_set() and handle._end_waiters == [end_waiter]
        assert not final.done()
        assert not (await first)["eos"]  # a streaming reader is woken by every result
        handle._push(_result(handle.job, eos=True))
        assert (await final)["eos"] and not handle._end_waiters

    asyncio.run(scenario())
