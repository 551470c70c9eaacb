"""Where the shared document's added time goes, step by step (the workload of
`shared_document.py`: 64 ~30-token questions, with and without one 8,000-token document, 128
new tokens each, after the same warm-up).

For each case, a new generator per run: every `iterate()` timed on the host with its plan's
make-up (slices, tokens, prefill chunks); the steps over ``--slow-ms`` also list the CUDA graphs
captured, the Triton kernels compiled (files that appeared in ``TRITON_CACHE_DIR``, when it is
set) and the garbage collections during them. Then one run under torch.profiler: the GPU's busy
time (the union of its kernels) against the run's span, and its idle gaps of 5 us or more by
step and by the innermost host operation running when each began (host time that the device
waited for).

    TRITON_CACHE_DIR=/tmp/fresh python3 benchmarks/shared_document_steps.py [--runs 2]
"""

from __future__ import annotations

import argparse
import gc
import glob
import os
import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import torch
from _common import (
    GREEDY,
    add_common_args,
    bench_config,
    cache_tokens_for,
    free_memory,
    make_generator,
    random_model,
    random_prompts,
    synchronize,
    word_tokenizer,
)
from shared_document import DOCUMENT, NEW, QUESTION, warm_up

from dyngen_core import DynamicGenerator, Job
from dyngen_core.engine.plan import StepPlan


@dataclass
class Step:
    index: int
    seconds: float
    plan: str


def compiled_kernels() -> set[str]:
    """The compiled kernels in Triton's cache directory (``TRITON_CACHE_DIR``; empty when unset)."""
    root = os.environ.get("TRITON_CACHE_DIR")
    if not root:
        return set()
    return {os.path.relpath(path, root) for path in glob.glob(f"{root}/*/*.cubin")}


def build(model: Any, tokenizer: Any, prompts: list[list[int]]) -> DynamicGenerator:
    """The benchmark's generator and warm-up (`shared_document.run_case`)."""
    start = time.perf_counter()
    generator = make_generator(model, tokenizer, cache_tokens=cache_tokens_for(prompts, NEW),
                               max_batch_size=len(prompts), max_chunk_size=16384)
    print(f"  generator built (cache, graphs, start-up prefills) in "
          f"{time.perf_counter() - start:.2f} s")
    warm_up(generator, model.config.vocab_size, len(prompts))
    return generator


def describe(plan: StepPlan | None) -> str:
    if plan is None:
        return "no plan"
    tokens = sum(len(s.token_ids) for s in plan.slices)
    chunks = sum(1 for s in plan.slices if len(s.token_ids) > 1)
    return f"{len(plan.slices)} slices, {tokens} tokens, {chunks} prefill chunks"


def run(generator: DynamicGenerator, prompts: list[list[int]], new: int,
        slow_ms: float | None, label: str = "") -> tuple[float, list[Step]]:
    """Run one greedy job per prompt to the end (each step in a profiler range ``label`` +
    ``step<i>``); the wall time and, with ``slow_ms``, every step's record."""
    jobs = [Job(input_ids=p, max_new_tokens=new, min_new_tokens=new, stop_conditions=[],
                gen_settings=GREEDY, identifier=i) for i, p in enumerate(prompts)]
    scheduler = generator._scheduler
    plans: list[StepPlan] = []
    schedule = scheduler.schedule
    scheduler.schedule = lambda: plans.append(schedule()) or plans[-1]  # type: ignore[method-assign]
    collections = [0]

    def count(phase: str, info: dict[str, int]) -> None:
        collections[0] += phase == "start"

    gc.callbacks.append(count)
    steps: list[Step] = []
    synchronize()
    start = time.perf_counter()
    generator.enqueue(jobs)
    while generator.num_remaining_jobs():
        captures = generator._runner.graph_captures
        kernels = compiled_kernels() if slow_ms is not None else set()
        collected = collections[0]
        began = time.perf_counter()
        with torch.profiler.record_function(f"{label}step{len(steps)}"):
            generator.iterate()
        seconds = time.perf_counter() - began
        plan = describe(plans[-1] if plans else None)
        if slow_ms is not None and seconds * 1e3 > slow_ms:
            plan += (f" | graphs captured {generator._runner.graph_captures - captures}, "
                     f"compiled {sorted(compiled_kernels() - kernels)}, "
                     f"collections {collections[0] - collected}")
        steps.append(Step(len(steps), seconds, plan))
    synchronize()
    wall = time.perf_counter() - start
    gc.callbacks.remove(count)
    del scheduler.schedule
    return wall, steps


