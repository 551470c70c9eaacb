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


def wait_final(handle: JobHandle, timeout: float | None = None) -> Result:
    """Block until the job ends; return its final result. The job is cancelled when the wait
    ends early: ``timeout`` seconds passed (TimeoutError), or an exception."""
    try:
        final = handle.result(timeout)
    except TimeoutError as exc:
        handle.cancel()
        raise timed_out(timeout) from exc
    except BaseException:
        handle.cancel()
        raise
    raise_if_failed(final)
    return final


async def await_final(handle: JobHandle, timeout: float | None = None) -> Result:
    """Await the job's end without blocking the event loop; return its final result (the job
    is cancelled on a timeout, an exception or a cancelled task)."""
    try:
        final = await handle.aresult(timeout)
    except TimeoutError as exc:
        handle.cancel()
        raise timed_out(timeout) from exc
    except BaseException:  # includes asyncio.CancelledError: free the job's pages
        handle.cancel()
        raise
    raise_if_failed(final)
    return final


def iter_chunks(handle: JobHandle, timeout: float | None = None
                ) -> Iterator[tuple[str, Result]]:
    """Yield ``(new_text, result)`` per streamed result; the last one carries the final result.

    ``timeout`` (seconds, from this call) bounds the whole job. Closing the iterator early or
    the timeout cancels the job.
    """
    results = handle.stream(timeout)

    def chunks() -> Iterator[tuple[str, Result]]:
        try:
            for result in results:
                raise_if_failed(result)
                text = result.get("text", "") or ""
                if text or result["eos"]:
                    yield text, result
        except TimeoutError as exc:
            raise timed_out(timeout) from exc
        finally:
            handle.cancel()  # no-op once the job has ended

    return chunks()


def aiter_chunks(handle: JobHandle, timeout: float | None = None
                 ) -> AsyncIterator[tuple[str, Result]]:
    """Async form of `iter_chunks`: awaits results, never blocks the event loop."""
    results = handle.astream(timeout)

    async def chunks() -> AsyncIterator[tuple[str, Result]]:
        try:
            async for result in results:
                raise_if_failed(result)
                text = result.get("text", "") or ""
                if text or result["eos"]:
                    yield text, result
        except TimeoutError as exc:
            raise timed_out(timeout) from exc
        finally:
            handle.cancel()

    return chunks()


def timed_out(timeout: float | None) -> TimeoutError:
    """The error for a call that did not end within ``timeout`` seconds (its job cancelled)."""
    return TimeoutError(f"generation did not finish within timeout={timeout} s; the job was "
                        "cancelled (raise `timeout` or lower `max_tokens`)")
