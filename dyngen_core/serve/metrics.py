"""Prometheus metrics in the text exposition format: the engine's `GeneratorStats` and the
server's request counts, rendered on each scrape of ``/metrics``.

Engine figures are read from `BackgroundGenerator.stats()` (published after each step, never
waiting for one). Server figures are counted by `ServerMetrics`, on the event loop's thread.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from dyngen_core import GeneratorStats

# GeneratorStats field -> (metric kind, help). Counters get Prometheus' "_total" suffix.
ENGINE_METRICS: dict[str, tuple[str, str]] = {
    "pages_total": ("gauge", "KV cache pages in the pool"),
    "pages_referenced": ("gauge", "pages held by queued or running jobs"),
    "pages_cached": ("gauge", "pages kept for the prompt cache, reusable"),
    "pages_free": ("gauge", "pages holding nothing"),
    "prefill_tokens_computed": ("counter", "prompt tokens the model computed"),
    "prefill_tokens_reused": ("counter", "prompt tokens taken from the cache instead"),
    "jobs_active": ("gauge", "running jobs"),
    "jobs_pending": ("gauge", "jobs waiting to run"),
    "draft_tokens_accepted": ("counter", "speculative draft tokens accepted"),
    "draft_tokens_rejected": ("counter", "speculative draft tokens rejected"),
    "preemptions": ("counter", "running jobs sent back to the queue for lack of pages"),
}
PREFIX = "dyngen_"
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


# One sample of a family: (name suffix such as "" or "_sum", labels, value).
Sample = tuple[str, tuple[tuple[str, str], ...], float]


@dataclass(frozen=True)
class Family:
    """One metric family: its name, Prometheus type, help text and samples. Picklable, so
    engine replicas send theirs to the ingress (`dyngen_core.serve.replicas.metrics`)."""

    name: str
    kind: str
    help: str
    samples: tuple[Sample, ...]

    def labelled(self, name: str, value: str) -> Family:
        """The family with ``name="value"`` added to every sample's labels."""
        return Family(self.name, self.kind, self.help, tuple(
            (suffix, ((name, value), *labels), number)
            for suffix, labels, number in self.samples))


def render(families: list[Family]) -> str:
    """Families in Prometheus' text exposition format."""
    lines: list[str] = []
    for family in families:
        lines.append(f"# HELP {family.name} {family.help}")
        lines.append(f"# TYPE {family.name} {family.kind}")
        for suffix, labels, value in family.samples:
            shown = ",".join(f'{key}="{_escape(text)}"' for key, text in labels)
            lines.append(f"{family.name}{suffix}{{{shown}}} {value}" if shown
                         else f"{family.name}{suffix} {value}")
    return "\n".join(lines) + "\n"


@dataclass
class ServerMetrics:
    """The server's own counts.

    requests: finished requests by (endpoint, HTTP status).
    in_flight: requests being answered now.
    disconnects: requests whose client went away before the answer ended (their jobs were
        cancelled).
    first_token_seconds: the sum and count of times from a request's arrival to its first
        generated token (streaming requests).
    """

    requests: Counter[tuple[str, int]] = field(default_factory=Counter)
    in_flight: int = 0
    disconnects: int = 0
    first_token_seconds_sum: float = 0.0
    first_token_count: int = 0

    def first_token(self, seconds: float) -> None:
        """Count one streaming request's time to first token."""
        self.first_token_seconds_sum += seconds
        self.first_token_count += 1

    def render(self, stats: GeneratorStats, model_name: str) -> str:
        """Every metric, engine's and server's, in Prometheus' text format."""
        return render(self.families(stats, model_name))

    def families(self, stats: GeneratorStats, model_name: str) -> list[Family]:
        """Every metric, engine's (labelled by model) and server's."""
        model = (("model", model_name),)
        values = stats.as_dict()
        families = [Family(PREFIX + name + ("_total" if kind == "counter" else ""), kind, text,
                           (("", model, values[name]),))
                    for name, (kind, text) in ENGINE_METRICS.items()]
        families += [
            Family(PREFIX + "http_requests_total", "counter",
                   "finished HTTP requests by endpoint and status",
                   tuple(("", (("endpoint", endpoint), ("status", str(status))), count)
                         for (endpoint, status), count in sorted(self.requests.items()))),
            Family(PREFIX + "http_requests_in_flight", "gauge", "requests being answered",
                   (("", (), self.in_flight),)),
            Family(PREFIX + "client_disconnects_total", "counter",
                   "requests whose client left early (jobs cancelled)",
                   (("", (), self.disconnects),)),
            Family(PREFIX + "time_to_first_token_seconds", "summary",
                   "arrival to first token, streaming requests",
                   (("_sum", (), self.first_token_seconds_sum),
                    ("_count", (), self.first_token_count))),
        ]
        return families


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
