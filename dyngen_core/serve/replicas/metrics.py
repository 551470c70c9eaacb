"""The ingress's ``/metrics``: every engine replica's Prometheus metrics, gathered on each
scrape and shown together. Imports neither Ray nor torch.

Each replica reports its metric families (`ReplicaReport`: its engine's stats and its server
application's request counts, the families a single ``dyngen serve`` shows). The ingress asks
each replica it knows of (`MetricsProbe` names the replica; the request routers send a probe
to the replica it names, `probe_target`) and renders (`aggregate`):

- every replica's families under their usual names, each sample labelled ``replica`` with the
  replica's id, so a query can pick one replica or ``sum by (model)``;
- ``dyngen_replicas``: how many replicas answered this scrape;
- ``dyngen_replicas_<metric>`` for each of those families (``dyngen_replicas_pages_free``,
  ``dyngen_replicas_prefill_tokens_reused_total``, ...): the sum over the replicas that
  answered, label by label. Every figure a replica reports is a count (pages, jobs, tokens,
  requests, seconds summed with their count), so each sums to the deployment's figure.

The replicas known are those the request router last saw (`KnownReplicas`, filled by the
routers in the ingress's process); before any request was routed the ingress asks any one
replica first, which starts the router.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import threading
from collections import defaultdict
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass

from dyngen_core.serve.metrics import PREFIX, Family, Sample, render

logger = logging.getLogger(__name__)
# The family whose samples count the replicas that answered.
REPLICAS_FAMILY = PREFIX + "replicas"
# How long the ingress waits for one replica's report.
PROBE_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class MetricsProbe:
    """The argument of a replica's metrics call: ``replica_id`` names the replica that should
    answer (None: any replica)."""

    replica_id: str | None = None


@dataclass(frozen=True)
class ReplicaReport:
    """One replica's answer to a `MetricsProbe`: its id and its metric families."""

    replica_id: str
    families: tuple[Family, ...]


def probe_target(args: Sequence[object]) -> str | None:
    """The replica a request's arguments pin it to: a `MetricsProbe`'s replica, else None."""
    probe = next((a for a in args if isinstance(a, MetricsProbe)), None)
    return None if probe is None else probe.replica_id


class KnownReplicas:
    """The engine replicas of each Serve application, as its request routers last saw them
    (routers run in the process of the handle's owner, the ingress, on their own thread)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_app: dict[str, tuple[str, ...]] = {}

    def update(self, app_name: str, replica_ids: Iterable[str]) -> None:
        with self._lock:
            self._by_app[app_name] = tuple(sorted(replica_ids))

    def of(self, app_name: str) -> tuple[str, ...]:
        """The replica ids of ``app_name`` (empty before its router saw any)."""
        with self._lock:
            return self._by_app.get(app_name, ())


KNOWN_REPLICAS = KnownReplicas()


# The routers and the ingress reach `KNOWN_REPLICAS` through these two functions, never by
# naming it: Serve pickles the ingress class and the request router's whole module by value,
# with the objects their code names, so either would hold a copy of its own. Functions of this
# module are pickled by reference and find the one registry of the process.


def publish_replicas(app_name: str, replica_ids: Iterable[str]) -> None:
    """`KNOWN_REPLICAS.update` (for the routers)."""
    KNOWN_REPLICAS.update(app_name, replica_ids)


def known_replicas(app_name: str) -> tuple[str, ...]:
    """`KNOWN_REPLICAS.of` (for the ingress)."""
    return KNOWN_REPLICAS.of(app_name)


def aggregate(reports: Sequence[ReplicaReport]) -> str:
    """The ingress's metrics text for ``reports`` (see the module's docstring)."""
    ordered = sorted(reports, key=lambda r: r.replica_id)
    merged: dict[str, Family] = {}
    for report in ordered:
        for family in report.families:
            tagged = family.labelled("replica", report.replica_id)
            known = merged.get(family.name)
            merged[family.name] = tagged if known is None else Family(
                known.name, known.kind, known.help, known.samples + tagged.samples)
    families = [Family(REPLICAS_FAMILY, "gauge", "engine replicas that answered this scrape",
                       (("", (), len(ordered)),))]
    families += list(merged.values())
    families += [_summed(family) for family in merged.values()]
    return render(families)


def _summed(family: Family) -> Family:
    """``family`` summed over its replicas: one sample per suffix and other labels."""
    totals: dict[tuple[str, tuple[tuple[str, str], ...]], float] = defaultdict(int)
    for suffix, labels, value in family.samples:
        totals[(suffix, tuple(pair for pair in labels if pair[0] != "replica"))] += value
    samples: tuple[Sample, ...] = tuple((suffix, labels, value)
                                        for (suffix, labels), value in totals.items())
    name = REPLICAS_FAMILY + "_" + family.name.removeprefix(PREFIX)
    return Family(name, family.kind, f"{family.help}, summed over the replicas", samples)


async def gather_reports(ask: Callable[[str | None], Awaitable[ReplicaReport]],
                         known: Callable[[], Sequence[str]],
                         timeout_s: float = PROBE_TIMEOUT_S) -> list[ReplicaReport]:
    """Every known replica's report, asked for all at once (``ask(replica_id)``), each within
    ``timeout_s``. With no replica known yet, any one is asked first (that starts the router),
    then the others it knows of. A replica that fails or is late is left out (logged).

    Each ask runs in a task of its own whose context variables start empty (`_isolated`):
    Serve's router matches a routed replica to its request by the request id a handle call
    takes from the caller's request context, so concurrent calls made from one request share
    an id; all but one then never get a replica and their routing loops spin, stalling every
    request the router handles."""
    reports: dict[str, ReplicaReport] = {}
    wanted: list[str | None] = list(known()) or [None]
    for _ in range(2):
        answers = await asyncio.gather(
            *(asyncio.wait_for(_isolated(ask(r)), timeout_s) for r in wanted),
            return_exceptions=True)
        for replica, answer in zip(wanted, answers):
            if isinstance(answer, ReplicaReport):
                reports.setdefault(answer.replica_id, answer)
            else:
                logger.warning("replica %s did not report its metrics: %r", replica, answer)
        wanted = [r for r in known() if r not in reports]
        if not wanted:
            break
    return list(reports.values())


def _isolated(call: Awaitable[ReplicaReport]) -> asyncio.Future[ReplicaReport]:
    """``call`` as a task in an empty `contextvars.Context` (none of the caller's variables;
    a task copies the context it is created in)."""
    return contextvars.Context().run(asyncio.ensure_future, call)
