"""Load on one shared engine: many async requests and sync threads at once, mixed jobs, random
cancellations and bad inputs; every output must equal its solo run and nothing may leak.

    python benchmarks/load.py [--model DIR] [--requests 1000] [--threads 32] [--per-thread 4]
                              [--cancel 0.15] [--new-tokens 12] [--rounds 2] [--seed 0]

The engine is `shared_generator` over the demo model (SmolLM2-135M, fetched and converted on
first use) unless ``--model`` names another folder. The jobs are drawn from a pool of distinct
specs (prompt x kind x seed): plain greedy, seeded sampling (top-p), a JSON-schema constraint, a
choice constraint, banned strings, min_new_tokens with a stop string. Each spec is first run
alone (the reference), then ``--requests`` async requests (one event loop, all submitted at
once) and ``--threads`` threads of ``--per-thread`` blocking requests run together; a fraction
``--cancel`` of them is cancelled at a random moment, and a few carry bad inputs (refused at
submit with a clear error). ``--rounds`` repeats the load to show that memory stays bounded.

Checks (any failure exits 1): every request that finished equals its spec's solo output; each
cancelled one ended "cancelled" or had finished; each bad input raised a dyngen error; after
each round no page is referenced, the page invariant holds and no job is left; the process's
resident memory after the last round is within ``--rss-slack-mb`` of the first.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import random
import resource
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dyngen_core import Job, SamplerSettings, shared_generator
from dyngen_core.errors import DynGenError

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0,
                                                   "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}
PROMPTS = [
    "Write one sentence about the sea.", "Name a colour.", "What is two plus two?",
    "Describe a cat in a few words.", "Give a person's name and age as JSON.",
    "Tell me a fact about Paris.", "Say hello politely.", "Is the sky blue?",
    "List three fruits.", "What day comes after Monday?", "Finish: once upon a time",
    "Translate 'bonjour' to English.",
]
KINDS = ("greedy", "sampled", "json", "choice", "banned", "min_stop")


@dataclass(frozen=True)
class Spec:
    """One distinct request: its prompt, kind and seed."""

    prompt: int
    kind: str
    seed: int


def build_job(spec: Spec, tokenizer: Any, new_tokens: int, identifier: Any = None) -> Job:
    """A fresh `Job` for ``spec`` (a Job runs once)."""
    messages = [{"role": "user", "content": PROMPTS[spec.prompt]}]
    ids = tokenizer.encode(tokenizer.apply_chat_template(messages), encode_special_tokens=True)
    sampled = SamplerSettings(temperature=0.8, top_p=0.9)
    options: dict[str, Any] = {"gen_settings": SamplerSettings.greedy()}
    if spec.kind == "sampled":
        options = {"gen_settings": sampled}
    elif spec.kind == "json":
        options = {"gen_settings": sampled, "constraint": SCHEMA}
    elif spec.kind == "choice":
        options = {"gen_settings": sampled, "constraint": ["yes", "no", "maybe"]}
    elif spec.kind == "banned":
        options["banned_strings"] = ["the", "a "]
    elif spec.kind == "min_stop":
        options.update(min_new_tokens=3, stop_conditions=[tokenizer.eos_token_id, "."])
    budget = 4 * new_tokens if spec.kind == "json" else new_tokens
    return Job(input_ids=ids, max_new_tokens=budget, seed=spec.seed, identifier=identifier,
               **options)


def bad_job(rng: random.Random, vocab: int) -> Job:
    """A request the engine must refuse at submit: a token id outside the vocabulary."""
    return Job(input_ids=[1, vocab + rng.randrange(1, 10**6), 2], max_new_tokens=4)


def rss_mb() -> float:
    """This process's resident memory now (MB, from /proc)."""
    with open("/proc/self/statm") as f:
        pages = int(f.read().split()[1])
    return pages * resource.getpagesize() / 2**20


