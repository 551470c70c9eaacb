"""Where a workload's wall time goes, step by step: the forward (synchronized before and after,
so it is the device time of the step's kernels plus their launch) against everything else in
`DynamicGenerator.iterate` (scheduling, sampling, emitting), split by step kind.

Step kinds: ``decode`` (every slice one token), ``prefill`` (no decode slice), ``mixed``.
Synchronizing around the forward stops the host from running ahead of the device: the
generator's step overlap (``overlap_steps``) cannot hide host work here, so ``other`` is the
host time an overlapped run has to hide.

    python benchmarks/step_breakdown.py --workload throughput|shared-doc|shared-nodoc|batch1
        [--compile-decode]
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict
from typing import Any

import torch
from _common import (
    add_common_args,
    bench_config,
    cache_tokens_for,
    make_generator,
    random_model,
    random_prompts,
    report,
    run_jobs,
    synchronize,
    word_tokenizer,
)

from dyngen_core.engine.plan import StepPlan

WORKLOADS: dict[str, dict[str, Any]] = {
    "throughput": {"prompts": 256, "length": 512, "new": 128, "chunk": 16384},
    "shared-doc": {"prompts": 64, "length": 30, "new": 128, "chunk": 16384, "document": 8000},
    "shared-nodoc": {"prompts": 64, "length": 30, "new": 128, "chunk": 16384},
    "batch1": {"prompts": 1, "length": 512, "new": 256, "chunk": 2048},
}


def step_kind(plan: StepPlan) -> str:
    lengths = [len(s.token_ids) for s in plan.slices]
    if all(n == 1 for n in lengths):
        return "decode"
    return "mixed" if any(n == 1 for n in lengths) else "prefill"


class TimedRunner:
    """Wraps a generator's runner: times each forward between two synchronizations."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.records: list[tuple[str, int, int, float]] = []

    def run(self, plan: StepPlan, feed: Any = None) -> torch.Tensor | None:
        synchronize()
        start = time.perf_counter()
        logits = self.inner.run(plan, feed)
        synchronize()
        tokens = sum(len(s.token_ids) for s in plan.slices)
        self.records.append((step_kind(plan), len(plan.slices), tokens,
                             time.perf_counter() - start))
        return logits


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_common_args(parser)
    parser.add_argument("--workload", choices=sorted(WORKLOADS), default="throughput")
    parser.add_argument("--compile-decode", action="store_true")
    parser.add_argument("--repeat", type=int, default=1,
                        help="run the workload this many times (new prompts each time): "
                             "one-time costs show as a difference between runs")
    args = parser.parse_args()
    spec = WORKLOADS[args.workload]
    device = torch.device(args.device)
    config = bench_config(args)
    vocab = config["vocab_size"]
    model = random_model(config, device)
    runs = [workload_prompts(spec, vocab, seed=2 * run) for run in range(args.repeat)]
    generator = make_generator(model, word_tokenizer(vocab),
                               cache_tokens=cache_tokens_for(runs[0], spec["new"]),
                               max_batch_size=len(runs[0]), max_chunk_size=spec["chunk"],
                               compile_decode=args.compile_decode)
    run_jobs(generator, random_prompts(2, 64, vocab, seed=99), 4)
    timed = TimedRunner(generator._runner)
    generator._runner = timed  # type: ignore[assignment]
    iterate = generator.iterate
    steps: list[float] = []

    def timed_iterate() -> list[Any]:
        start = time.perf_counter()
        out = iterate()
        steps.append(time.perf_counter() - start)
        return out

    generator.iterate = timed_iterate  # type: ignore[method-assign]
    for index, prompts in enumerate(runs):
        timed.records.clear()
        steps.clear()
        run = run_jobs(generator, prompts, spec["new"])
        name = args.workload if index == 0 else f"{args.workload}.run{index + 1}"
        summarize(name, run.wall, run.new_tokens, timed.records, steps)


def workload_prompts(spec: dict[str, Any], vocab: int, seed: int) -> list[list[int]]:
    """The workload's prompts (a shared document, if any, first in each)."""
    prompts = random_prompts(spec["prompts"], spec["length"], vocab, seed=seed + 6)
    if "document" in spec:
        document = random_prompts(1, spec["document"], vocab, seed=seed + 5)[0]
        prompts = [document + p for p in prompts]
    return prompts


def summarize(name: str, wall: float, new_tokens: int, records: list[tuple[str, int, int, float]],
              steps: list[float]) -> None:
    by_kind: dict[str, list[float]] = defaultdict(lambda: [0, 0.0, 0, 0])
    for kind, seqs, tokens, seconds in records:
        entry = by_kind[kind]
        entry[0] += 1
        entry[1] += seconds
        entry[2] += tokens
        entry[3] += seqs
    forward = sum(r[3] for r in records)
    total = sum(steps)
    report(f"step_breakdown.{name}", wall_s=wall, tok_s=new_tokens / wall, steps=len(steps),
           iterate_s=total, forward_s=forward, other_s=total - forward,
           other_ms_per_step=(total - forward) / max(1, len(steps)) * 1e3)
    for kind, (count, seconds, tokens, seqs) in sorted(by_kind.items()):
        report(f"step_breakdown.{name}.{kind}", steps=count, forward_s=seconds,
               ms_per_step=seconds / count * 1e3, tokens_per_step=tokens / count,
               seqs_per_step=seqs / count)


if __name__ == "__main__":
    main()
