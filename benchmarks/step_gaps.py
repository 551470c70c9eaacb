"""Where a decode step's time goes between CUDA-graph replays, without a profiler's overhead.

Runs ``--jobs`` jobs (default 1: the batch-1 benchmark's shape, 512-token prompts) through the
generator with compiled decode graphs and overlapped steps, and records a CUDA event right
before and right after every graph replay plus the host clock at each replay call. Prints,
as medians over the decode steps:

- ``graph_ms``: the replay's own GPU time;
- ``between_ms``: GPU time from one replay's end to the next one's start (the step's work
  outside the graph: token feed, argmax, id copy back, staging copies, and any wait for the
  host);
- ``host_interval_ms``: host time between consecutive replay calls, and the host time spent in
  each of the generator's phases (schedule, runner.run, resolve+emit, launch of sampling).

If ``between_ms`` is far above the few small ops' GPU time, the GPU waited for the host. Then
``--sync-debug`` reruns a few steps with ``torch.cuda.set_sync_debug_mode("warn")`` and lists
the code lines that synchronized with the device.

    python benchmarks/step_gaps.py [--jobs 1] [--new-tokens 128] [--sync-debug]
"""

from __future__ import annotations

import argparse
import statistics
import time
import traceback
import warnings
from collections import Counter
from typing import Any

import torch
from _common import (
    add_common_args,
    add_decode_run_args,
    decode_run_generator,
    random_prompts,
    report,
    run_jobs,
)


class TimedGraph:
    """Stands in for a captured CUDAGraph: records events around each replay."""

    def __init__(self, graph: torch.cuda.CUDAGraph, log: list[tuple[Any, Any, float]]) -> None:
        self.graph = graph
        self.log = log

    def replay(self) -> None:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        host = time.perf_counter()
        start.record()
        self.graph.replay()
        end.record()
        self.log.append((start, end, host))


class TimedDict(dict):  # type: ignore[type-arg]
    """The graphs' dict of captured graphs, wrapping each graph as it is captured."""

    def __init__(self, log: list[tuple[Any, Any, float]]) -> None:
        super().__init__()
        self.log = log

    def __setitem__(self, key: Any, value: Any) -> None:
        if not isinstance(value, TimedGraph):
            value = TimedGraph(value, self.log)
        super().__setitem__(key, value)


def time_phases(generator: Any, phases: dict[str, list[float]]) -> None:
    """Wrap the generator's per-step phases to collect host seconds per call."""
    def wrap(owner: Any, name: str, label: str) -> None:
        inner = getattr(owner, name)

        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                phases.setdefault(label, []).append(time.perf_counter() - start)
        setattr(owner, name, timed)

    wrap(generator, "iterate", "iterate")
    wrap(generator._scheduler, "schedule", "schedule")
    wrap(generator._runner, "run", "runner.run")
    wrap(generator, "_resolve", "resolve+emit")
    wrap(generator, "_launch", "launch")


def median_ms(values: list[float]) -> float:
    return statistics.median(values) * 1e3 if values else 0.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_common_args(parser)
    add_decode_run_args(parser, new_tokens=128)
    parser.add_argument("--sync-debug", action="store_true")
    args = parser.parse_args()
    generator, vocab = decode_run_generator(args, "it times graph replays with CUDA events")
    log: list[tuple[Any, Any, float]] = []
    graphs = generator._runner.graphs
    timed = TimedDict(log)
    for key, graph in graphs._graphs.items():
        timed[key] = graph
    graphs._graphs = timed
    run_jobs(generator, random_prompts(args.jobs, args.prompt, vocab, seed=1), 8)
    phases: dict[str, list[float]] = {}
    time_phases(generator, phases)
    log.clear()
    run = run_jobs(generator, random_prompts(args.jobs, args.prompt, vocab, seed=2),
                   args.new_tokens)
    torch.cuda.synchronize()
    steps = log[2:]  # the first replays follow the prefill
    graph_ms = [s.elapsed_time(e) for s, e, _ in steps]
    between_ms = [e.elapsed_time(s2) for (_, e, _), (s2, _, _) in zip(steps, steps[1:])]
    host_ms = [(h2 - h) * 1e3 for (_, _, h), (_, _, h2) in zip(steps, steps[1:])]
    report("step_gaps", jobs=args.jobs, new_tokens=args.new_tokens,
           tok_s=run.new_tokens / run.wall, steps=len(steps),
           graph_ms=statistics.median(graph_ms), between_ms=statistics.median(between_ms),
           between_p90_ms=sorted(between_ms)[int(0.9 * len(between_ms))],
           host_interval_ms=statistics.median(host_ms),
           phases_ms={k: round(median_ms(v), 4) for k, v in phases.items()})
    if args.sync_debug:
        list_syncs(generator, args, vocab)


def list_syncs(generator: Any, args: argparse.Namespace, vocab: int) -> None:
    """Run a few steps with CUDA sync debugging on; print where the host synchronized."""
    places: Counter[str] = Counter()
    original = warnings.showwarning

    def record(message: Any, category: Any, filename: str, lineno: int, *rest: Any) -> None:
        stack = [f for f in traceback.extract_stack()[:-1] if "dyngen_core" in f.filename]
        where = " <- ".join(f"{f.filename.split('dyngen_core/')[-1]}:{f.lineno}"
                            for f in stack[-3:][::-1])
        places[f"{str(message)[:60]} @ {where}"] += 1

    warnings.showwarning = record
    warnings.simplefilter("always")
    torch.cuda.set_sync_debug_mode("warn")
    try:
        run_jobs(generator, random_prompts(args.jobs, args.prompt, vocab, seed=3), 16)
    finally:
        torch.cuda.set_sync_debug_mode("default")
        warnings.showwarning = original
    for place, count in places.most_common(15):
        print(f"sync x{count:4d}  {place}")


if __name__ == "__main__":
    main()
