"""Submitting from an event loop: every job an event-loop iteration produces goes to the engine
in one `submit_many`, handed over on a worker thread.

A query engine with ``use_async=True`` starts its prompts with ``asyncio.gather``: each task
runs until it awaits its job, so all of them submit within one loop iteration. Grouping those
submissions puts the prompts in the same scheduling step (they batch, and a shared document
prefix is prefilled once), and handing the group over on a worker thread keeps the event loop
free even while the engine thread holds its queue for a step.
"""

from __future__ import annotations

import asyncio
import weakref
from typing import Any

from dyngen_core import BackgroundGenerator, Job, JobHandle


class LoopGate:
    """Collects one event loop's submissions to one engine and sends them together."""

    def __init__(self, loop: asyncio.AbstractEventLoop, engine: BackgroundGenerator) -> None:
        self._loop = loop
        self._engine = engine
        self._pending: list[tuple[Job, asyncio.Future[JobHandle]]] = []

    def submit(self, job: Job) -> asyncio.Future[JobHandle]:
        """A future for the job's handle; the job goes out at the end of this loop iteration."""
        future: asyncio.Future[JobHandle] = self._loop.create_future()
        if not self._pending:
            self._loop.call_soon(self._flush)
        self._pending.append((job, future))
        return future

    def _flush(self) -> None:
        group, self._pending = self._pending, []
        sent = self._loop.run_in_executor(None, _submit_group, self._engine,
                                          [job for job, _ in group])
        sent.add_done_callback(lambda done: _deliver(group, done))


def _submit_group(engine: BackgroundGenerator, jobs: list[Job]) -> list[JobHandle | Exception]:
    try:
        return list(engine.submit_many(jobs))
    except Exception:  # noqa: BLE001 - one refused job must not fail the others
        return [_submit_one(engine, job) for job in jobs]


def _submit_one(engine: BackgroundGenerator, job: Job) -> JobHandle | Exception:
    try:
        return engine.submit(job)
    except Exception as exc:  # noqa: BLE001 - delivered to that job's caller
        return exc


def _deliver(group: list[tuple[Job, asyncio.Future[JobHandle]]],
             done: asyncio.Future[list[JobHandle | Exception]]) -> None:
    if done.cancelled():  # the loop is shutting down: nobody waits for these jobs
        outcomes: list[Any] = [asyncio.CancelledError()] * len(group)
    elif done.exception() is not None:
        outcomes = [done.exception()] * len(group)
    else:
        outcomes = done.result()
    for (_, future), outcome in zip(group, outcomes):
        failed = isinstance(outcome, BaseException)
        if future.cancelled():
            if not failed:
                outcome.cancel()  # its caller is gone: free the pages at once
        elif failed:
            future.set_exception(outcome)
        else:
            future.set_result(outcome)


class GateRegistry:
    """One `LoopGate` per event loop for an engine (loops that end are forgotten)."""

    def __init__(self, engine: BackgroundGenerator) -> None:
        self._engine = engine
        self._gates: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, LoopGate] = (
            weakref.WeakKeyDictionary())

    async def submit(self, job: Job) -> JobHandle:
        """Submit ``job`` from the running loop without blocking it; returns its handle."""
        loop = asyncio.get_running_loop()
        gate = self._gates.get(loop)
        if gate is None:
            gate = self._gates[loop] = LoopGate(loop, self._engine)
        return await gate.submit(job)
