"""The throughput workload through ``dyngen serve`` against the same jobs in-process:
``python benchmarks/serve.py --workload throughput`` runs this module.

    python benchmarks/serve.py --workload throughput [--small] [--layers N] [--prompts 256]
                               [--rounds 2] [--dir /tmp/dyngen-serve-model] [--device cuda]

The workload is benchmarks/throughput.py's: ``--prompts`` prompts of 512 random token ids, 128
new tokens each, greedy, lengths forced, on a random Llama-3-8B-shape model (bf16 on the GPU,
float32 on the CPU; ``--small`` for tiny shapes). The model is written as a model folder first
(config.json, safetensors shards as load_time.py writes them, and the word tokenizer's
tokenizer.json), so that the server and this process load the same weights.

Sides, each with the engine options of throughput.py (a cache that holds every job at once,
max_batch_size = prompts, max_chunk_size 16384):

- ``in_process``: the shared engine (`shared_generator`) of this process; every job submitted
  at once, each awaited for its final result only (`JobHandle.aresult`).
- ``server``: ``dyngen serve`` in a child process (loaded while this process loads its own
  engine); every prompt as its own ``/v1/completions`` request, all concurrent on as many
  connections, the prompt as a list of token ids, ``max_tokens`` 128, ``temperature`` 0 and
  ``ignore_eos`` (dyngen's and vLLM's extension: the model's end-of-sequence token does not end
  a reply), not streamed: the reply comes whole.
- ``server_stream``: the same requests streamed (server-sent events, read with httpx and
  json; ``stream_options.include_usage`` for the token count).

Each side is warmed up on 4 other prompts first; then the sides run in turn for ``--rounds``
rounds, and the best round of each counts. No engine sees a prompt twice (its prompt cache would
skip the prefill, half of this workload's work): each round draws new prompts, the same for
``in_process`` and ``server`` (two engines) and others for ``server_stream`` (the server's
engine again). Every reply must have exactly 128 tokens (the server's ``usage.completion_tokens``),
else the script exits 1. The server's whole replies are compared with the in-process ones and
the count that differ is reported (greedy, but batches form differently on each side, and in
bf16 a different batch can round a near tie the other way).

Prints one ``BENCH {...}`` JSON line per side and round, and one with the ratios
(server tok/s over in-process tok/s).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from _common import (
    GREEDY,
    add_common_args,
    bench_config,
    bench_dtype,
    cache_tokens_for,
    device_name,
    random_prompts,
    report,
    word_tokenizer_backend,
)
from load_time import write_checkpoint
from serve import MODEL_NAME, free_port, launch_server, wait_for_health

from dyngen_core import EngineOptions, Job, shared_generator

PROMPT, NEW = 512, 128
MAX_CHUNK = 16384
SIDES = ("in_process", "server", "server_stream")


@dataclass(frozen=True)
class Reply:
    """One job's outcome: its new tokens, its text, and seconds from sending to its first
    text (streamed replies; the whole reply's time otherwise)."""

    tokens: int
    text: str
    first_s: float


@dataclass(frozen=True)
class SideRun:
    """One side's run of the workload: wall seconds and every reply, in prompt order."""

    side: str
    wall_s: float
    replies: list[Reply]

    @property
    def new_tokens(self) -> int:
        return sum(r.tokens for r in self.replies)

    @property
    def tok_s(self) -> float:
        return self.new_tokens / self.wall_s


def write_model_folder(folder: Path, config: dict[str, Any], device: torch.device) -> int:
    """The random model as a folder the server loads: weights and config.json
    (load_time.write_checkpoint) and the word tokenizer's tokenizer.json. Returns the bytes of
    weights written."""
    written = write_checkpoint(folder, config, device)
    word_tokenizer_backend(config["vocab_size"]).save(str(folder / "tokenizer.json"))
    return written


# ---- in-process ------------------------------------------------------------------------------


async def run_in_process(engine: Any, prompts: Sequence[list[int]]) -> SideRun:
    """Every prompt as a greedy job of exactly NEW tokens (no stop conditions), submitted at
    once; each awaited for its final result."""
    start = time.perf_counter()
    handles = [engine.submit(Job(input_ids=p, max_new_tokens=NEW, stop_conditions=[],
                                 gen_settings=GREEDY)) for p in prompts]

    async def final(handle: Any) -> Reply:
        result = await handle.aresult()
        return Reply(int(result["new_tokens"]), str(result["full_completion"]),
                     time.perf_counter() - start)

    replies = await asyncio.gather(*(final(h) for h in handles))
    return SideRun("in_process", time.perf_counter() - start, list(replies))


# ---- through the server ----------------------------------------------------------------------


async def run_through_server(base_url: str, prompts: Sequence[list[int]],
                             stream: bool) -> SideRun:
    """Every prompt as its own /v1/completions request, all at once on as many connections."""
    import httpx

    limits = httpx.Limits(max_connections=len(prompts), max_keepalive_connections=len(prompts))
    timeout = httpx.Timeout(900, connect=60, pool=900)
    async with httpx.AsyncClient(base_url=base_url, limits=limits, timeout=timeout) as http:
        ask = _streamed if stream else _whole
        start = time.perf_counter()
        replies = await asyncio.gather(*(ask(http, p, start) for p in prompts))
        return SideRun("server_stream" if stream else "server", time.perf_counter() - start,
                       list(replies))


def _body(prompt: list[int], stream: bool) -> dict[str, Any]:
    body: dict[str, Any] = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": NEW,
                            "temperature": 0, "ignore_eos": True, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


async def _whole(http: Any, prompt: list[int], start: float) -> Reply:
    response = await http.post("/v1/completions", json=_body(prompt, False))
    response.raise_for_status()
    answer = response.json()
    return Reply(int(answer["usage"]["completion_tokens"]), answer["choices"][0]["text"],
                 time.perf_counter() - start)


async def _streamed(http: Any, prompt: list[int], start: float) -> Reply:
    sent = time.perf_counter()
    first: float | None = None
    pieces: list[str] = []
    tokens = -1
    async with http.stream("POST", "/v1/completions", json=_body(prompt, True)) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(f"the server failed mid-stream: {chunk['error']}")
            if chunk.get("usage"):
                tokens = int(chunk["usage"]["completion_tokens"])
            for choice in chunk.get("choices") or ():
                if choice.get("text") and first is None:
                    first = time.perf_counter() - sent
                pieces.append(choice.get("text") or "")
    return Reply(tokens, "".join(pieces),
                 first if first is not None else time.perf_counter() - start)


# ---- the run ---------------------------------------------------------------------------------


def summary(run: SideRun, round_index: int) -> dict[str, Any]:
    figures: dict[str, Any] = {
        "bench": "serve_throughput", "side": run.side, "round": round_index,
        "jobs": len(run.replies), "new_tokens": run.new_tokens,
        "wall_s": round(run.wall_s, 3), "tok_s": round(run.tok_s, 1)}
    if run.side == "server_stream":
        figures["ttft_p50_s"] = round(statistics.median(r.first_s for r in run.replies), 4)
    return figures


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="serve.py --workload throughput",
                                     description=__doc__.split("\n\n")[0])
    add_common_args(parser)
    parser.add_argument("--prompts", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=2,
                        help="rounds of the three sides in turn; the best of each counts")
    parser.add_argument("--dir", default="/tmp/dyngen-serve-model",
                        help="where to write the model folder (overwritten, and left there)")
    return parser.parse_args(argv)