class Tally:
    """What the load saw (updated from the event loop and the threads)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.done = self.cancelled = self.finished_before_cancel = self.refused = 0
        self.mismatches: list[str] = []

    def record(self, spec: Spec, final: Any, cancelled: bool, expected: str) -> None:
        with self.lock:
            if final["eos_reason"] == "cancelled":
                self.cancelled += 1
                if not cancelled:
                    self.mismatches.append(f"{spec}: cancelled but nobody cancelled it")
                return
            self.done += 1
            self.finished_before_cancel += cancelled
            if final["full_completion"] != expected:
                self.mismatches.append(f"{spec}: {final['full_completion']!r} != solo "
                                       f"{expected!r} ({final['eos_reason']})")


async def async_requests(engine: Any, specs: list[Spec], reference: dict[Spec, str],
                         args: argparse.Namespace, rng: random.Random, tally: Tally) -> None:
    """``--requests`` requests from one event loop, all in flight at once."""

    async def one(spec: Spec, cancel_after: float | None) -> None:
        handle = engine.submit(build_job(spec, engine.tokenizer, args.new_tokens))
        if cancel_after is not None:
            await asyncio.sleep(cancel_after)
            handle.cancel()
        final = await handle.aresult()
        tally.record(spec, final, cancel_after is not None, reference[spec])

    async def refused() -> None:
        try:
            engine.submit(bad_job(rng, engine.generator.model.config.vocab_size))
        except DynGenError:
            with tally.lock:
                tally.refused += 1
        else:
            with tally.lock:
                tally.mismatches.append("a token id outside the vocabulary was accepted")

    tasks = []
    for _ in range(args.requests):
        cancel = rng.uniform(0.0, 2.0) if rng.random() < args.cancel else None
        tasks.append(one(rng.choice(specs), cancel))
        if rng.random() < 0.02:
            tasks.append(refused())
    await asyncio.gather(*tasks)


def thread_requests(engine: Any, specs: list[Spec], reference: dict[Spec, str],
                    args: argparse.Namespace, seed: int, tally: Tally) -> None:
    """One thread's blocking requests, one after another."""
    rng = random.Random(seed)
    for _ in range(args.per_thread):
        spec = rng.choice(specs)
        handle = engine.submit(build_job(spec, engine.tokenizer, args.new_tokens))
        cancelled = rng.random() < args.cancel
        if cancelled:
            threading.Timer(rng.uniform(0.0, 1.0), handle.cancel).start()
        tally.record(spec, handle.result(timeout=600), cancelled, reference[spec])


def run_round(engine: Any, specs: list[Spec], reference: dict[Spec, str],
              args: argparse.Namespace, round_index: int) -> tuple[Tally, float]:
    tally, rng = Tally(), random.Random(args.seed + round_index)
    threads = [threading.Thread(target=thread_requests,
                                args=(engine, specs, reference, args, rng.random(), tally))
               for _ in range(args.threads)]
    start = time.perf_counter()
    for thread in threads:
        thread.start()
    asyncio.run(async_requests(engine, specs, reference, args, rng, tally))
    for thread in threads:
        thread.join()
    return tally, time.perf_counter() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="model folder (default: the demo model)")
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--threads", type=int, default=32)
    parser.add_argument("--per-thread", type=int, default=4)
    parser.add_argument("--cancel", type=float, default=0.15)
    parser.add_argument("--new-tokens", type=int, default=12)
    parser.add_argument("--specs", type=int, default=48, help="distinct requests in the pool")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--rss-slack-mb", type=float, default=64.0)
    parser.add_argument("--cache-tokens", type=int, default=32768)
    parser.add_argument("--max-batch-size", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.model is None:
        from dyngen_core.cli.convert.demo import fetch_demo_model

        args.model = str(fetch_demo_model())
    engine = shared_generator(Path(args.model), cache_tokens=args.cache_tokens,
                              max_batch_size=args.max_batch_size)
    rng = random.Random(args.seed)
    specs = [Spec(rng.randrange(len(PROMPTS)), KINDS[i % len(KINDS)], rng.randrange(1000))
             for i in range(args.specs)]
    start = time.perf_counter()
    reference = {s: engine.submit(build_job(s, engine.tokenizer, args.new_tokens))
                 .result(timeout=600)["full_completion"] for s in specs}
    print(f"solo references: {len(specs)} specs in {time.perf_counter() - start:.1f} s")
    failures, rss = [], []
    for r in range(args.rounds):
        tally, seconds = run_round(engine, specs, reference, args, r)
        stats = engine.wait_idle(timeout=600)
        gc.collect()
        rss.append(rss_mb())
        total = tally.done + tally.cancelled
        print(f"round {r}: {total} requests ({tally.done} finished, {tally.cancelled} cancelled, "
              f"{tally.finished_before_cancel} finished before their cancel, {tally.refused} "
              f"bad inputs refused) in {seconds:.1f} s; pages referenced "
              f"{stats.pages_referenced}, cached {stats.pages_cached}, free {stats.pages_free}; "
              f"rss {rss[-1]:.0f} MB; mismatches {len(tally.mismatches)}")
        failures += tally.mismatches[:10]
        if stats.pages_referenced:
            failures.append(f"round {r}: {stats.pages_referenced} pages still referenced")
        engine.generator.check_invariant()  # idle: no step runs now
    if rss[-1] - rss[0] > args.rss_slack_mb:
        failures.append(f"resident memory grew {rss[-1] - rss[0]:.0f} MB between rounds")
    engine.close()
    for failure in failures:
        print("FAIL", failure)
    print("load: ok" if not failures else f"load: {len(failures)} failures")
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
