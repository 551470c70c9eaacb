"""An HTTP request carried from the ingress to an engine replica, and answered there by
dyngen's own server application (`dyngen_core.serve.app.create_app`) called in-process.

So a replica answers exactly as ``dyngen serve`` does (validation, OpenAI-shaped errors, the
API key, tools, response formats, streaming), with none of it written twice. The ingress sends a
`ForwardedRequest` (picklable: Ray carries it to the replica's process, and the request router
reads its prompt); `answer` runs the application on it and yields a `ResponseStart`, then the
body's chunks as the application sends them. Closing the generator early (the client left)
tells the application the client disconnected and cancels it, which cancels the request's jobs
and frees their pages.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

from starlette.types import ASGIApp, Message

# Hop-by-hop and framing headers the ingress re-creates itself.
_DROPPED_HEADERS = frozenset({b"content-length", b"transfer-encoding", b"connection"})
# How long an application whose client left may take to end by itself before it is cancelled.
DISCONNECT_GRACE_S = 2.0


@dataclass(frozen=True)
class ForwardedRequest:
    """One HTTP request, as the ingress received it.

    method: "GET", "POST", ...
    path: the URL path ("/v1/chat/completions").
    query_string: the raw query string (bytes after "?", or b"").
    headers: the request's headers as (lower-case name, value) byte pairs.
    body: the whole request body.
    """

    method: str
    path: str
    query_string: bytes
    headers: tuple[tuple[bytes, bytes], ...]
    body: bytes


@dataclass(frozen=True)
class ResponseStart:
    """The status and headers of a forwarded request's response (its first item)."""

    status: int
    headers: tuple[tuple[str, str], ...]


async def answer(app: ASGIApp, request: ForwardedRequest,
                 extra_headers: Sequence[tuple[str, str]] = ()
                 ) -> AsyncIterator[ResponseStart | bytes]:
    """Run ``app`` on ``request``: yields one `ResponseStart` (with ``extra_headers`` added),
    then the body's non-empty chunks. Raises what the application raised if it failed before
    answering."""
    sent: asyncio.Queue[Message | None] = asyncio.Queue()
    client_gone = asyncio.Event()
    body_read = False

    async def receive() -> Message:
        nonlocal body_read
        if not body_read:
            body_read = True
            return {"type": "http.request", "body": request.body, "more_body": False}
        await client_gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        await sent.put(message)

    task = asyncio.ensure_future(app(_scope(request), receive, send))
    task.add_done_callback(lambda _: sent.put_nowait(None))
    answered = False
    try:
        while (message := await sent.get()) is not None:
            if message["type"] == "http.response.start":
                yield _start(message, extra_headers)
            elif message["type"] == "http.response.body":
                if message.get("body"):
                    yield bytes(message["body"])
                if not message.get("more_body", False):
                    answered = True
                    return
        task.result()  # the application ended without finishing a response: its error
        raise RuntimeError(f"the application sent no complete response to {request.path}")
    finally:
        if not answered:  # the reader left early: the client is gone
            client_gone.set()
            await _let_finish(task)


async def _let_finish(task: asyncio.Future[Any]) -> None:
    """Give an application whose client left `DISCONNECT_GRACE_S` to see the disconnect and
    end its own way (a route then cancels its jobs and answers, and counts, 499); cancel it
    after that."""
    try:
        await asyncio.wait_for(asyncio.shield(task), DISCONNECT_GRACE_S)
    except asyncio.CancelledError:
        task.cancel()
        raise
    except Exception:  # noqa: BLE001 - timed out, or the application failed: it ends here
        task.cancel()


def _scope(request: ForwardedRequest) -> dict[str, Any]:
    return {
        "type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1", "method": request.method, "scheme": "http",
        "path": request.path, "raw_path": request.path.encode(), "root_path": "",
        "query_string": request.query_string, "headers": list(request.headers),
        "client": None, "server": None,
    }


def _start(message: Message, extra: Sequence[tuple[str, str]]) -> ResponseStart:
    headers = tuple((bytes(k).decode("latin-1"), bytes(v).decode("latin-1"))
                    for k, v in message.get("headers", ()) if bytes(k).lower()
                    not in _DROPPED_HEADERS)
    return ResponseStart(int(message["status"]), headers + tuple(extra))
