"""The server's side of the shared engine: a request's jobs go in together, their results come
back as one stream, and whatever ends a request early cancels its jobs.

Jobs go through a `SubmissionCoalescer`, so the jobs of requests that arrive in the same
event-loop iteration (and a request's ``n`` choices) are enqueued before the same engine step:
they batch, and a shared prompt prefix is prefilled once.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from typing import Any

from dyngen_core import BackgroundGenerator, Job, JobHandle, Result, SubmissionCoalescer


class EngineBridge:
    """Submits jobs to ``engine`` for request handlers on the server's event loop."""

    def __init__(self, engine: BackgroundGenerator) -> None:
        self.engine = engine
        self._coalescer = SubmissionCoalescer()

    async def start(self, jobs: Sequence[Job]) -> RunningJobs:
        """Submit ``jobs`` and wait until the engine has admitted each (its first result).

        Raises what the engine refuses a job with (JobTooLargeError, JobError, a constraint
        the grammar engine rejects, EngineStoppedError); then none of the jobs runs on.
        """
        outcomes = await asyncio.gather(
            *(self._coalescer.submit(self.engine, job) for job in jobs), return_exceptions=True)
        handles = [h for h in outcomes if isinstance(h, JobHandle)]
        failure = next((o for o in outcomes if isinstance(o, BaseException)), None)
        running = RunningJobs(handles)
        if failure is not None:
            running.cancel()
            raise failure
        try:
            await running.admitted()
        except BaseException:
            running.cancel()
            raise
        return running


class RunningJobs:
    """The jobs of one request, read as one stream of ``(choice index, result)``.

    Reading ends at every job's final result. `cancel` (the route calls it when the request
    ends, however it ends) cancels the jobs still running, so their pages are freed before the
    engine's next step.
    """

    def __init__(self, handles: Sequence[JobHandle]) -> None:
        self.handles = list(handles)
        self._streams = [handle.astream() for handle in self.handles]
        self._first: list[Result | None] = [None] * len(self.handles)

    async def admitted(self) -> None:
        """Wait for each job's first result; raises the job's error if the engine refused
        it."""
        for index, stream in enumerate(self._streams):
            first = await anext(stream)
            first.raise_for_error()
            self._first[index] = first

    def cancel(self) -> None:
        """Cancel every job that has not ended (a no-op for ended ones)."""
        for handle in self.handles:
            handle.cancel()

    async def results(self) -> AsyncIterator[tuple[int, Result]]:
        """Every job's results, as they come, tagged with the job's index."""
        for index, first in enumerate(self._first):
            if first is not None:
                yield index, first
        if len(self._streams) == 1:
            if self._first[0] is None or not self._first[0]["eos"]:
                async for result in self._streams[0]:
                    result.raise_for_error()
                    yield 0, result
            return
        async for tagged in self._merged():
            yield tagged

    async def collected(self) -> AsyncIterator[tuple[int, Result]]:
        """Every job's results, tagged like `results`, once every job has ended: for whole
        answers, whose handler then wakes once per job instead of once per token (raises the
        first failed job's error)."""
        for handle in self.handles:
            await handle.aresult()
        for index, handle in enumerate(self.handles):
            for result in handle.stream():  # ended: every result is there
                result.raise_for_error()
                yield index, result

    async def _merged(self) -> AsyncIterator[tuple[int, Result]]:
        open_streams = {i: s for i, s in enumerate(self._streams)
                        if self._first[i] is None or not self._first[i]["eos"]}  # type: ignore[index]
        waiting: dict[asyncio.Future[Any], int] = {
            asyncio.ensure_future(anext(s)): i for i, s in open_streams.items()}
        try:
            while waiting:
                done, _ = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
                for future in done:
                    index = waiting.pop(future)
                    result = future.result()
                    result.raise_for_error()
                    yield index, result
                    if not result["eos"]:
                        waiting[asyncio.ensure_future(anext(open_streams[index]))] = index
        finally:
            for future in waiting:
                future.cancel()


