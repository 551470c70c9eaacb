"""``dyngen serve --replicas``: two engine replicas of the demo model on Ray Serve (on this
machine: a local Ray instance, each replica its own process with one CPU), behind the ingress,
routed by page hashes.

Workload: 2 documents × 16 questions, interleaved (`_workload`), sent two at a time. Each
replica's cache holds 3 pages (768 tokens): one prompt of a document (2 full pages and a partial
one) but not both documents, the regime where routing matters (a production working set of many
documents exceeds one replica's cache, not all caches).

The baseline is round-robin routing of the same workload, in the same pairs, over two engines
of the same configuration in this process (`_round_robin`): request i goes to engine i % 2,
which is all a round-robin router decides (`RoundRobinRouter` itself is tested in
test_replica_router.py). Each of its replies is one engine's greedy reply, the reference.

Checked: page-hash routing reuses at least 1.8 times the prompt tokens round-robin routing does
(each job's prompt tokens served from its engine's cache: the engine's ``cached_tokens``, which
the server reports as ``usage.prompt_tokens_details.cached_tokens``); each document's questions
stay on one replica; every reply through the replicas equals the single engine's greedy reply;
through the ingress, a streamed reply equals the unstreamed one, the model list and an
OpenAI-shaped 400 come back, and ``/metrics`` shows each replica's engine and request figures,
labelled by replica, and their sums.
"""

from __future__ import annotations

import os
import random
import socket
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from dyngen_core import (
    BackgroundGenerator,
    Cache,
    DynamicGenerator,
    EngineOptions,
    Job,
    Model,
    SamplerSettings,
    Tokenizer,
)
from dyngen_core.serve.options import ServeOptions
from dyngen_core.serve.replicas.options import ReplicaOptions

pytestmark = pytest.mark.demo
REPO = Path(__file__).resolve().parents[2]
MODEL = "demo"
MAX_TOKENS = 2
REPLICA_ENGINE = EngineOptions(cache_tokens=768, max_batch_size=8)
REPLICA_HEADER = "x-dyngen-replica"
ROUTER = "page-hash"
# The delay between the two requests of a pair sent together.
STAGGER_S = 0.25


def _document(topic: str, seed: int) -> str:
    """A made-up document: with the chat template and a question, a prompt of about 550
    tokens, whose first two 256-token pages hold only the system message and the document."""
    rng = random.Random(seed)
    places = ["harbour", "mill", "archive", "bridge", "orchard", "tower", "market", "school"]
    people = ["Ada", "Bram", "Cleo", "Dario", "Elin", "Faro", "Greta", "Hugo"]
    facts = [f"Fact {i}: in {1700 + rng.randrange(300)} {rng.choice(people)} rebuilt the "
             f"{rng.choice(places)} of {topic}, which then held {rng.randrange(90) + 10} "
             f"{rng.choice(['boats', 'books', 'looms', 'bells', 'trees'])}."
             for i in range(1, 19)]
    return f"Notes on {topic}.\n" + "\n".join(facts)


DOCUMENTS = [_document("Varn", 1), _document("Ostry", 2)]


def _messages(doc: int, question: int) -> list[dict[str, str]]:
    return [{"role": "system", "content": "Answer from the document."},
            {"role": "user", "content": f"{DOCUMENTS[doc]}\n\nWho rebuilt what in fact "
                                        f"{question + 1}?"}]


def _workload() -> list[tuple[int, int]]:
    """(document, question) pairs, 16 per document, interleaved in the order of a de Bruijn
    sequence (AAABABBB, repeated): every pattern of three consecutive documents occurs equally
    often, so the order neither favours nor starves a policy that depends on recent arrivals
    (strict alternation ABAB would hand round-robin over two replicas a perfect split, AABB
    the worst one)."""
    order = [0, 0, 0, 1, 0, 1, 1, 1] * 4
    asked = [0, 0]
    pairs = []
    for doc in order:
        pairs.append((doc, asked[doc]))
        asked[doc] += 1
    return pairs


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture(scope="module")
def ray_serve() -> Iterator[int]:
    """A local Ray instance of two CPUs (one per replica) with Serve's proxy on a free port;
    yields the port."""
    import ray
    from ray import serve

    # The replicas import this checkout's dyngen_core, whatever the environment installed.
    paths = [str(REPO), os.environ.get("PYTHONPATH", "")]
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": os.pathsep.join(p for p in paths if p)}})
    port = _free_port()
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        yield port
    finally:
        serve.shutdown()
        ray.shutdown()


def _deploy(serve_options: ServeOptions) -> None:
    """Two replicas routed by page hashes, under /page-hash."""
    from ray import serve

    from dyngen_core.serve.replicas.deployment import build_replicas_app

    app = build_replicas_app(serve_options, ReplicaOptions(replicas=2, router="page-hash"))
    serve.run(app, name=ROUTER, route_prefix="/" + ROUTER)


def _run_workload(port: int, router: str) -> list[dict[str, Any]]:
    """The workload through the application of ``router``, two requests at a time (the second
    sent `STAGGER_S` after the first, so they reach the router in workload order): each
    request's reply text, answering replica and cached prompt tokens, in order."""
    pairs = _workload()
    replies: list[dict[str, Any]] = []
    with httpx.Client(base_url=f"http://127.0.0.1:{port}/{router}", timeout=300) as http, \
            ThreadPoolExecutor(2) as pool:
        for first in range(0, len(pairs), 2):
            sent = pool.submit(_ask, http, *pairs[first])
            time.sleep(STAGGER_S)
            second = pool.submit(_ask, http, *pairs[first + 1])
            replies += [sent.result(), second.result()]
    return replies