def print_steps(steps: list[Step], slow_ms: float) -> None:
    for step in steps:
        if step.index < 4 or step.seconds * 1e3 > slow_ms:
            print(f"    step {step.index}: {step.seconds * 1e3:.2f} ms, {step.plan}")
    rest = sorted(s.seconds for s in steps[8:])
    if rest:
        print(f"    steps 8 on: median {rest[len(rest) // 2] * 1e3:.3f} ms, mean "
              f"{sum(rest) / len(rest) * 1e3:.3f}, max {rest[-1] * 1e3:.2f}")


def idle_gaps(profile: Any, label: str) -> None:
    """The GPU's busy time over the run and its idle gaps, by step and by host operation."""
    events = profile.events()
    kernels = sorted((e.time_range.start, e.time_range.end) for e in events
                     if e.device_type == torch.autograd.DeviceType.CUDA)
    steps = sorted((e.time_range.start, e.time_range.end, e.name) for e in events
                   if e.name.startswith(label + "step"))
    host = [(e.time_range.start, e.time_range.end, e.name) for e in events
            if e.device_type == torch.autograd.DeviceType.CPU
            and not e.name.startswith(label + "step")]
    if not kernels or not steps:
        print("    no kernels recorded (not on CUDA)")
        return
    busy, gaps = 0.0, []
    first, last = kernels[0]
    for begin, end in kernels[1:]:
        if begin > last:
            busy += last - first
            gaps.append((last, begin))
            first, last = begin, end
        else:
            last = max(last, end)
    busy += last - first
    print(f"    steps span {(steps[-1][1] - steps[0][0]) / 1e3:.1f} ms, GPU busy "
          f"{busy / 1e3:.1f} ms ({len(kernels)} kernels)")
    by_step: dict[str, float] = defaultdict(float)
    by_op: dict[str, float] = defaultdict(float)
    for begin, end in gaps:
        if end - begin < 5:
            continue
        step = next((name for a, b, name in steps if a <= begin < b), "between steps")
        running = [(b - a, name) for a, b, name in host if a <= begin < b]
        by_step[step] += end - begin
        by_op[min(running)[1] if running else "?"] += end - begin
    print(f"    idle gaps of 5 us or more: {sum(by_step.values()) / 1e3:.2f} ms")
    for title, table in (("by step", by_step), ("by host operation", by_op)):
        top = sorted(table.items(), key=lambda item: -item[1])[:8]
        print(f"    {title}: " + ", ".join(f"{name} {us / 1e3:.2f} ms" for name, us in top))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    add_common_args(parser)
    parser.add_argument("--questions", type=int, default=64)
    parser.add_argument("--runs", type=int, default=2, help="unprofiled runs per case")
    parser.add_argument("--slow-ms", type=float, default=15.0,
                        help="print the steps slower than this, with what happened in them")
    args = parser.parse_args()
    config = bench_config(args)
    vocab = config["vocab_size"]
    document = random_prompts(1, DOCUMENT, vocab, seed=5)[0]
    questions = random_prompts(args.questions, QUESTION, vocab, seed=6)
    model = random_model(config, torch.device(args.device))
    tokenizer = word_tokenizer(vocab)
    for name, prompts in (("no_document", questions),
                          ("dedup", [document + q for q in questions])):
        for index in range(args.runs):
            before = compiled_kernels()
            generator = build(model, tokenizer, prompts)
            warmed = compiled_kernels()
            wall, steps = run(generator, prompts, NEW, args.slow_ms)
            late = sorted(compiled_kernels() - warmed)
            print(f"{name} run {index + 1}: wall {wall:.3f} s; kernels compiled while building "
                  f"{len(warmed - before)}, in the timed run {late}")
            print_steps(steps, args.slow_ms)
            del generator
            free_memory()
        generator = build(model, tokenizer, prompts)
        activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        with torch.profiler.profile(activities=activities) as profile:
            wall, _ = run(generator, prompts, NEW, None, label=name)
        print(f"{name} under the profiler: wall {wall:.3f} s")
        idle_gaps(profile, name)
        del generator, profile
        free_memory()


if __name__ == "__main__":
    main()
