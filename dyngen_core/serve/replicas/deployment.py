"""The Ray Serve application of ``dyngen serve --replicas N``: `build_replicas_app`.

Two deployments:

- `EngineReplica` (N replicas, each with its own CPUs or GPU): one engine (`shared_generator`)
  and dyngen's own server application over it (`create_app`), answering forwarded requests
  in-process (`forwarding.answer`). Every response carries ``x-dyngen-replica`` (the replica's
  id). Its handle routes with `PageHashRouter` (or `RoundRobinRouter`).
- `ReplicaIngress` (one replica, no CPU reserved): the HTTP endpoint on Serve's proxy. It
  forwards every request, whole, through the engine deployment's handle, where the router picks
  the replica, and streams the reply back. ``/metrics`` alone is not forwarded: the ingress asks
  every replica for its metric families and shows them together, labelled by replica, with
  their sums (`metrics`).

Users can deploy the same application themselves (``serve.run(build_replicas_app(...))``), or
bind `engine_deployment` under an ingress of their own and call
``handle.options(stream=True).answer.remote(ForwardedRequest(...))``: the router reads the
prompt from the `ForwardedRequest` argument.
"""

# No ``from __future__ import annotations`` here: FastAPI reads the ingress method's
# annotations at runtime, and Serve's ingress wrapper resolves them outside this module.
import asyncio
import math
from collections.abc import AsyncIterator
from typing import Any, cast

from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse, StreamingResponse
from ray import serve
from ray.serve.config import RequestRouterConfig
from ray.serve.deployment import Application, Deployment
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator

from dyngen_core import PAGE_SIZE
from dyngen_core.serve.metrics import CONTENT_TYPE
from dyngen_core.serve.options import ServeOptions
from dyngen_core.serve.replicas.forwarding import ForwardedRequest, ResponseStart, answer
from dyngen_core.serve.replicas.metrics import (
    MetricsProbe,
    ReplicaReport,
    aggregate,
    gather_reports,
    known_replicas,
)
from dyngen_core.serve.replicas.options import ReplicaOptions
from dyngen_core.serve.replicas.router import PageHashRouter, RoundRobinRouter

# The response header naming the replica that answered.
REPLICA_HEADER = "x-dyngen-replica"
ENGINE_DEPLOYMENT = "dyngen-engine"
INGRESS_DEPLOYMENT = "dyngen-ingress"


class EngineReplica:
    """One engine and dyngen's server application over it.

    options: the server's options (model folder, engine options, model name, API key).
    page_size: the cache page size the router hashes with; the engine's must match.
    """

    def __init__(self, options: ServeOptions, page_size: int = PAGE_SIZE) -> None:
        from dyngen_core import shared_generator
        from dyngen_core.serve.app import create_app

        self.engine = shared_generator(options.model_dir, engine_options=options.engine_options)
        actual = self.engine.generator.cache.page_size
        if actual != page_size:
            raise ValueError(f"the engine's cache pages hold {actual} tokens but the router "
                             f"hashes pages of {page_size}; build the app with page_size="
                             f"{actual}")
        self.app = create_app(self.engine, options)
        self.model_name = options.model_name
        self.replica_id = serve.get_replica_context().replica_id.unique_id

    async def answer(self, request: ForwardedRequest) -> AsyncIterator[ResponseStart | bytes]:
        """The response to ``request``: a `ResponseStart`, then the body's chunks."""
        async for part in answer(self.app, request, ((REPLICA_HEADER, self.replica_id),)):
            yield part

    async def metrics(self, probe: MetricsProbe) -> AsyncIterator[ReplicaReport]:
        """This replica's metric families (its engine's stats, its server's request counts),
        as a stream of one item: the ingress asks through the streaming handle it forwards
        with, whose router is running (a second handle starts a router of its own on its first
        call, which took over 5 s on a busy machine). The router sends ``probe`` here when it
        names this replica."""
        families = self.app.state.server_metrics.families(self.engine.stats(), self.model_name)
        yield ReplicaReport(self.replica_id, tuple(families))

    def check_health(self) -> None:
        """Serve's health check: fails once the engine has stopped (Serve then replaces the
        replica)."""
        if not self.engine.running:
            raise RuntimeError("the dyngen engine of this replica has stopped")