def main(argv: Sequence[str]) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    config = bench_config(args)
    vocab = config["vocab_size"]
    prompts = random_prompts(args.prompts, PROMPT, vocab, seed=3)
    warmup = random_prompts(4, PROMPT, config["vocab_size"], seed=98)
    folder = Path(args.dir)
    started = time.perf_counter()
    written = write_model_folder(folder, config, device)
    report("serve_throughput.model_folder", device=device_name(), folder=str(folder),
           layers=config["num_hidden_layers"], gb=round(written / 1e9, 2),
           seconds=round(time.perf_counter() - started, 1))
    dtype = str(bench_dtype(device)).removeprefix("torch.")
    cache_tokens = cache_tokens_for(prompts, NEW)
    options = EngineOptions(device=args.device, dtype=dtype, cache_tokens=cache_tokens,
                            max_batch_size=len(prompts), max_chunk_size=MAX_CHUNK)
    port = free_port()
    # The child loads its engine while this process loads its own.
    server = launch_server(str(folder), port, [
        "--device", args.device, "--dtype", dtype, "--cache-tokens", str(cache_tokens),
        "--max-batch-size", str(len(prompts)), "--max-chunk-size", str(MAX_CHUNK)])
    url = f"http://127.0.0.1:{port}"
    runs: dict[str, list[SideRun]] = {side: [] for side in SIDES}
    try:
        engine = shared_generator(folder, engine_options=options)
        wait_for_health(server, port, wait_s=600)
        report("serve_throughput.ready", seconds=round(time.perf_counter() - started, 1))
        asyncio.run(run_in_process(engine, warmup))
        asyncio.run(run_through_server(url, warmup, stream=False))
        differing = 0
        for round_index in range(args.rounds):
            # Fresh prompts for every run of an engine: a prompt it ran before would be
            # served from its prompt cache, and prefill is half of this workload's work.
            shared = prompts if round_index == 0 else random_prompts(
                len(prompts), PROMPT, vocab, seed=3 + 2 * round_index)
            streamed = random_prompts(len(prompts), PROMPT, vocab, seed=4 + 2 * round_index)
            local = asyncio.run(run_in_process(engine, shared))
            remote = asyncio.run(run_through_server(url, shared, stream=False))
            differing += sum(a.text != b.text
                             for a, b in zip(local.replies, remote.replies, strict=True))
            for run in (local, remote, asyncio.run(run_through_server(url, streamed, True))):
                report("serve_throughput.side", **summary(run, round_index))
                runs[run.side].append(run)
    finally:
        server.terminate()
        server.wait(timeout=60)
    return verdict(runs, differing)


def verdict(runs: dict[str, list[SideRun]], differing: int) -> int:
    """Report the best round of each side, the ratios and how many server replies differed
    from the in-process ones (``differing``); 1 when a reply's length is wrong."""
    best = {side: min(side_runs, key=lambda r: r.wall_s) for side, side_runs in runs.items()}
    local = best["in_process"]
    report("serve_throughput.ratio", rounds=len(runs["in_process"]),
           jobs=len(local.replies), new_tokens_each=NEW,
           **{f"{side}_tok_s": round(run.tok_s, 1) for side, run in best.items()},
           **{f"{side}_wall_s": round(run.wall_s, 3) for side, run in best.items()},
           server_over_in_process=round(best["server"].tok_s / local.tok_s, 4),
           server_stream_over_in_process=round(best["server_stream"].tok_s / local.tok_s, 4),
           server_replies_differing=differing)
    wrong = {side: sum(r.tokens != NEW for run in side_runs for r in run.replies)
             for side, side_runs in runs.items()}
    if any(wrong.values()):
        print(f"replies without exactly {NEW} tokens, by side: {wrong}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
