"""The FastAPI application: `create_app` wires the endpoints, the API-key check, the error
responses and the request counting over one engine.

Endpoints: ``POST /v1/chat/completions``, ``POST /v1/completions`` (see `routes`),
``GET /v1/models`` and ``/v1/models/{id}``, ``GET /health`` (200 while the engine runs, else
503) and ``GET /metrics`` (Prometheus). With an API key, the ``/v1`` endpoints answer 401
unless the request carries ``Authorization: Bearer <key>`` (compared in constant time);
``/health`` and ``/metrics`` stay open for probes and scrapers.

Every error is OpenAI-shaped (``{"error": {"message", "type", "param", "code"}}``): a request
that fails validation is a 400 naming the field in ``param``.
"""

from __future__ import annotations

import hmac
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

import dyngen_core
from dyngen_core import BackgroundGenerator
from dyngen_core.errors import DynGenError, EngineStoppedError, JobTooLargeError
from dyngen_core.serve.engine import EngineBridge
from dyngen_core.serve.errors import RequestError, error_body, field_path
from dyngen_core.serve.metrics import CONTENT_TYPE, ServerMetrics
from dyngen_core.serve.options import ServeOptions
from dyngen_core.serve.routes import GenerationRoutes

logger = logging.getLogger(__name__)
_ENDPOINTS = frozenset({"/v1/chat/completions", "/v1/completions", "/health", "/metrics"})


def create_app(engine: BackgroundGenerator, options: ServeOptions) -> FastAPI:
    """The server's application over ``engine`` (usually `shared_generator`'s for
    ``options.model_dir`` and ``options.engine_options``)."""
    app = FastAPI(title="dyngen", version=dyngen_core.__version__,
                  description="OpenAI-compatible API over dyngen's dynamic-batching engine")
    metrics = ServerMetrics()
    app.state.server_metrics = metrics  # engine replicas report it to their ingress
    routes = GenerationRoutes(EngineBridge(engine), options, metrics)
    guarded = [Depends(_key_check(options.api_key))] if options.api_key else []
    app.add_api_route("/v1/chat/completions", routes.chat, methods=["POST"],
                      dependencies=guarded)
    app.add_api_route("/v1/completions", routes.completions, methods=["POST"],
                      dependencies=guarded)
    app.add_api_route("/v1/models", lambda: _models(engine, options), methods=["GET"],
                      dependencies=guarded)
    app.add_api_route("/v1/models/{model_id:path}",
                      lambda model_id: _model(engine, options, model_id), methods=["GET"],
                      dependencies=guarded)
    app.add_api_route("/health", lambda: _health(engine), methods=["GET"])
    app.add_api_route("/metrics", lambda: PlainTextResponse(
        metrics.render(engine.stats(), options.model_name), media_type=CONTENT_TYPE),
        methods=["GET"])
    _add_error_handlers(app)
    app.add_middleware(_CountRequests, metrics=metrics)
    return app


def _key_check(api_key: str | None) -> Callable[[Request], Awaitable[None]]:
    expected = (api_key or "").encode()

    async def check(request: Request) -> None:
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        given = token.strip().encode() if scheme.lower() == "bearer" else b""
        if not hmac.compare_digest(given, expected):
            raise RequestError("missing or wrong API key; send 'Authorization: Bearer <key>' "
                               "with the key the server was started with", status=401,
                               code="invalid_api_key")

    return check


def _model_card(engine: BackgroundGenerator, options: ServeOptions) -> dict[str, Any]:
    return {"id": options.model_name, "object": "model", "created": 0, "owned_by": "dyngen",
            "max_model_len": engine.max_job_tokens}


def _models(engine: BackgroundGenerator, options: ServeOptions) -> dict[str, Any]:
    return {"object": "list", "data": [_model_card(engine, options)]}


def _model(engine: BackgroundGenerator, options: ServeOptions, model_id: str
           ) -> dict[str, Any]:
    if model_id != options.model_name:
        raise RequestError(f"the model {model_id!r} does not exist here; this server serves "
                           f"{options.model_name!r}", "model", status=404,
                           code="model_not_found")
    return _model_card(engine, options)


def _health(engine: BackgroundGenerator) -> JSONResponse:
    if engine.running:
        return JSONResponse({"status": "ok"})
    return JSONResponse({"status": "engine stopped"}, status_code=503)


# ---- errors ----------------------------------------------------------------------------------


def _add_error_handlers(app: FastAPI) -> None:
    for kind in (RequestError, RequestValidationError, HTTPException, DynGenError, Exception):
        app.add_exception_handler(kind, _error_response)


async def _error_response(_: Request, exc: Exception) -> JSONResponse:
    """The OpenAI-shaped answer to whatever a request raised."""
    if isinstance(exc, RequestError):
        return JSONResponse(exc.body(), status_code=exc.status)
    if isinstance(exc, RequestValidationError):
        return _validation_error(exc)
    if isinstance(exc, HTTPException):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return JSONResponse(error_body(str(exc.detail), kind), status_code=exc.status_code)
    if isinstance(exc, EngineStoppedError):
        return JSONResponse(error_body(str(exc), "server_error", code="engine_stopped"),
                            status_code=503)
    if isinstance(exc, DynGenError):
        param = "max_tokens" if isinstance(exc, JobTooLargeError) else None
        return JSONResponse(error_body(str(exc), "invalid_request_error", param),
                            status_code=400)
    logger.exception("request failed", exc_info=exc)
    return JSONResponse(error_body(f"internal error: {exc!r}", "server_error"), status_code=500)


def _validation_error(exc: RequestValidationError) -> JSONResponse:
    """A 400 naming the first field that failed validation."""
    errors = exc.errors()
    first = errors[0] if errors else {"loc": (), "msg": "invalid request"}
    param = field_path(first.get("loc", ()))
    if first.get("type") == "json_invalid":
        param, message = None, f"the body is not valid JSON: {first.get('msg')}"
    else:
        message = f"{param or 'the body'}: {first.get('msg')}"
        if len(errors) > 1:
            message += f" (and {len(errors) - 1} more problem(s))"
    return JSONResponse(error_body(message, "invalid_request_error", param), status_code=400)


# ---- counting --------------------------------------------------------------------------------


class _CountRequests:
    """ASGI middleware: counts requests by endpoint and status, and those in flight (plain
    ASGI, so streams pass through untouched)."""

    def __init__(self, app: ASGIApp, metrics: ServerMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500

        async def send_and_note(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)

        self.metrics.in_flight += 1
        try:
            await self.app(scope, receive, send_and_note)
        finally:
            self.metrics.in_flight -= 1
            self.metrics.requests[(_endpoint(str(scope.get("path", ""))), status)] += 1


def _endpoint(path: str) -> str:
    """The endpoint a path is counted under (a bounded set, whatever clients send)."""
    if path.startswith("/v1/models"):
        return "/v1/models"
    return path if path in _ENDPOINTS else "other"
