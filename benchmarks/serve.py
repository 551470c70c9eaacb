"""The server's overhead: requests per second and time to first token (p50, p99) with many
concurrent streaming clients through ``dyngen serve``, against the same jobs on the engine
in-process.

    python benchmarks/serve.py [--workload chat] [--model DIR] [--requests 256] [--clients 64]
                               [--new-tokens 32] [--cache-tokens 32768] [--device auto]
                               [--rounds 3]

In-process: ``--clients`` asyncio tasks at a time each submit one job to the shared engine
(`shared_generator`) and stream it. Through the server: ``dyngen serve`` runs in a child
process (engine and uvicorn there, as in production), and ``--clients`` concurrent
streaming chat requests (httpx, reading the events with json) go to it from this process.
The jobs are the same in both: greedy chat replies to distinct questions, at most
``--new-tokens`` tokens. Each side is warmed up first. Time to first token is from sending
the request (in-process: submitting the job) to its first text. The sides alternate for
``--rounds`` rounds, and the overhead is the server's extra share of the whole run's time,
best round against best round (a shared machine's other load only ever adds time).
Replies must be equal on both sides (greedy), else the script exits 1.

Prints one ``BENCH {...}`` JSON line per side and round, and one for the overhead.

``--workload throughput`` runs benchmarks/throughput.py's workload (random Llama-3-8B-shape
model, 256 prompts of 512 token ids, 128 new tokens each) through the server against
in-process instead: see benchmarks/serve_throughput.py, which takes its own arguments.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dyngen_core import EngineOptions, Job, SamplerSettings, shared_generator  # noqa: E402

TOPICS = ["the sea", "a cat", "Paris", "rain", "a library", "the moon", "bread", "a bicycle",
          "winter", "music", "a forest", "coffee", "a river", "chess", "the desert", "a train"]
MODEL_NAME = "bench"


@dataclass(frozen=True)
class Outcome:
    """One request: seconds to its first text, seconds to its end, and its text."""

    first_s: float
    total_s: float
    text: str


def questions(count: int) -> list[str]:
    return [f"Write a sentence about {TOPICS[i % len(TOPICS)]} (note {i})." for i in
            range(count)]


def percentile(values: list[float], share: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(share * (len(ordered) - 1))))]


def summary(side: str, outcomes: list[Outcome], wall_s: float) -> dict[str, Any]:
    firsts = [o.first_s for o in outcomes]
    return {"bench": "serve", "side": side, "requests": len(outcomes),
            "wall_s": round(wall_s, 3), "requests_per_s": round(len(outcomes) / wall_s, 3),
            "ttft_p50_s": round(statistics.median(firsts), 4),
            "ttft_p99_s": round(percentile(firsts, 0.99), 4)}


# ---- in-process ------------------------------------------------------------------------------


async def run_in_process(engine: Any, prompts: list[list[int]], new_tokens: int,
                         clients: int) -> tuple[list[Outcome], float]:
    gate = asyncio.Semaphore(clients)
    stops = list(engine.tokenizer.eos_token_ids)

    async def one(prompt: list[int]) -> Outcome:
        async with gate:
            start = time.perf_counter()
            first = None
            handle = engine.submit(Job(input_ids=prompt, max_new_tokens=new_tokens,
                                       stop_conditions=stops,
                                       gen_settings=SamplerSettings.greedy()))
            text = ""
            async for result in handle:
                if result.get("text") and first is None:
                    first = time.perf_counter() - start
                text += result.get("text") or ""
            end = time.perf_counter() - start
            return Outcome(first if first is not None else end, end, text)

    start = time.perf_counter()
    outcomes = await asyncio.gather(*(one(p) for p in prompts))
    return list(outcomes), time.perf_counter() - start


# ---- through the server ----------------------------------------------------------------------


async def run_through_server(base_url: str, texts: list[str], new_tokens: int,
                             clients: int) -> tuple[list[Outcome], float]:
    """The requests as streaming chat completions from ``clients`` concurrent connections.
    The client reads the server-sent events itself (httpx and json), so that its own cost
    on a shared CPU stays small next to the server's."""
    import httpx

    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    gate = asyncio.Semaphore(clients)

    async def one(http: httpx.AsyncClient, question: str) -> Outcome:
        async with gate:
            start = time.perf_counter()
            first = None
            text = ""
            body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": question}],
                    "max_tokens": new_tokens, "temperature": 0, "stream": True}
            async with http.stream("POST", "/v1/chat/completions", json=body) as response:
                response.raise_for_status()
                async for line in response.aiter_lines():
                    if not line.startswith("data: {"):
                        continue
                    choices = json.loads(line[6:])["choices"]
                    piece = choices[0]["delta"].get("content") if choices else None
                    if piece and first is None:
                        first = time.perf_counter() - start
                    text += piece or ""
            end = time.perf_counter() - start
            return Outcome(first if first is not None else end, end, text)

    async with httpx.AsyncClient(base_url=base_url, limits=limits, timeout=600) as http:
        start = time.perf_counter()
        outcomes = await asyncio.gather(*(one(http, q) for q in texts))
        return list(outcomes), time.perf_counter() - start


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def start_server(model_dir: str, port: int, options: list[str],
                 wait_s: float = 300.0) -> subprocess.Popen[bytes]:
    """``dyngen serve`` on ``model_dir`` in a child process, serving `MODEL_NAME` on ``port``
    with the engine ``options`` (command-line arguments); returns once /health answers."""
    server = launch_server(model_dir, port, options)
    wait_for_health(server, port, wait_s)
    return server


