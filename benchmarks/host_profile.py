"""Where the host step's time goes with 256 running jobs, with the sampler taken out.

`host_overhead.py` measures the host part of a step (``host_ms``) next to a real sampler; on a
CPU that sampler (an argmax or a top-k over [256, 128256] logits) takes 40-60 ms and flushes
the CPU's caches every step, so the host part of greedy and top-p steps looks alike there. This
harness drives the same generator with the same stand-in model, but the sampler is replaced by
a stub that hands back precomputed tokens in microseconds, so only the host's own work is
timed, with caches as warm as the host's own work leaves them (as on a GPU machine).

Each case is ``settings:tokens``; the token stream and the settings are chosen apart, to
tell the two effects apart:

- settings ``greedy`` or ``top_p`` (temperature 0.8, top-p 0.9, top-k 50): greedy jobs go
  through the plain greedy path of `StepSampler.start`, top-p ones through its device draw
  (the stub draws nothing either way).
- tokens ``fixed``, ``topk`` or ``vocab``: each job repeats its row's argmax (what greedy emits
  on the fixed logits), draws from its row's top-50 at temperature 0.8 / top-p 0.9 (what the
  top-p sampler emits), or draws uniformly from the whole vocabulary.

    python benchmarks/host_profile.py [--jobs 256] [--vocab 128256] [--steps 20] [--rounds 10]
        [--cases greedy:fixed,top_p:topk,greedy:topk,top_p:fixed] [--phases] [--profile 25]

The cases take turns (``--rounds`` blocks of ``--steps`` steps each) so that other load on a
shared machine falls on all of them alike. Prints one line per case: the median host time per
step (ms) and per job (us); ``--phases`` adds the median time of each part of the step
(schedule, sample, apply, resolve, emit); ``--profile N`` prints the N costliest
functions (cProfile, total time) of each case.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import pstats
import time
from collections.abc import Callable
from typing import Any

import torch
from _common import GREEDY, word_tokenizer

from dyngen_core import Cache, DynamicGenerator, Job, Model, SamplerSettings
from dyngen_core.config import ModelConfig
from dyngen_core.engine.plan import StepPlan

SETTINGS = {"greedy": GREEDY, "top_p": SamplerSettings(temperature=0.8, top_p=0.9, top_k=50)}


class StubSampler:
    """Stands in for `Sampler` in overlapped steps: each call hands out the next row of a
    precomputed [steps, jobs] token table (no tensor math on the logits)."""

    def __init__(self, table: torch.Tensor) -> None:
        self._table = table
        self._step = 0

    def _next(self, rows: int) -> torch.Tensor:
        ids = self._table[self._step % self._table.shape[0], :rows]
        self._step += 1
        return ids

    def greedy_on_device(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(ids the next step reads, ids for the host): the same precomputed ids."""
        ids = self._next(logits.shape[0])
        return ids, ids

    def launch_tokens(self, logits: torch.Tensor, requests: Any, *, kept: bool = False
                      ) -> torch.Tensor:
        """The precomputed ids of this step's rows."""
        return self._next(logits.shape[0])


class TinyLogitsRunner:
    """Stands in for `ModelRunner`: one logits row per sampling slice, no forward (the stub
    sampler never reads them)."""

    def __init__(self, rows: int) -> None:
        self.logits = torch.zeros(rows, 1)

    def run(self, plan: StepPlan, feed: object = None) -> torch.Tensor | None:
        """Rows for ``plan``'s sampling slices; ``feed`` is ignored."""
        rows = sum([1 + len(s.draft_ids) for s in plan.slices if s.sample])
        return self.logits[:rows] if rows else None


def token_table(kind: str, jobs: int, vocab: int, steps: int) -> torch.Tensor:
    """[steps, jobs] int64 tokens: the rows' argmax (``fixed``), draws from each row's top-50 at
    temperature 0.8 and top-p 0.9 (``topk``), or uniform draws over the vocabulary (``vocab``).
    The logits are `host_overhead.FixedLogitsRunner`'s on the CPU (seed 0)."""
    generator = torch.Generator().manual_seed(0)
    if kind == "vocab":
        return torch.randint(10, vocab, (steps, jobs), generator=generator)
    logits = torch.randn(jobs, vocab, generator=torch.Generator().manual_seed(0))
    if kind == "fixed":
        return logits.argmax(-1).expand(steps, jobs).contiguous()
    values, ids = logits.topk(50, dim=-1)
    probs = torch.softmax(values / 0.8, dim=-1)
    keep = probs.cumsum(-1) - probs < 0.9  # top-p: the smallest head holding 0.9
    probs = torch.where(keep, probs, torch.zeros_like(probs))
    draws = torch.multinomial(probs, steps, replacement=True, generator=generator)  # [jobs, steps]
    return ids.gather(1, draws).T.contiguous()


class PhaseClock:
    """Wraps a bound method and adds up the wall time spent in it (ns)."""

    def __init__(self, method: Callable[..., Any]) -> None:
        self._method = method
        self.ns = 0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter_ns()
        try:
            return self._method(*args, **kwargs)
        finally:
            self.ns += time.perf_counter_ns() - start


