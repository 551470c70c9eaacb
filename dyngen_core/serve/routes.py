"""The generation endpoints, ``/v1/chat/completions`` and ``/v1/completions``, streaming over
server-sent events and not.

However a request ends — answered, failed, or its client gone — its jobs are cancelled if still
running, so their pages are freed before the engine's next step. A client that disconnects
while waiting for a whole (non-streamed) answer is noticed at once, not when the answer is
ready.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from fastapi import Request, Response
from fastapi.responses import JSONResponse, StreamingResponse

from dyngen_core import Job
from dyngen_core.errors import EngineStoppedError, JobError
from dyngen_core.serve.engine import EngineBridge, RunningJobs
from dyngen_core.serve.errors import RequestError, error_body
from dyngen_core.serve.jobs import PreparedPrompt, prepare_chat, prepare_completions
from dyngen_core.serve.metrics import ServerMetrics
from dyngen_core.serve.options import ServeOptions
from dyngen_core.serve.responses import (
    CHAT_CHUNK,
    COMPLETION_CHUNK,
    ChoiceDelta,
    ChoiceOutput,
    chat_logprobs,
    chat_message,
    completion_logprobs,
    new_id,
    now,
    stream_chunk,
    tool_call_dict,
    usage,
)
from dyngen_core.serve.schemas import ChatCompletionRequest, CompletionRequest

logger = logging.getLogger(__name__)

# The status of a request whose client left (nobody reads it; it shows in access logs).
CLIENT_CLOSED = 499


@dataclass
class _Run:
    """One request's jobs running: what was asked, and each choice's output."""

    prompts: list[PreparedPrompt]
    running: RunningJobs
    outputs: list[ChoiceOutput]
    choices_per_prompt: int
    arrived: float

    def usage(self) -> dict[str, Any]:
        return usage([len(p.prompt_ids) for p in self.prompts],
                     [o.totals for o in self.outputs], self.choices_per_prompt)


class GenerationRoutes:
    """The two generation endpoints over one engine.

    bridge: submits jobs to the shared engine.
    options: the server's options (model name, most choices per request).
    metrics: where requests are counted.
    """

    def __init__(self, bridge: EngineBridge, options: ServeOptions,
                 metrics: ServerMetrics) -> None:
        self.bridge = bridge
        self.options = options
        self.metrics = metrics

    async def chat(self, body: ChatCompletionRequest, request: Request) -> Response:
        """POST /v1/chat/completions."""
        arrived = time.perf_counter()
        self._check(body.model, body.n)
        prepared = prepare_chat(self.bridge.engine, body)
        blamed = ("response_format" if body.response_format is not None
                  else "tools" if body.tools else None)
        run = await self._start([prepared], body.n, arrived, blamed)
        if body.stream:
            return self._stream(self._chat_events(body, run))
        choices = await self._collect(run, request)
        if choices is None:
            return Response(status_code=CLIENT_CLOSED)
        return JSONResponse({
            "id": new_id("chatcmpl"), "object": "chat.completion", "created": now(),
            "model": self.options.model_name, "system_fingerprint": None,
            "choices": [{"index": i, "message": chat_message(c.content, c.tool_calls),
                         "logprobs": chat_logprobs(c.logprobs if body.logprobs else None),
                         "finish_reason": c.finish_reason} for i, c in enumerate(choices)],
            "usage": run.usage()})

    async def completions(self, body: CompletionRequest, request: Request) -> Response:
        """POST /v1/completions."""
        arrived = time.perf_counter()
        self._check(body.model, body.n)
        prepared = prepare_completions(self.bridge.engine, body)
        run = await self._start(prepared, body.n, arrived, "prompt")
        if body.stream:
            return self._stream(self._completion_events(body, run))
        choices = await self._collect(run, request)
        if choices is None:
            return Response(status_code=CLIENT_CLOSED)
        logprobs = body.logprobs is not None
        return JSONResponse({
            "id": new_id("cmpl"), "object": "text_completion", "created": now(),
            "model": self.options.model_name, "system_fingerprint": None,
            "choices": [{"index": i, "text": c.content,
                         "logprobs": completion_logprobs(c.logprobs if logprobs else None),
                         "finish_reason": c.finish_reason} for i, c in enumerate(choices)],
            "usage": run.usage()})

    # ---- starting ----------------------------------------------------------------------------

    def _check(self, model: str, n: int) -> None:
        if model != self.options.model_name:
            raise RequestError(
                f"the model {model!r} does not exist here; this server serves "
                f"{self.options.model_name!r} (see /v1/models)", "model", status=404,
                code="model_not_found")
        if n > self.options.max_n:
            raise RequestError(f"n is {n}; this server allows at most {self.options.max_n} "
                               "choices per request", "n")

    async def _start(self, prompts: list[PreparedPrompt], n: int, arrived: float,
                     blamed: str | None) -> _Run:
        jobs: list[Job] = [job for p in prompts for job in p.jobs]
        try:
            running = await self.bridge.start(jobs)
        except EngineStoppedError:
            raise
        except JobError as exc:
            raise RequestError(f"{blamed + ': ' if blamed else ''}{exc}", blamed) from exc
        tokenizer = self.bridge.engine.tokenizer
        outputs = [ChoiceOutput(tokenizer, p.parse_tools, p.top_logprobs, p.tool_names,
                                p.tool_format)
                   for p in prompts for _ in p.jobs]
        return _Run(prompts, running, outputs, n, arrived)

    # ---- whole answers -----------------------------------------------------------------------

    async def _collect(self, run: _Run, request: Request) -> list[ChoiceDelta] | None:
        """Every choice, whole (its deltas added up); None when the client left first (the
        jobs are cancelled)."""
        choices = [ChoiceDelta() for _ in run.outputs]

        async def gather() -> None:
            async for index, result in run.running.collected():
                choices[index].add(run.outputs[index].feed(result))

        collecting = asyncio.ensure_future(gather())
        watching = asyncio.ensure_future(_client_gone(request))
        try:
            await asyncio.wait({collecting, watching}, return_when=asyncio.FIRST_COMPLETED)
            if not collecting.done():
                self.metrics.disconnects += 1
                return None
            collecting.result()
            return choices
        finally:
            collecting.cancel()
            watching.cancel()
            run.running.cancel()

    # ---- streams -----------------------------------------------------------------------------

    def _stream(self, events: AsyncIterator[str]) -> StreamingResponse:
        return StreamingResponse(events, media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def _chat_events(self, body: ChatCompletionRequest, run: _Run) -> AsyncIterator[str]:
        response_id, created, model = new_id("chatcmpl"), now(), self.options.model_name
        with_usage = body.include_usage

        def chunk(choices: list[dict[str, Any]], usage_: dict[str, Any] | None = None) -> str:
            return _event(stream_chunk(CHAT_CHUNK, response_id, created, model, choices, usage_,
                                       with_usage))

        def choice(index: int, delta: ChoiceDelta) -> dict[str, Any] | None:
            return _chat_delta(index, delta, run.outputs[index].num_calls, body.logprobs)

        for index in range(len(run.outputs)):
            yield chunk([{"index": index, "delta": {"role": "assistant", "content": ""},
                          "logprobs": None, "finish_reason": None}])
        async for event in self._events(run, choice, chunk, with_usage):
            yield event

    async def _completion_events(self, body: CompletionRequest, run: _Run
                                 ) -> AsyncIterator[str]:
        response_id, created, model = new_id("cmpl"), now(), self.options.model_name
        with_usage = body.include_usage
        offsets = [0] * len(run.outputs)

        def chunk(choices: list[dict[str, Any]], usage_: dict[str, Any] | None = None) -> str:
            return _event(stream_chunk(COMPLETION_CHUNK, response_id, created, model, choices,
                                       usage_, with_usage))

        def choice(index: int, delta: ChoiceDelta) -> dict[str, Any] | None:
            if not (delta.content or delta.finish_reason or delta.logprobs):
                return None
            logprobs = completion_logprobs(delta.logprobs if body.logprobs is not None
                                           else None, offsets[index])
            offsets[index] += len(delta.content)
            return {"index": index, "text": delta.content, "logprobs": logprobs,
                    "finish_reason": delta.finish_reason}

        async for event in self._events(run, choice, chunk, with_usage):
            yield event

    async def _events(self, run: _Run,
                      choice: Callable[[int, ChoiceDelta], dict[str, Any] | None],
                      chunk: Callable[..., str], with_usage: bool) -> AsyncIterator[str]:
        """The stream's events after the opening: a chunk per delta, the usage chunk when
        asked for, then ``[DONE]``; an engine failure mid-stream ends it with an error event.
        Ending early (the client left) cancels the jobs."""
        finished = False
        first_token = True
        try:
            async for index, result in run.running.results():
                delta = choice(index, run.outputs[index].feed(result))
                if delta is None:
                    continue
                if first_token:
                    first_token = False
                    self.metrics.first_token(time.perf_counter() - run.arrived)
                yield chunk([delta])
            if with_usage:
                yield chunk([], run.usage())
            finished = True
        except Exception as exc:  # noqa: BLE001 - the stream is under way: report, then end
            logger.exception("a streamed request failed")
            yield _event(error_body(f"generation failed: {exc}", "server_error"))
            finished = True
        finally:
            run.running.cancel()
            if not finished:
                self.metrics.disconnects += 1
        yield "data: [DONE]\n\n"


def _chat_delta(index: int, delta: ChoiceDelta, calls_so_far: int,
                logprobs: bool) -> dict[str, Any] | None:
    """A chat chunk's choice for ``delta``, or None when it shows nothing."""
    if not (delta.content or delta.tool_calls or delta.finish_reason or delta.logprobs):
        return None
    message: dict[str, Any] = {}
    if delta.content:
        message["content"] = delta.content
    if delta.tool_calls:
        first = calls_so_far - len(delta.tool_calls)
        message["tool_calls"] = [tool_call_dict(call, first + k)
                                 for k, call in enumerate(delta.tool_calls)]
    return {"index": index, "delta": message,
            "logprobs": chat_logprobs(delta.logprobs) if logprobs else None,
            "finish_reason": delta.finish_reason}


def _event(data: dict[str, Any]) -> str:
    """One server-sent event carrying ``data`` as JSON."""
    return f"data: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n"


async def _client_gone(request: Request) -> None:
    """Return when the client disconnects (the request body has been read by now, so the
    next ASGI message is the disconnect)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return

