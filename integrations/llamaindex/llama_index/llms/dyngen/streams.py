"""Reading a `JobHandle` as text: the whole completion, or its chunks, from sync or async code.

A consumer that stops early (a ``break`` out of a stream, a cancelled task) cancels its job,
so its pages go back to the cache at once instead of generating unread tokens. An engine-side
failure surfaces as the original exception.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from typing import Any

from dyngen_core import JobHandle, Result

# Final-result keys copied into a LlamaIndex response's ``raw``: what an app may log or meter.
METRIC_KEYS = (
    "eos_reason", "new_tokens", "prompt_tokens", "cached_tokens", "cached_pages",
    "time_enqueued", "time_prefill", "time_generate",
    "accepted_draft_tokens", "rejected_draft_tokens",
)


def metrics(final: Result) -> dict[str, Any]:
    """The final result's metrics as plain values (``eos_reason`` as its string)."""
    return {k: (str(final[k]) if k == "eos_reason" else final[k]) for k in METRIC_KEYS
            if k in final}


def raise_if_failed(result: Result) -> None:
    """Re-raise the engine's exception for a job that ended in error."""
    if result["eos"] and str(result.get("eos_reason")) == "error":
        error = result.get("error")
        if isinstance(error, BaseException):
            raise error
        raise RuntimeError(f"dyngen job failed: {error!r}")


def wait_final(handle: JobHandle) -> Result:
    """Block until the job ends; return its final result."""
    try:
        final = handle.result()
    except BaseException:
        handle.cancel()
        raise
    raise_if_failed(final)
    return final


async def await_final(handle: JobHandle) -> Result:
    """Await the job's end without blocking the event loop; return its final result."""
    try:
        final = await handle.aresult()
    except BaseException:  # includes asyncio.CancelledError: free the job's pages
        handle.cancel()
        raise
    raise_if_failed(final)
    return final


def iter_chunks(handle: JobHandle) -> Iterator[tuple[str, Result]]:
    """Yield ``(new_text, result)`` per streamed result; the last one carries the final result.

    Closing the iterator early cancels the job.
    """
    try:
        for result in handle:
            raise_if_failed(result)
            text = result.get("text", "") or ""
            if text or result["eos"]:
                yield text, result
    finally:
        handle.cancel()  # no-op once the job has ended


async def aiter_chunks(handle: JobHandle) -> AsyncIterator[tuple[str, Result]]:
    """Async form of `iter_chunks`: awaits results, never blocks the event loop."""
    try:
        async for result in handle:
            raise_if_failed(result)
            text = result.get("text", "") or ""
            if text or result["eos"]:
                yield text, result
    finally:
        handle.cancel()