async def _body(reply: DeploymentResponseGenerator) -> AsyncIterator[bytes]:
    """The rest of a replica's reply; leaving early (the client left) cancels it there."""
    finished = False
    try:
        async for chunk in reply:
            yield chunk
        finished = True
    finally:
        if not finished:
            reply.cancel()


# Defined before the ingress class: Serve's ingress decorator captures what its routes use
# when the class is defined.
ingress_app = FastAPI(title="dyngen replicas", docs_url=None, redoc_url=None, openapi_url=None)


@serve.ingress(ingress_app)
class ReplicaIngress:
    """The HTTP endpoint: forwards each request to an engine replica chosen by the router."""

    def __init__(self, engines: DeploymentHandle) -> None:
        self.engines = engines.options(stream=True)
        self.app_name = serve.get_replica_context().app_name

    @ingress_app.get("/metrics", include_in_schema=False)
    async def metrics(self) -> PlainTextResponse:
        """Every engine replica's metrics, labelled by replica, and their sums."""
        reports = await gather_reports(self._report, lambda: known_replicas(self.app_name))
        return PlainTextResponse(aggregate(reports), media_type=CONTENT_TYPE)

    async def _report(self, replica_id: str | None) -> ReplicaReport:
        reply = cast(DeploymentResponseGenerator,
                     self.engines.metrics.remote(MetricsProbe(replica_id)))
        reports = [report async for report in reply]
        if len(reports) != 1 or not isinstance(reports[0], ReplicaReport):
            raise RuntimeError(f"a replica answered a metrics probe with {reports!r:.200}")
        return reports[0]

    @ingress_app.api_route("/{path:path}", methods=["GET", "POST"], include_in_schema=False)
    async def forward(self, path: str, request: Request) -> StreamingResponse:
        forwarded = ForwardedRequest(
            method=request.method, path="/" + path,
            query_string=request.scope.get("query_string", b""),
            headers=tuple(request.headers.raw), body=await request.body())
        reply = cast(DeploymentResponseGenerator, self.engines.answer.remote(forwarded))
        try:
            start = await reply.__anext__()
        except asyncio.CancelledError:
            reply.cancel()
            raise
        if not isinstance(start, ResponseStart):
            reply.cancel()
            raise RuntimeError(f"the engine replica answered {type(start).__name__} before "
                               "its response's status")
        return StreamingResponse(_body(reply), status_code=start.status,
                                 headers=dict(start.headers))


def engine_deployment(serve_options: ServeOptions, replica_options: ReplicaOptions,
                      gpus_per_replica: float = 0.0, page_size: int = PAGE_SIZE
                      ) -> Deployment:
    """The engine replicas' deployment, with its request router configured."""
    router: Any = PageHashRouter if replica_options.router == "page-hash" else RoundRobinRouter
    kwargs: dict[str, Any] = {}
    if router is PageHashRouter:
        cache_tokens = serve_options.engine_options.cache_tokens
        kwargs = {"model_dir": serve_options.model_dir, "page_size": page_size,
                  "pages_per_replica": math.ceil(cache_tokens / page_size),
                  "imbalance_threshold": replica_options.imbalance_threshold}
    return serve.deployment(
        name=ENGINE_DEPLOYMENT, num_replicas=replica_options.replicas,
        max_ongoing_requests=replica_options.max_ongoing_requests,
        ray_actor_options={"num_cpus": replica_options.cpus_per_replica,
                           "num_gpus": gpus_per_replica},
        request_router_config=RequestRouterConfig(request_router_class=router,
                                                  request_router_kwargs=kwargs))(EngineReplica)


def build_replicas_app(serve_options: ServeOptions, replica_options: ReplicaOptions,
                       gpus_per_replica: float = 0.0, page_size: int = PAGE_SIZE
                       ) -> Application:
    """The application to pass to ``serve.run``: the ingress over the engine replicas."""
    engines = engine_deployment(serve_options, replica_options, gpus_per_replica, page_size)
    ingress = serve.deployment(
        name=INGRESS_DEPLOYMENT, num_replicas=1, ray_actor_options={"num_cpus": 0},
        max_ongoing_requests=max(1000, replica_options.replicas
                                 * replica_options.max_ongoing_requests))(ReplicaIngress)
    return ingress.bind(engines.bind(serve_options, page_size))
