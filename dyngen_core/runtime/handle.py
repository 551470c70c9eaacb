"""The caller's side of a `BackgroundGenerator`, from threads and event loops: `JobHandle` (one
submitted job's results) and `SubmissionCoalescer` (jobs that tasks submit together reach their
engine together). Neither imports torch or the engine, so adapters may import them at once.

`JobHandle`: the engine thread pushes results; a consumer reads them synchronously (``for r in
handle``, ``handle.stream(timeout)``) or asynchronously (``async for r in handle``,
``handle.astream(timeout)``), or waits for the final one (``result()`` / ``await aresult()``).
Async consumers are woken with ``call_soon_threadsafe``, so awaiting many handles needs no
thread per job.

`SubmissionCoalescer`: frameworks run concurrent calls as one asyncio task each
(``asyncio.gather``, a batch). Jobs submitted one by one can straddle engine steps, and with
short replies the first ones end before the last ones arrive. A coalescer holds each job until
the end of the event-loop iteration it was submitted in (or, for a batch, until every
participant is ready) and then hands all held jobs of one engine over in one
`BackgroundGenerator.submit_many`, so they are enqueued before the same step: they batch, and a
shared prompt prefix is prefilled once.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING

from dyngen_core.engine.job import Job
from dyngen_core.engine.results import EosReason, Result

if TYPE_CHECKING:
    from dyngen_core.runtime.background import BackgroundGenerator

_Waiter = tuple[asyncio.AbstractEventLoop, asyncio.Event]


class Wakeups:
    """The event-loop waiters one engine step's results wake, woken together at its end
    (`send`): one ``call_soon_threadsafe`` per event loop instead of one per job, so a step of
    256 streaming jobs costs the engine thread one wake-up write, not 256."""

    def __init__(self) -> None:
        self._events: dict[asyncio.AbstractEventLoop, list[asyncio.Event]] = {}

    def add(self, waiters: list[_Waiter]) -> None:
        for loop, event in waiters:
            self._events.setdefault(loop, []).append(event)

    def send(self) -> None:
        """Set every added event from its own loop (skipping loops closed by now: their
        tasks were cancelled)."""
        events, self._events = self._events, {}
        for loop, group in events.items():
            if not loop.is_closed():
                try:
                    loop.call_soon_threadsafe(_set_all, group)
                except RuntimeError:
                    pass


def _set_all(events: list[asyncio.Event]) -> None:
    for event in events:
        event.set()


class JobHandle:
    """Results of one job submitted to a `BackgroundGenerator` (which builds the handles).

    job: the submitted `Job`.
    cancel: asks the engine to stop the job (no argument); `cancel()` calls it once.

    Results stay in the handle, so it may be read more than once. Breaking out of a read does
    not cancel the job; call `cancel()` (the adapters do).

    Every wait takes an optional ``timeout`` in seconds, counted from the call: when it passes
    before the job ends, TimeoutError is raised and the job keeps running (cancel it to give
    up). A job the engine could not run or finish (refused at enqueue, a failed step, a
    stopped engine) raises that error from every read once its earlier results are read.
    """

    def __init__(self, job: Job, cancel: Callable[[], None]) -> None:
        self.job = job
        self._request_cancel = cancel
        self._cond = threading.Condition()
        self._results: list[Result] = []
        self._final: Result | None = None
        self._error: BaseException | None = None
        self._waiters: list[_Waiter] = []  # woken by every result
        self._end_waiters: list[_Waiter] = []  # woken when the job ends
        self.cancel_requested = False

    # ---- producer side (the engine) ----------------------------------------------------------

    def _push(self, result: Result, wakeups: Wakeups | None = None) -> None:
        """Add ``result``; the event loops waiting for it are woken now, or by ``wakeups``
        when given (the engine sends it at the end of the step)."""
        with self._cond:
            self._results.append(result)
            if result["eos"]:
                self._final = result
            self._wake(wakeups)

    def _fail(self, error: BaseException) -> None:
        """End the job with ``error`` (ignored once the job has ended)."""
        with self._cond:
            if self.done:
                return
            self._error = error
            self._wake()

    def _cancelled_before_start(self) -> None:
        self._push(Result(job=self.job, identifier=self.job.identifier, stage="streaming",
                          eos=True, eos_reason=EosReason.CANCELLED, full_completion="",
                          new_tokens=0, prompt_tokens=len(self.job.input_ids), cached_tokens=0,
                          cached_pages=0, time_enqueued=0.0, time_prefill=0.0,
                          time_generate=0.0, accepted_draft_tokens=0,
                          rejected_draft_tokens=0))

    def _wake(self, wakeups: Wakeups | None = None) -> None:
        """Wake the threads and (through ``wakeups``, or at once) the event loops waiting for
        a result; those waiting for the end only when the job has ended. Call under the lock."""
        self._cond.notify_all()
        if self.done and self._end_waiters:
            self._waiters += self._end_waiters
            self._end_waiters = []
        if not self._waiters:  # the common case: nobody waits on an event loop
            return
        sender = wakeups or Wakeups()
        sender.add(self._waiters)
        self._waiters = []
        if wakeups is None:
            sender.send()

    # ---- consumer side -----------------------------------------------------------------------

    @property
    def done(self) -> bool:
        """True once the job has ended: its final result came, or it failed."""
        return self._final is not None or self._error is not None

    def cancel(self) -> None:
        """Cancel the job; its pages are freed before the engine's next step, and its final
        result has eos_reason "cancelled". Does nothing once the job has ended."""
        if self.done or self.cancel_requested:
            return
        self.cancel_requested = True
        self._request_cancel()

    def stream(self, timeout: float | None = None) -> Iterator[Result]:
        """The job's results as they come, up to and including the final one."""
        return self._stream(_deadline(timeout), timeout)

    def astream(self, timeout: float | None = None) -> AsyncIterator[Result]:
        """`stream` for an event loop (call it from a coroutine): waits without blocking it."""
        return self._astream(_deadline(timeout), timeout)

    def __iter__(self) -> Iterator[Result]:
        return self.stream()

    def __aiter__(self) -> AsyncIterator[Result]:
        return self.astream()

    def result(self, timeout: float | None = None) -> Result:
        """Block until the job ends; return its final result (text in ``full_completion``)."""
        with self._cond:
            if not self._cond.wait_for(lambda: self.done, timeout=timeout):
                raise self._timed_out(timeout)
            return self._ended()

    async def aresult(self, timeout: float | None = None) -> Result:
        """Await the job's final result without blocking the event loop (woken once, when
        the job ends, not by every result)."""
        deadline = _deadline(timeout)
        loop = asyncio.get_running_loop()
        while True:
            with self._cond:
                if self.done:
                    return self._ended()
                waiter = (loop, asyncio.Event())
                self._end_waiters.append(waiter)
            await self._wait(waiter, self._end_waiters, deadline, timeout)

    def _ended(self) -> Result:
        """The final result of an ended job, or its error (call under the lock)."""
        if self._error is not None:
            raise self._error
        assert self._final is not None
        return self._final

    def text(self, timeout: float | None = None) -> str:
        """Block until the job ends; return its completion text."""
        return str(self.result(timeout)["full_completion"])

    def __repr__(self) -> str:
        return f"JobHandle({self.job!r}, done={self.done})"

    # ---- reading -----------------------------------------------------------------------------

    def _stream(self, deadline: float | None, timeout: float | None) -> Iterator[Result]:
        index = 0
        while True:
            with self._cond:
                if not self._cond.wait_for(partial(self._ready, index), _left(deadline)):
                    raise self._timed_out(timeout)
                batch = self._new_results(index)
            index += len(batch)
            yield from _until_eos(batch)
            if batch[-1]["eos"]:
                return

    async def _astream(self, deadline: float | None, timeout: float | None
                       ) -> AsyncIterator[Result]:
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
                await self._wait(waiter, self._waiters, deadline, timeout)
                continue
            index += len(batch)
            for result in _until_eos(batch):
                yield result
            if batch[-1]["eos"]:
                return

    async def _wait(self, waiter: _Waiter, registry: list[_Waiter], deadline: float | None,
                    timeout: float | None) -> None:
        """Wait for the engine to set ``waiter``'s event; always takes it out of
        ``registry`` (``_waiters`` or ``_end_waiters``)."""
        try:
            if deadline is None:
                await waiter[1].wait()
            else:
                await asyncio.wait_for(waiter[1].wait(), _left(deadline))
        except asyncio.TimeoutError:
            raise self._timed_out(timeout) from None
        finally:
            with self._cond:
                if waiter in registry:
                    registry.remove(waiter)

    def _ready(self, index: int) -> bool:
        return index < len(self._results) or self._error is not None

    def _new_results(self, index: int) -> list[Result]:
        """Results from ``index`` on (call under the lock, once ready); raises the job's error
        when nothing new came before it."""
        if index >= len(self._results):
            assert self._error is not None
            raise self._error
        return self._results[index:]

    def _timed_out(self, timeout: float | None) -> TimeoutError:
        return TimeoutError(f"{self.job!r} did not end within timeout={timeout} s; it is still "
                            "running (cancel() it to give up)")