def _ask(http: httpx.Client, doc: int, question: int) -> dict[str, Any]:
    reply = http.post("/v1/chat/completions", json={
        "model": MODEL, "messages": _messages(doc, question), "max_tokens": MAX_TOKENS,
        "temperature": 0})
    assert reply.status_code == 200, reply.text
    body = reply.json()
    return {"doc": doc, "text": body["choices"][0]["message"]["content"],
            "replica": reply.headers[REPLICA_HEADER],
            "cached": body["usage"]["prompt_tokens_details"]["cached_tokens"]}


def _streamed_and_errors(port: int) -> str:
    """Through the page-hash ingress with the official OpenAI client: the model list, a
    request error (an OpenAI-shaped 400 naming the field, from the replica's server), and the
    first workload request streamed; returns the streamed text."""
    import openai

    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/page-hash/v1", api_key="unused",
                           max_retries=0, timeout=300)
    assert [m.id for m in client.models.list().data] == [MODEL]
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model=MODEL, messages=[], max_tokens=1)
    assert refused.value.body["param"] == "messages"  # type: ignore[index]
    doc, question = _workload()[0]
    chunks = client.chat.completions.create(
        model=MODEL, messages=_messages(doc, question),  # type: ignore[arg-type]
        max_tokens=MAX_TOKENS, temperature=0, stream=True)
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


def _metrics(port: int) -> dict[str, float]:
    """The ingress's /metrics (one scrape): each sample line's name and labels -> its
    value."""
    reply = httpx.get(f"http://127.0.0.1:{port}/{ROUTER}/metrics", timeout=60)
    assert reply.status_code == 200, reply.text
    assert reply.headers["content-type"].startswith("text/plain")
    samples = {}
    for line in reply.text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            samples[key] = float(value)
    return samples


def _check_metrics(samples: dict[str, float], hashed: list[dict[str, Any]]) -> None:
    """Each replica's figures are labelled with its id and add up to the deployment's: each
    replica counted the chat requests the workload saw it answer."""
    chat = 'endpoint="/v1/chat/completions",status="200"'
    assert samples["dyngen_replicas"] == 2
    for replica in {r["replica"] for r in hashed}:
        answered = sum(r["replica"] == replica for r in hashed)
        assert samples[f'dyngen_http_requests_total{{replica="{replica}",{chat}}}'] == answered
        assert samples[f'dyngen_prefill_tokens_reused_total{{replica="{replica}",'
                       f'model="{MODEL}"}}'] > 0
    assert samples[f"dyngen_replicas_http_requests_total{{{chat}}}"] == len(hashed)
    for name in ("prefill_tokens_reused_total", "prefill_tokens_computed_total",
                 "pages_total", "pages_free"):
        each = [v for k, v in samples.items() if k.startswith(f"dyngen_{name}{{replica=")]
        assert len(each) == 2
        assert samples[f'dyngen_replicas_{name}{{model="{MODEL}"}}'] == sum(each)


def _round_robin(model_dir: Path) -> list[dict[str, Any]]:
    """The workload over two in-process engines configured as the replicas, request i on
    engine i % 2, two at a time: each request's greedy reply and cached prompt tokens."""
    model = Model.load(model_dir)
    tokenizer = Tokenizer.from_model_dir(model_dir)
    engines = [BackgroundGenerator(DynamicGenerator(
        model=model, cache=Cache(model, max_tokens=REPLICA_ENGINE.cache_tokens),
        tokenizer=tokenizer, max_batch_size=REPLICA_ENGINE.max_batch_size)) for _ in range(2)]
    replies = []
    try:
        pairs = _workload()
        for first in range(0, len(pairs), 2):
            handles = [engines[k].submit(_job(tokenizer, *pairs[first + k])) for k in (0, 1)]
            for handle in handles:
                final = handle.result(timeout=300)
                replies.append({"text": final["full_completion"],
                                "cached": final["cached_tokens"]})
    finally:
        for engine in engines:
            engine.close()
    return replies


def _job(tokenizer: Tokenizer, doc: int, question: int) -> Job:
    text = tokenizer.apply_chat_template(_messages(doc, question))
    return Job(input_ids=tokenizer.encode(text, encode_special_tokens=True),
               max_new_tokens=MAX_TOKENS, stop_conditions=list(tokenizer.eos_token_ids),
               gen_settings=SamplerSettings.greedy())


def test_page_hash_routing_reuses_far_more_than_round_robin(
        ray_serve: int, demo_model_dir: Path) -> None:
    from ray import serve

    options = ServeOptions(model_dir=str(demo_model_dir), model_name=MODEL,
                           engine_options=REPLICA_ENGINE)
    started = time.perf_counter()
    with ThreadPoolExecutor(1) as pool:
        baseline = pool.submit(_round_robin, demo_model_dir)
        _deploy(options)
        deployed = time.perf_counter()
        try:
            hashed = _run_workload(ray_serve, ROUTER)
            samples = _metrics(ray_serve)
            streamed = _streamed_and_errors(ray_serve)
        finally:
            serve.delete(ROUTER)
        rotated = baseline.result()
    reused = {"page-hash": sum(r["cached"] for r in hashed),
              "round-robin": sum(r["cached"] for r in rotated)}
    print(f"prompt tokens reused: {reused}; ratio "
          f"{reused['page-hash'] / max(1, reused['round-robin']):.2f}; deployed in "
          f"{deployed - started:.0f} s, ran in {time.perf_counter() - deployed:.0f} s")
    assert reused["page-hash"] >= 1.8 * reused["round-robin"]
    for doc in (0, 1):
        assert len({r["replica"] for r in hashed if r["doc"] == doc}) == 1
    assert len({r["replica"] for r in hashed}) == 2
    texts = [r["text"] for r in rotated]
    assert [r["text"] for r in hashed] == texts
    assert streamed == texts[0]
    _check_metrics(samples, hashed)
