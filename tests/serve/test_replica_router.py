"""`PageHashRouter` and `RoundRobinRouter` on their own: the ranks they give Ray Serve for
requests, with stand-in replicas (no Ray cluster). Ray's request metadata types are built
directly, as Serve's router would. Needs the replicas extra (`make test` installs it); without
Ray these tests fail on the import, naming it."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
from ray.serve._private.common import (
    DeploymentHandleSource,
    DeploymentID,
    RequestMetadata,
)
from ray.serve.request_router import PendingRequest, ReplicaID

from dyngen_core import PAGE_SIZE, Tokenizer, prefix_hashes
from dyngen_core.serve.replicas.forwarding import ForwardedRequest
from dyngen_core.serve.replicas.prompts import routing_prompt
from dyngen_core.serve.replicas.router import PageHashRouter, RoundRobinRouter

pytestmark = pytest.mark.demo
DEPLOYMENT = DeploymentID(name="dyngen-engine", app_name="test")
DOCUMENT = " ".join(f"Line {i} of the manual says to turn valve {i % 7}." for i in range(80))


class StandInReplica:
    """What a router reads of a replica: its id, queue bound and queue length."""

    def __init__(self, name: str, queue: int = 0) -> None:
        self.replica_id = ReplicaID(unique_id=name, deployment_id=DEPLOYMENT)
        self.max_ongoing_requests = 64
        self.queue = queue

    async def get_queue_len(self, *, deadline_s: float) -> int:
        return self.queue


def _chat(question: str, document: str = DOCUMENT) -> ForwardedRequest:
    body = {"model": "demo", "messages": [
        {"role": "user", "content": f"{document}\n\nQuestion: {question}"}]}
    return ForwardedRequest("POST", "/v1/chat/completions", b"",
                            ((b"content-type", b"application/json"),),
                            json.dumps(body).encode())


_ids = iter(range(1_000_000))


def _pending(request: ForwardedRequest) -> PendingRequest:
    """A pending request as Serve's router makes one (call it with an event loop running)."""
    number = str(next(_ids))
    return PendingRequest(args=[request], kwargs={},
                          metadata=RequestMetadata(request_id=number, internal_request_id=number))


def _router(demo_model_dir: Path, threshold: int = 2) -> PageHashRouter:
    router = PageHashRouter(deployment_id=DEPLOYMENT,
                            handle_source=DeploymentHandleSource.UNKNOWN)
    router.initialize_state(model_dir=str(demo_model_dir), page_size=PAGE_SIZE,
                            pages_per_replica=64, imbalance_threshold=threshold)
    return router


def _first(router: Any, replicas: list[StandInReplica], request: ForwardedRequest,
           pending: PendingRequest | None = None) -> str:
    """The replica ``router`` ranks first for ``request`` (or for ``pending``)."""

    async def choose() -> Any:
        return await router.choose_replicas(replicas, pending or _pending(request))

    ranks = asyncio.run(choose())
    assert all(len(rank) == 1 for rank in ranks) and len(ranks) == len(replicas)
    return str(ranks[0][0].replica_id.unique_id)


def _first_now(ranks: Any) -> str:
    return str(ranks[0][0].replica_id.unique_id)


def test_the_router_hashes_the_prompt_the_server_runs(demo_model_dir: Path) -> None:
    tokenizer = Tokenizer.from_model_dir(demo_model_dir)
    request = _chat("Which valve?")
    prompt = routing_prompt(tokenizer, request)
    messages = [{"role": "user", "content": f"{DOCUMENT}\n\nQuestion: Which valve?"}]
    assert prompt == tokenizer.encode(tokenizer.apply_chat_template(messages),
                                      encode_special_tokens=True)
    assert len(prefix_hashes(prompt, PAGE_SIZE)) >= 2
    assert routing_prompt(tokenizer, ForwardedRequest("GET", "/v1/models", b"", (), b"")) is None
    assert routing_prompt(tokenizer, ForwardedRequest("POST", "/v1/chat/completions", b"", (),
                                                      b"{not json")) is None


