"""The server's pieces that need no model (nor FastAPI): error bodies, metrics text,
options, request schemas."""

from __future__ import annotations

from typing import Any

import pytest

from dyngen_core import GeneratorStats
from dyngen_core.serve.errors import RequestError, field_path
from dyngen_core.serve.metrics import ENGINE_METRICS, ServerMetrics
from dyngen_core.serve.options import ServeOptions
from dyngen_core.serve.schemas import ChatCompletionRequest, CompletionRequest


def test_field_paths_drop_body_and_union_branches() -> None:
    assert field_path(("body", "messages", 0, "role")) == "messages.0.role"
    assert field_path(("body", "stop", "list[str]", 5)) == "stop.5"
    assert field_path(("body",)) is None


def test_a_request_error_has_openais_shape() -> None:
    error = RequestError("n is too big", "n", code="x")
    assert error.body() == {"error": {"message": "n is too big", "type":
                                      "invalid_request_error", "param": "n", "code": "x"}}
    assert error.status == 400


def test_metrics_render_every_engine_figure_and_the_request_counts() -> None:
    stats = GeneratorStats(pages_total=32, pages_referenced=3, pages_cached=5, pages_free=24,
                           prefill_tokens_computed=100, prefill_tokens_reused=40,
                           jobs_active=2, jobs_pending=1, draft_tokens_accepted=7,
                           draft_tokens_rejected=2, preemptions=0)
    metrics = ServerMetrics()
    metrics.requests[("/v1/completions", 200)] += 3
    metrics.first_token(0.5)
    text = metrics.render(stats, 'my"model')
    lines = text.splitlines()
    assert 'dyngen_pages_referenced{model="my\\"model"} 3' in lines
    assert 'dyngen_prefill_tokens_reused_total{model="my\\"model"} 40' in lines
    assert 'dyngen_draft_tokens_accepted_total{model="my\\"model"} 7' in lines
    assert 'dyngen_http_requests_total{endpoint="/v1/completions",status="200"} 3' in lines
    assert "dyngen_time_to_first_token_seconds_count 1" in lines
    declared = [line.split()[2] for line in lines if line.startswith("# TYPE")]
    assert len(declared) == len(set(declared)) == len(ENGINE_METRICS) + 4


def test_options_name_the_model_after_its_folder_and_refuse_an_empty_key() -> None:
    assert ServeOptions(model_dir="/models/SmolLM2").model_name == "SmolLM2"
    with pytest.raises(ValueError, match="api_key is empty"):
        ServeOptions(model_dir="/m", api_key="")


def test_requests_normalize_stop_and_prompts() -> None:
    chat = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}],
                                 stop="END")
    assert chat.stop == ["END"] and chat.token_budget is None and not chat.ignore_eos
    assert CompletionRequest(model="m", prompt=[1, 2, 3]).prompts() == [[1, 2, 3]]
    assert CompletionRequest(model="m", prompt=["a", "b"]).prompts() == ["a", "b"]


def test_the_serve_command_reads_its_options(monkeypatch: pytest.MonkeyPatch) -> None:
    from dyngen_core.cli.main import build_parser
    from dyngen_core.serve.options import API_KEY_ENV, serve_options

    monkeypatch.setenv(API_KEY_ENV, "from-env")
    args = build_parser().parse_args(["serve", "--model", "/m/Demo", "--port", "0",
                                      "--cache-tokens", "4096", "--max-batch-size", "8",
                                      "--max-chunk-size", "512"])
    options = serve_options(args, args.model)
    assert (options.model_name, options.port, options.api_key) == ("Demo", 0, "from-env")
    assert options.engine_options.cache_tokens == 4096
    assert options.engine_options.max_batch_size == 8
    assert options.engine_options.max_chunk_size == 512
    args = build_parser().parse_args(["serve", "--model", "/m/Demo", "--api-key", "given",
                                      "--served-model-name", "x"])
    assert serve_options(args, args.model).api_key == "given"
    assert serve_options(args, args.model).model_name == "x"