def _deadline(timeout: float | None) -> float | None:
    return None if timeout is None else time.monotonic() + timeout


def _left(deadline: float | None) -> float | None:
    """Seconds until ``deadline`` (None: no deadline)."""
    return None if deadline is None else max(0.0, deadline - time.monotonic())


def _until_eos(batch: list[Result]) -> Iterator[Result]:
    for result in batch:
        yield result
        if result["eos"]:
            return


_Held = tuple["BackgroundGenerator", Job, "asyncio.Future[JobHandle]"]


@dataclass
class _LoopQueue:
    """The jobs one event loop's tasks submitted that have not gone out yet."""

    loop: asyncio.AbstractEventLoop
    held: list[_Held] = field(default_factory=list)
    flush_scheduled: bool = False


class SubmissionCoalescer:
    """Hands jobs submitted from event loops to their engines in groups.

    expected: how many participants to wait for before jobs go out; every `submit` and every
        `withdraw` counts as one. 0 (the default): the jobs submitted during one event-loop
        iteration go out at its end. n > 0 (a batch of n inputs): jobs are held until n
        participants have submitted or withdrawn, then go out at the end of that iteration;
        later ones go out per iteration again.

    Contract:
        - Each group goes out as one `submit_many` per engine, in submission order.
        - `submit` raises what the engine raises for its own job only: when a group's
          `submit_many` raises (say, one job is too large), its jobs are submitted one by one.
        - A job whose submitter was cancelled before its group went out is never submitted;
          one whose submitter was cancelled after is cancelled at once.
        - Submitting never blocks the event loop (`submit_many` never waits for a step).

    Any number of tasks on any number of event loops (threads) may share a coalescer; each
    loop's jobs go out from that loop.
    """

    def __init__(self, expected: int = 0) -> None:
        if expected < 0:
            raise ValueError(f"expected must be >= 0 participants; got {expected}")
        self._expected = expected
        self._settled = 0
        self._queues: dict[asyncio.AbstractEventLoop, _LoopQueue] = {}
        self._lock = threading.Lock()

    async def submit(self, engine: BackgroundGenerator, job: Job) -> JobHandle:
        """Hand ``job`` to ``engine`` with its group; returns the job's handle."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[JobHandle] = loop.create_future()
        with self._lock:
            queue = self._queues.get(loop)
            if queue is None:
                queue = self._queues[loop] = _LoopQueue(loop)
            queue.held.append((engine, job, future))
            self._settled += 1
            self._schedule_flushes()
        try:
            return await future
        except asyncio.CancelledError:
            # Cancelled after the group went out, before this task resumed: drop the job.
            if future.done() and not future.cancelled() and future.exception() is None:
                future.result().cancel()
            raise

    def withdraw(self) -> None:
        """Count a participant that submits nothing (it failed before its job was built, or
        its answer came from a cache), so the others need not wait for it."""
        with self._lock:
            self._settled += 1
            self._schedule_flushes()

    def _schedule_flushes(self) -> None:
        """Under the lock: once enough participants settled, send each loop's held jobs at the
        end of its current iteration."""
        if self._settled < self._expected:
            return
        for loop, queue in list(self._queues.items()):
            if not queue.held or queue.flush_scheduled:
                continue
            queue.flush_scheduled = True
            try:
                loop.call_soon_threadsafe(self._flush, queue)
            except RuntimeError:  # that loop is closed: nobody awaits its jobs any more
                del self._queues[loop]

    def _flush(self, queue: _LoopQueue) -> None:
        with self._lock:
            held, queue.held = queue.held, []
            queue.flush_scheduled = False
            if self._queues.get(queue.loop) is queue:
                del self._queues[queue.loop]
        engines: dict[int, BackgroundGenerator] = {}
        for engine, _, _ in held:
            engines.setdefault(id(engine), engine)
        for key, engine in engines.items():
            _send(engine, [(job, future) for e, job, future in held
                           if id(e) == key and not future.cancelled()])


def _send(engine: BackgroundGenerator,
          group: list[tuple[Job, asyncio.Future[JobHandle]]]) -> None:
    """One `submit_many` for the group; when it raises, one `submit` per job."""
    if not group:
        return
    try:
        handles = engine.submit_many([job for job, _ in group])
    except Exception:  # noqa: BLE001 - one refused job must not fail the others
        _send_one_by_one(engine, group)
        return
    for (_, future), handle in zip(group, handles, strict=True):
        _deliver(future, handle)


def _send_one_by_one(engine: BackgroundGenerator,
                     group: list[tuple[Job, asyncio.Future[JobHandle]]]) -> None:
    for job, future in group:
        if future.cancelled():
            continue
        try:
            handle = engine.submit(job)
        except Exception as exc:  # noqa: BLE001 - delivered to that job's submitter
            future.set_exception(exc)
            continue
        _deliver(future, handle)


def _deliver(future: asyncio.Future[JobHandle], handle: JobHandle) -> None:
    """Hand ``handle`` to its submitter, or cancel the job when the submitter is gone."""
    if future.cancelled():
        handle.cancel()
    else:
        future.set_result(handle)