def launch_server(model_dir: str, port: int, options: list[str]) -> subprocess.Popen[bytes]:
    """`start_server` without waiting: the child process, loading its model."""
    command = [sys.executable, "-m", "dyngen_core", "serve", "--model", model_dir,
               "--port", str(port), "--served-model-name", MODEL_NAME, "--log-level",
               "warning", *options]
    paths = [str(Path(__file__).resolve().parents[1]), os.environ.get("PYTHONPATH", "")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in paths if p)}
    return subprocess.Popen(command, env=env)


def wait_for_health(server: subprocess.Popen[bytes], port: int, wait_s: float) -> None:
    """Return once the server on ``port`` answers /health; kill it and exit if it ends or
    does not answer within ``wait_s`` seconds."""
    import httpx

    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise SystemExit(f"dyngen serve exited with {server.returncode}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    server.kill()
    raise SystemExit(f"dyngen serve did not answer /health within {wait_s:.0f} s")


def main() -> int:
    workload = argparse.ArgumentParser(add_help=False)
    workload.add_argument("--workload", choices=("chat", "throughput"), default="chat")
    chosen, rest = workload.parse_known_args()
    if chosen.workload == "throughput":
        from serve_throughput import main as throughput_main

        return throughput_main(rest)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], parents=[workload])
    parser.add_argument("--model", default=None, help="model folder (default: the demo model)")
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--cache-tokens", type=int, default=32768)
    parser.add_argument("--device", default=None)
    parser.add_argument("--rounds", type=int, default=3,
                        help="in-process and server runs, alternating; the best of each counts")
    args = parser.parse_args()
    if args.model is None:
        from dyngen_core.cli.convert.demo import fetch_demo_model

        args.model = str(fetch_demo_model())
    texts = questions(args.requests)
    warmup = questions(args.clients)[: min(8, args.clients)]

    options = {"cache_tokens": args.cache_tokens, "max_batch_size": args.clients}
    if args.device:
        options["device"] = args.device
    engine = shared_generator(args.model, engine_options=EngineOptions(**options))
    tokenizer = engine.tokenizer

    def chat_ids(question: str) -> list[int]:
        text = tokenizer.apply_chat_template([{"role": "user", "content": question}])
        return tokenizer.encode(text, encode_special_tokens=True)

    local_ids = [chat_ids(q) for q in texts]
    asyncio.run(run_in_process(engine, [chat_ids(q) for q in warmup], args.new_tokens,
                               args.clients))
    port = free_port()
    engine_args = ["--cache-tokens", str(args.cache_tokens), "--max-batch-size",
                   str(args.clients)] + (["--device", args.device] if args.device else [])
    server = start_server(args.model, port, engine_args)
    url = f"http://127.0.0.1:{port}"
    walls: dict[str, list[float]] = {"in_process": [], "server": []}
    try:
        asyncio.run(run_through_server(url, warmup, args.new_tokens, args.clients))
        # The sides alternate, so that load from elsewhere on a shared machine hits both.
        for _ in range(args.rounds):
            local, local_s = asyncio.run(run_in_process(engine, local_ids, args.new_tokens,
                                                        args.clients))
            remote, remote_s = asyncio.run(run_through_server(url, texts, args.new_tokens,
                                                              args.clients))
            for figure in (summary("in_process", local, local_s),
                           summary("server", remote, remote_s)):
                print("BENCH " + json.dumps(figure), flush=True)
            walls["in_process"].append(local_s)
            walls["server"].append(remote_s)
    finally:
        server.terminate()
        server.wait(timeout=60)
        engine.close()

    best_local, best_remote = min(walls["in_process"]), min(walls["server"])
    print("BENCH " + json.dumps({
        "bench": "serve", "side": "overhead", "rounds": args.rounds, "clients": args.clients,
        "new_tokens": args.new_tokens, "best_in_process_s": round(best_local, 3),
        "best_server_s": round(best_remote, 3),
        "server_share_of_time": round((best_remote - best_local) / best_remote, 4)}))
    mismatched = sum(a.text != b.text for a, b in zip(local, remote, strict=True))
    if mismatched:
        print(f"{mismatched} of {len(texts)} replies differ between the two sides",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
