"""A job's handle as LlamaIndex responses: streamed `CompletionResponse`s and `ChatResponse`s
(``text`` so far, ``delta`` new), the last one carrying the job's metrics in ``raw``."""

from __future__ import annotations

from llama_index.core.base.llms.types import (
    ChatResponseAsyncGen,
    ChatResponseGen,
    CompletionResponse,
    CompletionResponseAsyncGen,
    CompletionResponseGen,
)
from llama_index.llms.dyngen.chat import ChatTurn
from llama_index.llms.dyngen.streams import aiter_chunks, iter_chunks, metrics

from dyngen_core import JobHandle


def completion_stream(handle: JobHandle, timeout: float | None = None) -> CompletionResponseGen:
    """Completion chunks; closing the generator early, or ``timeout`` seconds passing (counted
    from the first read; TimeoutError), cancels the job."""
    text = ""
    for delta, result in iter_chunks(handle, timeout):
        text += delta
        yield CompletionResponse(text=text, delta=delta,
                                 raw=metrics(result) if result["eos"] else None)


async def acompletion_stream(handle: JobHandle, timeout: float | None = None
                             ) -> CompletionResponseAsyncGen:
    """Async `completion_stream`."""
    text = ""
    async for delta, result in aiter_chunks(handle, timeout):
        text += delta
        yield CompletionResponse(text=text, delta=delta,
                                 raw=metrics(result) if result["eos"] else None)


def chat_stream(turn: ChatTurn, handle: JobHandle, timeout: float | None = None
                ) -> ChatResponseGen:
    """Chat chunks (with the tool calls read so far); closing early or the timeout cancels
    the job."""
    text = ""
    for delta, result in iter_chunks(handle, timeout):
        text += delta
        yield turn.response(text, delta=delta, final=result["eos"],
                            raw=metrics(result) if result["eos"] else None)


async def achat_stream(turn: ChatTurn, handle: JobHandle, timeout: float | None = None
                      ) -> ChatResponseAsyncGen:
    """Async `chat_stream`."""
    text = ""
    async for delta, result in aiter_chunks(handle, timeout):
        text += delta
        yield turn.response(text, delta=delta, final=result["eos"],
                            raw=metrics(result) if result["eos"] else None)
