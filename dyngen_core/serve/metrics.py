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
        lines: list[str] = []
        model = f'model="{_escape(model_name)}"'
        values = stats.as_dict()
        for name, (kind, text) in ENGINE_METRICS.items():
            metric = PREFIX + name + ("_total" if kind == "counter" else "")
            _declare(lines, metric, kind, text)
            lines.append(f"{metric}{{{model}}} {values[name]}")
        metric = PREFIX + "http_requests_total"
        _declare(lines, metric, "counter", "finished HTTP requests by endpoint and status")
        for (endpoint, status), count in sorted(self.requests.items()):
            lines.append(f'{metric}{{endpoint="{_escape(endpoint)}",status="{status}"}} {count}')
        _declare(lines, PREFIX + "http_requests_in_flight", "gauge", "requests being answered")
        lines.append(f"{PREFIX}http_requests_in_flight {self.in_flight}")
        _declare(lines, PREFIX + "client_disconnects_total", "counter",
                 "requests whose client left early (jobs cancelled)")
        lines.append(f"{PREFIX}client_disconnects_total {self.disconnects}")
        metric = PREFIX + "time_to_first_token_seconds"
        _declare(lines, metric, "summary", "arrival to first token, streaming requests")
        lines.append(f"{metric}_sum {self.first_token_seconds_sum}")
        lines.append(f"{metric}_count {self.first_token_count}")
        return "\n".join(lines) + "\n"


def _declare(lines: list[str], metric: str, kind: str, text: str) -> None:
    lines.append(f"# HELP {metric} {text}")
    lines.append(f"# TYPE {metric} {kind}")


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
