"""Batches that reach the engine whole.

LangChain's default ``batch`` runs ``invoke`` on a thread pool of a few workers, and its
``abatch`` starts one coroutine per input; either way the jobs trickle into the engine one by
one, and with short replies the first ones finish before the last ones arrive. Here every
input of a batch runs as usual (its own config, callbacks and run), but its job is held at a
`SubmissionGate` until every input has either prepared its job or failed before doing so; then
all jobs go to the engine in one `submit_many`, so they enter the same scheduling step.
"""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from dyngen_core import BackgroundGenerator, Job, JobHandle

T = TypeVar("T")


class SubmissionGate:
    """Collects the jobs of ``expected`` batch inputs and submits them together."""

    def __init__(self, expected: int) -> None:
        self.expected = expected
        self.settled = 0  # inputs that registered a job, or ended without one
        self.waiting: list[tuple[BackgroundGenerator, Job, asyncio.Future[JobHandle]]] = []

    def register(self, engine: BackgroundGenerator, job: Job) -> asyncio.Future[JobHandle]:
        future: asyncio.Future[JobHandle] = asyncio.get_running_loop().create_future()
        self.waiting.append((engine, job, future))
        self._settle()
        return future

    def withdraw(self) -> None:
        """An input ended without registering a job (an error, a LangChain cache hit)."""
        self._settle()

    def _settle(self) -> None:
        self.settled += 1
        if self.settled < self.expected:
            return
        waiting, self.waiting = self.waiting, []
        engines = {id(engine): engine for engine, _, _ in waiting}
        for key, engine in engines.items():
            group = [(job, future) for e, job, future in waiting if id(e) == key]
            _submit_group(engine, group)


def _submit_group(
    engine: BackgroundGenerator, group: list[tuple[Job, asyncio.Future[JobHandle]]]
) -> None:
    try:
        handles = engine.submit_many([job for job, _ in group])
    except Exception:  # noqa: BLE001 - one bad job: submit one by one to blame only it
        for job, future in group:
            try:
                _deliver(future, engine.submit(job))
            except Exception as exc:  # noqa: BLE001 - reported to that input's caller
                if not future.cancelled():
                    future.set_exception(exc)
        return
    for (_, future), handle in zip(group, handles, strict=True):
        _deliver(future, handle)


def _deliver(future: asyncio.Future[JobHandle], handle: JobHandle) -> None:
    """Hand ``handle`` to its input, or cancel the job when that input is gone."""
    if future.cancelled():
        handle.cancel()
    else:
        future.set_result(handle)


class _Slot:
    """One batch input's place at the gate (at most one job)."""

    def __init__(self, gate: SubmissionGate) -> None:
        self.gate = gate
        self.used = False

    def close(self) -> None:
        if not self.used:
            self.used = True
            self.gate.withdraw()


_SLOT: contextvars.ContextVar[_Slot | None] = contextvars.ContextVar("dyngen_slot", default=None)


async def submit(engine: BackgroundGenerator, job: Job) -> JobHandle:
    """Submit ``job``: held at the batch's gate when called from inside `gated_batch`,
    at once otherwise."""
    slot = _SLOT.get()
    if slot is None or slot.used:
        return engine.submit(job)
    slot.used = True
    future = slot.gate.register(engine, job)
    try:
        return await future
    except asyncio.CancelledError:
        # Cancelled after the gate delivered the handle, before this task resumed.
        if future.done() and not future.cancelled() and future.exception() is None:
            future.result().cancel()
        raise


async def gated_batch(
    run: Callable[[Any, Any], Awaitable[T]],
    inputs: Sequence[Any],
    configs: Sequence[Any],
    return_exceptions: bool,
) -> list[T | BaseException]:
    """``run(input, config)`` for every input concurrently, their jobs submitted together."""
    gate = SubmissionGate(len(inputs))

    async def one(item: Any, config: Any) -> T | BaseException:
        slot = _Slot(gate)
        _SLOT.set(slot)  # this task's context only
        try:
            return await run(item, config)
        except Exception as exc:
            if return_exceptions:
                return exc
            raise
        finally:
            slot.close()

    tasks = [asyncio.ensure_future(one(i, c)) for i, c in zip(inputs, configs, strict=True)]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        # On an error, stop the other inputs and let them finish cancelling their jobs before
        # this returns (and a private event loop closes).
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def run_coroutine_blocking(make: Callable[[], Coroutine[Any, Any, T]]) -> T:
    """Run the coroutine ``make()`` builds on a fresh event loop in a helper thread (so it also
    works when the calling thread runs a loop), with the caller's context variables."""
    context = contextvars.copy_context()
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="dyngen-batch") as pool:
        return pool.submit(context.run, lambda: asyncio.run(make())).result()