def test_a_shared_document_follows_its_pages_until_queues_are_imbalanced(
        demo_model_dir: Path) -> None:
    router = _router(demo_model_dir, threshold=2)
    a, b = StandInReplica("a"), StandInReplica("b")
    first = _first(router, [a, b], _chat("Which valve?"))
    holder, other = (a, b) if first == "a" else (b, a)
    holder.queue = 2  # busier, but within the threshold: the pages win
    assert _first(router, [a, b], _chat("Which line?")) == first
    other_doc = _chat("Which valve?", document=DOCUMENT.replace("manual", "guide"))
    assert _first(router, [a, b], other_doc) == other.replica_id.unique_id
    holder.queue = 3  # beyond the threshold: the least-loaded replica
    assert _first(router, [a, b], _chat("Which step?")) == other.replica_id.unique_id


def test_requests_without_a_prompt_go_to_the_least_loaded_replica(
        demo_model_dir: Path) -> None:
    router = _router(demo_model_dir)
    replicas = [StandInReplica("a", queue=4), StandInReplica("b", queue=1)]
    models = ForwardedRequest("GET", "/v1/models", b"", (), b"")
    assert _first(router, replicas, models) == "b"


def test_the_replica_that_accepted_a_request_is_recorded(demo_model_dir: Path) -> None:
    router = _router(demo_model_dir)
    a, b = StandInReplica("a"), StandInReplica("b")
    request = _chat("Which valve?")

    async def route() -> tuple[PendingRequest, str]:
        routed = _pending(request)
        return routed, _first_now(await router.choose_replicas([a, b], routed))

    routed, chosen = asyncio.run(route())
    accepted = b if chosen == "a" else a
    router.prefixes.forget(a.replica_id)
    router.prefixes.forget(b.replica_id)
    router.on_request_routed(routed, accepted.replica_id, None)
    assert _first(router, [a, b], _chat("Which line?")) == \
        accepted.replica_id.unique_id


def test_round_robin_takes_each_replica_in_turn() -> None:
    router = RoundRobinRouter(deployment_id=DEPLOYMENT,
                              handle_source=DeploymentHandleSource.UNKNOWN)
    router.initialize_state()
    replicas = [StandInReplica("b"), StandInReplica("a"), StandInReplica("c")]
    request = _chat("Which valve?")
    assert [_first(router, replicas, request) for _ in range(4)] == ["a", "b", "c", "a"]


def test_a_metrics_probe_goes_to_the_replica_it_names(demo_model_dir: Path) -> None:
    from dyngen_core.serve.replicas.metrics import MetricsProbe

    rotating = RoundRobinRouter(deployment_id=DEPLOYMENT,
                                handle_source=DeploymentHandleSource.UNKNOWN)
    rotating.initialize_state()
    replicas = [StandInReplica("a", queue=0), StandInReplica("b", queue=9)]

    def ranks(router: Any, target: str) -> list[list[str]]:
        async def choose() -> Any:
            number = str(next(_ids))
            pending = PendingRequest(args=[MetricsProbe(target)], kwargs={},
                                     metadata=RequestMetadata(request_id=number,
                                                              internal_request_id=number))
            return await router.choose_replicas(replicas, pending)

        return [[r.replica_id.unique_id for r in rank] for rank in asyncio.run(choose())]

    for router in (_router(demo_model_dir), rotating):
        assert [ranks(router, target) for target in ("b", "a", "b")] == [[["b"]], [["a"]],
                                                                          [["b"]]]
        # A probe for a replica that is gone is routed as any request (another answers).
        assert len(ranks(router, "z")) == 2


def test_the_serve_command_reads_the_replica_options(monkeypatch: pytest.MonkeyPatch) -> None:
    from dyngen_core.cli.main import build_parser
    from dyngen_core.serve.replicas.options import replica_options

    monkeypatch.setenv("RAY_ADDRESS", "head:6379")
    args = build_parser().parse_args(["serve", "--model", "m", "--replicas", "3",
                                      "--imbalance-threshold", "4", "--router", "round-robin"])
    options = replica_options(args)
    assert (options.replicas, options.imbalance_threshold, options.router) == (
        3, 4, "round-robin")
    assert options.ray_address == "head:6379" and options.gpus_per_replica is None
    args = build_parser().parse_args(["serve", "--replicas", "2", "--ray-address", "auto",
                                      "--gpus-per-replica", "0.5"])
    assert replica_options(args).ray_address == "auto"
    assert replica_options(args).gpus_per_replica == 0.5
    with pytest.raises(ValueError, match="imbalance_threshold"):
        replica_options(build_parser().parse_args(["serve", "--replicas", "2",
                                                   "--imbalance-threshold", "-1"]))