PHASES = {"schedule": ("_scheduler", "schedule"), "sample": ("_sampler", "start"),
          "apply": ("_scheduler", "apply_tokens"), "resolve": ("_scheduler", "resolve_tokens"),
          "emit": (None, "_emit_rows")}


def build(jobs: int, vocab: int, settings: SamplerSettings, tokens: torch.Tensor,
          tokenizer: Any) -> DynamicGenerator:
    """A generator with ``jobs`` running jobs over the stand-in model and the stub sampler."""
    config = ModelConfig(architecture="LlamaForCausalLM", vocab_size=vocab, hidden_size=64,
                         intermediate_size=64, num_layers=1, num_heads=2, num_kv_heads=1,
                         head_dim=32, max_position_embeddings=8192)
    model = Model(config, device=torch.device("cpu"), dtype=torch.float32)
    cache = Cache(model, max_tokens=jobs * 1024, mode="fp16")
    generator = DynamicGenerator(model=model, cache=cache, tokenizer=tokenizer,
                                 max_batch_size=jobs, attention_backend="sdpa")
    generator._runner = TinyLogitsRunner(jobs)  # type: ignore[assignment,unused-ignore]
    generator._sampler.sampler = StubSampler(tokens)  # type: ignore[assignment,unused-ignore]
    generator.enqueue([Job(input_ids=[100 + i, 200 + i, 300 + i], max_new_tokens=1000,
                           stop_conditions=["t1 t2 t3", 5], gen_settings=settings,
                           identifier=i) for i in range(jobs)])
    for _ in range(10):  # admission, prefill, first decodes
        generator.iterate()
    return generator


def instrument(generator: DynamicGenerator) -> dict[str, PhaseClock]:
    """Wrap the parts of ``generator``'s step (`PHASES`) in clocks."""
    clocks: dict[str, PhaseClock] = {}
    for name, (owner_name, method) in PHASES.items():
        owner = generator if owner_name is None else getattr(generator, owner_name)
        clocks[name] = PhaseClock(getattr(owner, method))
        setattr(owner, method, clocks[name])
    return clocks


def run_block(generator: DynamicGenerator, steps: int, clocks: dict[str, PhaseClock],
              samples: dict[str, list[int]], profiler: cProfile.Profile | None) -> None:
    """Time ``steps`` iterate calls; append each step's ns to ``samples["host"]`` (and each
    phase's to ``samples[phase]``)."""
    for _ in range(steps):
        for clock in clocks.values():
            clock.ns = 0
        if profiler is not None:
            profiler.enable()
        start = time.perf_counter_ns()
        generator.iterate()
        samples["host"].append(time.perf_counter_ns() - start)
        if profiler is not None:
            profiler.disable()
        for name, clock in clocks.items():
            samples[name].append(clock.ns)


def _median(values: list[int]) -> float:
    return sorted(values)[len(values) // 2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jobs", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--cases", default="greedy:fixed,top_p:topk,greedy:topk,top_p:fixed",
                        help="settings:tokens pairs")
    parser.add_argument("--rounds", type=int, default=10,
                        help="turns each case takes (--steps steps each)")
    parser.add_argument("--phases", action="store_true", help="time each part of the step")
    parser.add_argument("--profile", type=int, default=0, help="print the N costliest functions")
    args = parser.parse_args()
    torch.set_num_threads(1)
    tokenizer = word_tokenizer(args.vocab)
    tokenizer.token_pieces()  # the shared table, built once (as a server does at start)
    cases = args.cases.split(",")
    generators: dict[str, DynamicGenerator] = {}
    clocks: dict[str, dict[str, PhaseClock]] = {}
    samples: dict[str, dict[str, list[int]]] = {}
    profilers: dict[str, cProfile.Profile | None] = {}
    for case in cases:
        settings, kind = case.split(":")
        table = token_table(kind, args.jobs, args.vocab, args.steps * args.rounds + 20)
        generators[case] = build(args.jobs, args.vocab, SETTINGS[settings], table, tokenizer)
        clocks[case] = instrument(generators[case]) if args.phases else {}
        samples[case] = {name: [] for name in ("host", *clocks[case])}
        profilers[case] = cProfile.Profile() if args.profile else None
    gc.collect()
    # Cases take turns, a block of steps each, so a load that comes and goes on a shared
    # machine falls on all of them alike.
    for _ in range(args.rounds):
        for case in cases:
            run_block(generators[case], args.steps, clocks[case], samples[case],
                      profilers[case])
    for case in cases:
        profiler = profilers[case]
        if profiler is not None:
            print(f"---- {case}")
            pstats.Stats(profiler).sort_stats("tottime").print_stats(args.profile)
        figures = {f"{name}_ms": _median(v) / 1e6 for name, v in samples[case].items()}
        per_job_us = figures["host_ms"] * 1e3 / args.jobs
        shown = " ".join(f"{k}={v:.3f}" for k, v in figures.items())
        print(f"{case:14s} per_job_us={per_job_us:.2f} jobs={generators[case].stats().jobs_active}"
              f" {shown}", flush=True)

if __name__ == "__main__":
    main()
