"""Ray Serve request routers for engine replicas, on Serve's request-router extension point
(`ray.serve.request_router.RequestRouter`, alpha in Ray 2.60).

`PageHashRouter` sends a request to the replica holding the longest run of its prompt's page
hashes, so prompts sharing a document land where the document's pages are cached:

1. It tokenizes the prompt as the server will (`prompts.routing_prompt`: chat templates and
   tools included) and takes the chained hashes of its full pages (`engine.pages.prefix_hashes`,
   pages of the replicas' cache page size), the names the engine's page pool gives them.
2. It reads each candidate replica's queue (ongoing requests: Serve's queue-length cache,
   probing replicas missing from it). When the longest and the shortest queue differ by more
   than ``imbalance_threshold``, the request goes to the least-loaded replica instead.
3. Otherwise it ranks replicas by matched leading pages (`prefixes.RoutedPrefixes`, the
   router's record of what it sent where), then by queue, then by pages recorded; a prompt no
   replica holds goes to the least-loaded replica, ties to the one holding least.
4. It records the prompt's hashes for the chosen replica at once (so requests routed while this
   one is in flight already see it), and again for the replica that accepted it.

Replies ranks of one replica each: Serve tries them in order and skips a replica whose queue is
full (``max_ongoing_requests``), so a full favourite spills to the next best.

`RoundRobinRouter` sends requests to each replica in turn (a baseline for measurements).

Both send a metrics probe (`metrics.MetricsProbe`) to the replica it names, and publish the
replicas they route to (`metrics.publish_replicas`), so that the ingress can gather every
replica's metrics.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from dyngen_core import PAGE_SIZE, Tokenizer, prefix_hashes
from dyngen_core.serve.replicas.forwarding import ForwardedRequest
from dyngen_core.serve.replicas.metrics import probe_target, publish_replicas
from dyngen_core.serve.replicas.options import DEFAULT_IMBALANCE_THRESHOLD
from dyngen_core.serve.replicas.prefixes import RoutedPrefixes
from dyngen_core.serve.replicas.prompts import routing_prompt

# How long a queue-length probe may take before the replica counts as busy.
PROBE_DEADLINE_S = 0.5
# The most requests whose page hashes are kept between routing and completion.
_MAX_KEPT_REQUESTS = 4096


class ReplicaProbeRouter(RequestRouter):
    """What both routers share: a metrics probe goes to the replica it names, and the replicas
    routed to are published for the ingress (`metrics.publish_replicas`)."""

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        publish_replicas(self.app_name, (r.replica_id.unique_id for r in replicas))

    def pinned(self, candidate_replicas: list[RunningReplica],
               pending_request: PendingRequest | None) -> list[list[RunningReplica]] | None:
        """The one rank for a metrics probe naming a candidate replica; None otherwise (then
        the router ranks as usual: a probe for a replica gone answers from another one)."""
        target = None if pending_request is None else probe_target(pending_request.args)
        chosen = [r for r in candidate_replicas if r.replica_id.unique_id == target]
        return [chosen] if target is not None and chosen else None


class PageHashRouter(ReplicaProbeRouter):
    """Routes by the longest run of matching prompt page hashes; see the module's docstring.

    Its ``request_router_kwargs`` (`initialize_state`): model_dir, page_size,
    pages_per_replica, imbalance_threshold.
    """

    def initialize_state(self, model_dir: str = "", page_size: int = PAGE_SIZE,
                         pages_per_replica: int = 128,
                         imbalance_threshold: int = DEFAULT_IMBALANCE_THRESHOLD,
                         **_: Any) -> None:
        """model_dir: the served model's folder (its tokenizer and chat template).
        page_size: the replicas' cache page size. pages_per_replica: pages in one replica's
        cache (the bound of its record). imbalance_threshold: see `ReplicaOptions`."""
        if not model_dir:
            raise ValueError("PageHashRouter needs request_router_kwargs['model_dir'], the "
                             "served model's folder (for its tokenizer)")
        self.tokenizer = Tokenizer.from_model_dir(model_dir)
        self.page_size = page_size
        self.imbalance_threshold = imbalance_threshold
        self.prefixes = RoutedPrefixes(pages_per_replica)
        self._hashes: OrderedDict[str, list[bytes]] = OrderedDict()

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None
                              ) -> list[list[RunningReplica]]:
        """Ranks of one replica each, best first (see the module's docstring)."""
        if not candidate_replicas:
            return []
        pinned = self.pinned(candidate_replicas, pending_request)
        if pinned is not None:
            return pinned
        hashes = self._request_hashes(pending_request)
        queues = await self._queue_lens(candidate_replicas)
        busiest, idlest = max(queues.values()), min(queues.values())
        if not hashes or busiest - idlest > self.imbalance_threshold:
            ranked = sorted(candidate_replicas, key=lambda r: (
                queues[r.replica_id], self.prefixes.recorded_pages(r.replica_id)))
        else:
            ranked = sorted(candidate_replicas, key=lambda r: (
                -self.prefixes.matched_pages(r.replica_id, hashes), queues[r.replica_id],
                self.prefixes.recorded_pages(r.replica_id)))
        if hashes:
            self.prefixes.record(ranked[0].replica_id, hashes)
        return [[replica] for replica in ranked]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID,
                          result: Any) -> None:
        """Record the prompt for the replica that accepted it."""
        hashes = self._hashes.get(pending_request.metadata.internal_request_id)
        if hashes:
            self.prefixes.record(replica_id, hashes)

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        self._hashes.pop(internal_request_id, None)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        self.prefixes.keep_only(r.replica_id for r in replicas)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.prefixes.forget(replica_id)

    def _request_hashes(self, pending_request: PendingRequest | None) -> list[bytes]:
        """The page hashes of the request's prompt (computed once per request); [] when it
        has no prompt."""
        if pending_request is None:
            return []
        key = pending_request.metadata.internal_request_id
        if key not in self._hashes:
            forwarded = next((a for a in pending_request.args
                              if isinstance(a, ForwardedRequest)), None)
            prompt = None if forwarded is None else routing_prompt(self.tokenizer, forwarded)
            self._hashes[key] = prefix_hashes(prompt or [], self.page_size)
            while len(self._hashes) > _MAX_KEPT_REQUESTS:
                self._hashes.popitem(last=False)
        return self._hashes[key]

    async def _queue_lens(self, replicas: list[RunningReplica]) -> dict[ReplicaID, int]:
        """Each replica's ongoing requests: from Serve's queue-length cache, probing the
        replicas it lacks (a replica that does not answer in time counts as full)."""
        cache = self.replica_queue_len_cache
        queues = {r.replica_id: cache.get(r.replica_id) for r in replicas}
        missing = [r for r in replicas if queues[r.replica_id] is None]
        probed = await asyncio.gather(*(r.get_queue_len(deadline_s=PROBE_DEADLINE_S)
                                        for r in missing), return_exceptions=True)
        for replica, answer in zip(missing, probed):
            if isinstance(answer, int):
                self.on_new_queue_len_info(replica.replica_id, answer)
                queues[replica.replica_id] = answer
            else:
                queues[replica.replica_id] = replica.max_ongoing_requests
        return {key: int(value or 0) for key, value in queues.items()}


class RoundRobinRouter(ReplicaProbeRouter):
    """Sends requests to each replica in turn (by replica id order), whatever they hold."""

    def initialize_state(self, **_: Any) -> None:
        self._turn = 0

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None
                              ) -> list[list[RunningReplica]]:
        """This turn's replica first, then the others in order."""
        ordered = sorted(candidate_replicas, key=lambda r: r.replica_id.unique_id)
        if not ordered:
            return []
        pinned = self.pinned(ordered, pending_request)
        if pinned is not None:
            return pinned
        start = self._turn % len(ordered)
        self._turn += 1
        return [[replica] for replica in ordered[start:] + ordered[:start]]