def test_validation_errors_name_the_field_inside_a_union() -> None:
    from pydantic import ValidationError

    with pytest.raises(ValidationError) as caught:
        ChatCompletionRequest(model="m", messages=[{"role": "user",
                                                    "content": [{"type": "image_url"}]}])
    paths = {field_path(error["loc"]) for error in caught.value.errors()}
    assert paths <= {"messages.0.content", "messages.0.content.0.type",
                     "messages.0.content.0.text"}, paths


def _report(replica: str, reused: int, pages_free: int, requests: int) -> Any:
    from dyngen_core.serve.replicas.metrics import ReplicaReport

    stats = GeneratorStats(pages_total=32, pages_referenced=0, pages_cached=32 - pages_free,
                           pages_free=pages_free, prefill_tokens_computed=10,
                           prefill_tokens_reused=reused, jobs_active=0, jobs_pending=0,
                           draft_tokens_accepted=0, draft_tokens_rejected=0, preemptions=0)
    metrics = ServerMetrics()
    metrics.requests[("/v1/chat/completions", 200)] += requests
    metrics.first_token(0.25)
    return ReplicaReport(replica, tuple(metrics.families(stats, "demo")))


def test_replica_metrics_are_labelled_by_replica_and_summed() -> None:
    from dyngen_core.serve.replicas.metrics import aggregate

    lines = aggregate([_report("r2", 40, 20, 5), _report("r1", 256, 8, 3)]).splitlines()
    assert "dyngen_replicas 2" in lines
    assert 'dyngen_prefill_tokens_reused_total{replica="r1",model="demo"} 256' in lines
    assert 'dyngen_prefill_tokens_reused_total{replica="r2",model="demo"} 40' in lines
    assert 'dyngen_replicas_prefill_tokens_reused_total{model="demo"} 296' in lines
    assert 'dyngen_replicas_pages_free{model="demo"} 28' in lines
    assert ('dyngen_replicas_http_requests_total{endpoint="/v1/chat/completions",'
            'status="200"} 8') in lines
    assert "dyngen_replicas_time_to_first_token_seconds_count 2" in lines
    assert "dyngen_replicas_time_to_first_token_seconds_sum 0.5" in lines
    declared = [line.split()[2] for line in lines if line.startswith("# TYPE")]
    assert len(declared) == len(set(declared)) == 1 + 2 * (len(ENGINE_METRICS) + 4)


def test_the_ingress_asks_every_known_replica_and_leaves_out_a_silent_one() -> None:
    import asyncio

    from dyngen_core.serve.replicas.metrics import ReplicaReport, gather_reports

    known: list[str] = []
    asked: list[str | None] = []

    async def ask(replica: str | None) -> ReplicaReport:
        asked.append(replica)
        if replica is None:  # the first probe, to any replica, starts the router
            known.extend(["a", "b", "c"])
            replica = "b"
        if replica == "c":
            await asyncio.sleep(10)
        return _report(replica, 1, 1, 1)

    reports = asyncio.run(gather_reports(ask, lambda: known, timeout_s=0.2))
    assert sorted(r.replica_id for r in reports) == ["a", "b"]
    assert asked[0] is None and sorted(asked[1:3]) == ["a", "c"]


def test_the_ingress_asks_each_replica_outside_the_scrape_s_request_context() -> None:
    """Serve gives a handle call the request id of the caller's context: each probe must run
    in a context of its own, or concurrent probes share an id and Serve's router spins."""
    import asyncio
    import contextvars

    from dyngen_core.serve.replicas.metrics import ReplicaReport, gather_reports

    request_id: contextvars.ContextVar[str | None] = contextvars.ContextVar("request_id",
                                                                           default=None)
    seen: list[str | None] = []

    async def ask(replica: str | None) -> ReplicaReport:
        seen.append(request_id.get())
        request_id.set(f"probe of {replica}")
        return _report(replica or "a", 1, 1, 1)

    async def scrape() -> list[ReplicaReport]:
        request_id.set("the scrape")
        reports = await gather_reports(ask, lambda: ["a", "b"])
        assert request_id.get() == "the scrape"
        return reports

    reports = asyncio.run(scrape())
    assert sorted(r.replica_id for r in reports) == ["a", "b"]
    assert seen == [None, None]
