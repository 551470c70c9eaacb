"""`forwarding.answer`: a forwarded request answered by an ASGI application in-process, as an
engine replica answers the ingress (no Ray, no model)."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from dyngen_core.serve.replicas.forwarding import ForwardedRequest, ResponseStart, answer


def _app(events: list[str]) -> Starlette:
    async def echo(request: Request) -> JSONResponse:
        body = await request.json()
        return JSONResponse({"got": body, "query": request.url.query,
                             "auth": request.headers.get("authorization")}, status_code=201)

    async def stream(request: Request) -> StreamingResponse:
        async def chunks() -> AsyncIterator[str]:
            try:
                for i in range(1000):
                    yield f"data: {i}\n\n"
                    await asyncio.sleep(0.01)
                events.append("finished")
            except asyncio.CancelledError:
                events.append("cancelled")
                raise

        return StreamingResponse(chunks(), media_type="text/event-stream")

    return Starlette(routes=[Route("/echo", echo, methods=["POST"]),
                             Route("/stream", stream, methods=["GET"])])


async def _collect(parts: AsyncIterator[ResponseStart | bytes], limit: int | None = None
                   ) -> list[Any]:
    got: list[Any] = []
    async for part in parts:
        got.append(part)
        if limit is not None and len(got) >= limit:
            break
    return got


def test_a_request_is_answered_whole_with_the_replica_header() -> None:
    request = ForwardedRequest("POST", "/echo", b"x=1",
                               ((b"authorization", b"Bearer k"),
                                (b"content-type", b"application/json")), b'{"a": [1, 2]}')
    parts = asyncio.run(_collect(answer(_app([]), request, (("x-dyngen-replica", "r1"),))))
    start, body = parts[0], b"".join(parts[1:])
    assert isinstance(start, ResponseStart) and start.status == 201
    headers = dict(start.headers)
    assert headers["x-dyngen-replica"] == "r1" and "content-length" not in headers
    assert json.loads(body) == {"got": {"a": [1, 2]}, "query": "x=1", "auth": "Bearer k"}


def test_leaving_a_stream_early_cancels_the_application() -> None:
    events: list[str] = []

    async def read_three() -> list[Any]:
        parts = answer(_app(events), ForwardedRequest("GET", "/stream", b"", (), b""))
        got = await _collect(parts, limit=3)
        await parts.aclose()  # type: ignore[attr-defined]
        await asyncio.sleep(0.1)
        return got

    got = asyncio.run(read_three())
    assert isinstance(got[0], ResponseStart) and got[1:] == [b"data: 0\n\n", b"data: 1\n\n"]
    assert events == ["cancelled"]


def test_an_unknown_path_gets_the_applications_404() -> None:
    parts = asyncio.run(_collect(answer(_app([]), ForwardedRequest("GET", "/nope", b"", (),
                                                                   b""))))
    assert isinstance(parts[0], ResponseStart) and parts[0].status == 404


def test_a_reader_that_leaves_lets_the_application_answer_its_disconnect() -> None:
    """The application sees the disconnect and ends its own way (as a generation route
    answers and counts 499), instead of being cancelled at once (counted as a 500)."""
    events: list[str] = []

    async def waits(request: Request) -> Response:
        try:
            while (await request.receive())["type"] != "http.disconnect":
                pass
            events.append("answered 499")
            return Response(status_code=499)
        except asyncio.CancelledError:
            events.append("cancelled")
            raise

    app = Starlette(routes=[Route("/wait", waits, methods=["POST"])])

    async def leave_early() -> None:
        parts = answer(app, ForwardedRequest("POST", "/wait", b"", (), b"{}"))
        reader = asyncio.ensure_future(_collect(parts))
        await asyncio.sleep(0.05)
        reader.cancel()  # the ingress's call was cancelled: its client left
        with contextlib.suppress(asyncio.CancelledError):
            await reader

    asyncio.run(leave_early())
    assert events == ["answered 499"]
