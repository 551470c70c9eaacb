"""Reading a job's results from LangChain code: sync or async, with cancellation and timeout.

Whatever ends the reading early — the caller breaking out of a stream, an exception, a
cancelled asyncio task, the timeout — cancels the job, so its pages go back to the cache at
once instead of after max_tokens more tokens. A timeout raises as soon as it passes, whatever
the engine is doing. Also the LangChain views of a final result: usage metadata, finish reason,
response metadata.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from typing import TYPE_CHECKING, Any

from langchain_core.messages.ai import UsageMetadata

from dyngen_core import Result

if TYPE_CHECKING:
    from dyngen_core import JobHandle

# eos_reason -> OpenAI-style finish_reason (what LangChain users and tools look for).
_FINISH_REASONS = {
    "stop_token": "stop",
    "stop_string": "stop",
    "max_new_tokens": "length",
    "constraint_incomplete": "length",
    "cancelled": "cancelled",
}


def iterate_results(handle: JobHandle, timeout: float | None = None) -> Iterator[Result]:
    """The job's results as they come. ``timeout`` (seconds, from this call) bounds the whole
    job; the job is cancelled when it passes or when the caller stops reading early."""
    stream = handle.stream(timeout)

    def results() -> Iterator[Result]:
        try:
            for result in stream:
                result.raise_for_error()
                yield result
        except TimeoutError as exc:
            raise _timed_out(timeout) from exc
        finally:
            handle.cancel()

    return results()


def aiterate_results(handle: JobHandle, timeout: float | None = None) -> AsyncIterator[Result]:
    """`iterate_results` for an event loop (call it from a coroutine): waits without blocking
    the loop."""
    stream = handle.astream(timeout)

    async def results() -> AsyncIterator[Result]:
        try:
            async for result in stream:
                result.raise_for_error()
                yield result
        except TimeoutError as exc:
            raise _timed_out(timeout) from exc
        finally:
            handle.cancel()

    return results()


def _timed_out(timeout: float | None) -> TimeoutError:
    return TimeoutError(f"generation did not finish within timeout={timeout} s; the job was "
                        "cancelled (raise `timeout` or lower `max_tokens`)")


def usage_metadata(result: Result) -> UsageMetadata:
    """Token counts of a final result; ``input_token_details.cache_read`` counts the prompt
    tokens served from the prefix cache (shared or cached pages) instead of prefilled."""
    prompt, new = int(result["prompt_tokens"]), int(result["new_tokens"])
    return UsageMetadata(
        input_tokens=prompt,
        output_tokens=new,
        total_tokens=prompt + new,
        input_token_details={"cache_read": int(result["cached_tokens"])},
    )


def finish_reason(result: Result, called_tools: bool = False) -> str:
    """``"tool_calls"`` when the output was tool calls, else "stop", "length" or "cancelled"."""
    if called_tools:
        return "tool_calls"
    reason = str(result["eos_reason"])
    return _FINISH_REASONS.get(reason, reason)


def response_metadata(
    result: Result, model_name: str, called_tools: bool = False
) -> dict[str, Any]:
    """``finish_reason``, ``model_name`` and dyngen's own ``eos_reason`` for a final result."""
    return {
        "finish_reason": finish_reason(result, called_tools),
        "model_name": model_name,
        "model_provider": "dyngen",
        "eos_reason": str(result["eos_reason"]),
    }
