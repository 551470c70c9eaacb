"""`SubmissionCoalescer`: jobs that tasks submit together reach their engine together.

Frameworks run concurrent calls as one asyncio task each (``asyncio.gather``, a batch). Jobs
submitted one by one can straddle engine steps, and with short replies the first ones end
before the last ones arrive. A coalescer holds each job until the end of the event-loop
iteration it was submitted in (or, for a batch, until every participant is ready) and then
hands all held jobs of one engine over in one `BackgroundGenerator.submit_many`, so they are
enqueued before the same step: they batch, and a shared prompt prefix is prefilled once.
"""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from dyngen_core.engine.job import Job
from dyngen_core.runtime.handle import JobHandle

if TYPE_CHECKING:
    from dyngen_core.runtime.background import BackgroundGenerator

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
