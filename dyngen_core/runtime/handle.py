"""`JobHandle`: one submitted job's results, readable from a thread or an event loop.

The engine thread pushes results; a consumer iterates them synchronously (``for r in handle``)
or asynchronously (``async for r in handle``), or waits for the final one (``result()`` /
``await aresult()``). Async consumers are woken with ``call_soon_threadsafe``, so awaiting many
handles needs no thread per job.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Iterator
from functools import partial
from typing import TYPE_CHECKING

from dyngen_core.engine.job import Job
from dyngen_core.engine.results import EosReason, Result

if TYPE_CHECKING:
    from dyngen_core.runtime.background import BackgroundGenerator


class JobHandle:
    """Results of one job submitted to a `BackgroundGenerator`.

    A handle is consumed once: iterate it (sync or async) or ask for `result()`. Breaking out of
    an iteration does not cancel the job; call `cancel()` (adapters do).
    """

    def __init__(self, job: Job, owner: BackgroundGenerator) -> None:
        self.job = job
        self._owner = owner
        self._cond = threading.Condition()
        self._results: list[Result] = []
        self._final: Result | None = None
        self._error: BaseException | None = None
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = []
        self.cancel_requested = False

    # ---- producer side (engine thread) -------------------------------------------------------

    def _push(self, result: Result) -> None:
        with self._cond:
            self._results.append(result)
            if result["eos"]:
                self._final = result
            self._wake()

    def _fail(self, error: BaseException) -> None:
        with self._cond:
            self._error = error
            self._wake()

    def _cancelled_before_start(self) -> None:
        self._push(Result(job=self.job, identifier=self.job.identifier, stage="streaming",
                          eos=True, eos_reason=EosReason.CANCELLED, full_completion="",
                          new_tokens=0, prompt_tokens=len(self.job.input_ids), cached_tokens=0,
                          cached_pages=0, time_enqueued=0.0, time_prefill=0.0,
                          time_generate=0.0, accepted_draft_tokens=0,
                          rejected_draft_tokens=0))

    def _wake(self) -> None:
        self._cond.notify_all()
        for loop, event in self._waiters:
            # A consumer's loop may be closed by now (its task was cancelled): skip it.
            if not loop.is_closed():
                try:
                    loop.call_soon_threadsafe(event.set)
                except RuntimeError:
                    pass
        self._waiters.clear()

    # ---- consumer side -----------------------------------------------------------------------

    @property
    def done(self) -> bool:
        return self._final is not None or self._error is not None

    def cancel(self) -> None:
        """Cancel the job; its pages are freed before the engine's next step."""
        if self.done:
            return
        self.cancel_requested = True
        self._owner.cancel(self.job)

    def __iter__(self) -> Iterator[Result]:
        index = 0
        while True:
            with self._cond:
                self._cond.wait_for(partial(self._ready, index))
                batch = self._new_results(index)
            index += len(batch)
            yield from _until_eos(batch)
            if batch[-1]["eos"]:
                return

    async def __aiter__(self) -> AsyncIterator[Result]:
        index = 0
        loop = asyncio.get_running_loop()
        while True:
            with self._cond:
                waiter = None if self._ready(index) else (loop, asyncio.Event())
                if waiter is None:
                    batch = self._new_results(index)
                else:
                    self._waiters.append(waiter)
            if waiter is not None:
                try:
                    await waiter[1].wait()
                finally:
                    with self._cond:
                        if waiter in self._waiters:
                            self._waiters.remove(waiter)
                continue
            index += len(batch)
            for result in _until_eos(batch):
                yield result
            if batch[-1]["eos"]:
                return

    def _ready(self, index: int) -> bool:
        return index < len(self._results) or self._error is not None

    def _new_results(self, index: int) -> list[Result]:
        """Results from ``index`` on (call under the lock, once ready); raises the job's error
        when nothing new came before it."""
        if index >= len(self._results):
            assert self._error is not None
            raise self._error
        return self._results[index:]

    def result(self, timeout: float | None = None) -> Result:
        """Block until the job ends; return its final result (text in ``full_completion``)."""
        with self._cond:
            if not self._cond.wait_for(lambda: self.done, timeout=timeout):
                raise TimeoutError(f"{self.job!r} did not finish within {timeout} s")
            if self._error is not None:
                raise self._error
            assert self._final is not None
            return self._final

    async def aresult(self) -> Result:
        """Await the job's final result without blocking the event loop."""
        final: Result | None = None
        async for result in self:
            final = result
        assert final is not None
        return final

    def text(self) -> str:
        """Block until the job ends; return its completion text."""
        return str(self.result()["full_completion"])

    def __repr__(self) -> str:
        return f"JobHandle({self.job!r}, done={self.done})"


def _until_eos(batch: list[Result]) -> Iterator[Result]:
    for result in batch:
        yield result
        if result["eos"]:
            return
