"""Batches that reach the engine whole.

LangChain's default ``batch`` runs ``invoke`` on a thread pool of a few workers, and its
``abatch`` starts one coroutine per input; either way the jobs trickle into the engine one by
one, and with short replies the first ones finish before the last ones arrive. Here every
input of a batch runs as usual (its own config, callbacks and run), and its job goes through a
`dyngen_core.SubmissionCoalescer` that expects one participant per input: once every input has
prepared its job or ended without one, all jobs go to the engine in one ``submit_many``, so
they enter the same scheduling step.
"""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, TypeVar

from dyngen_core import SubmissionCoalescer

if TYPE_CHECKING:
    from dyngen_core import BackgroundGenerator, Job, JobHandle

T = TypeVar("T")


class _Slot:
    """One batch input's place in the batch's coalescer (at most one job goes through it)."""

    def __init__(self, coalescer: SubmissionCoalescer) -> None:
        self.coalescer = coalescer
        self.used = False

    def close(self) -> None:
        """The input ended: if it submitted nothing (an error, a LangChain cache hit), the
        others stop waiting for it."""
        if not self.used:
            self.used = True
            self.coalescer.withdraw()


_SLOT: contextvars.ContextVar[_Slot | None] = contextvars.ContextVar("dyngen_slot", default=None)


async def submit(engine: BackgroundGenerator, job: Job) -> JobHandle:
    """Submit ``job``: with the other inputs' jobs when called from inside `coalesced_batch`,
    at once otherwise."""
    slot = _SLOT.get()
    if slot is None or slot.used:
        return engine.submit(job)
    slot.used = True
    return await slot.coalescer.submit(engine, job)


async def coalesced_batch(
    run: Callable[[Any, Any], Awaitable[T]],
    inputs: Sequence[Any],
    configs: Sequence[Any],
    return_exceptions: bool,
) -> list[T | BaseException]:
    """``run(input, config)`` for every input concurrently, their jobs submitted together."""
    coalescer = SubmissionCoalescer(expected=len(inputs))

    async def one(item: Any, config: Any) -> T | BaseException:
        slot = _Slot(coalescer)
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
