"""How busy the GPU is while the generator runs: the union of kernel intervals over the wall time
of a decode run (torch.profiler), i.e. how much of the host's per-step work still shows.

Runs one job of ``--prompt`` tokens and ``--new-tokens`` new tokens at batch 1 (or ``--jobs``
jobs) through the generator (compiled decode graphs unless ``--no-compile``) and prints the busy
fraction, the largest idle gaps and the kernels launched outside CUDA graphs, per step. The
chrome trace goes to ``--trace`` when given.

    python benchmarks/device_idle.py [--jobs 1] [--new-tokens 64] [--trace trace.json]
"""

from __future__ import annotations

import argparse
from collections import Counter

import torch
from _common import (
    add_common_args,
    add_decode_run_args,
    decode_run_generator,
    random_prompts,
    report,
    run_jobs,
)

Gap = tuple[float, str, str]


def busy_intervals(events: list[tuple[float, float, str]]) -> tuple[float, list[Gap]]:
    """(total busy time, idle gaps as (length, name of the op before, name of the op after))
    of the union of [start, end) intervals of named device ops."""
    busy, gaps = 0.0, list[Gap]()
    current_start = current_end = None
    last_name = ""
    for start, end, name in sorted(events):
        if current_end is None or start > current_end:
            if current_end is not None and current_start is not None:
                busy += current_end - current_start
                gaps.append((start - current_end, last_name, name))
            current_start, current_end = start, end
        elif end <= current_end:
            continue
        else:
            current_end = end
        last_name = name
    if current_start is not None and current_end is not None:
        busy += current_end - current_start
    return busy, gaps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_common_args(parser)
    add_decode_run_args(parser, new_tokens=64)
    parser.add_argument("--trace", default=None)
    args = parser.parse_args()
    generator, vocab = decode_run_generator(args, "it reads kernel times from the profiler")
    run_jobs(generator, random_prompts(args.jobs, args.prompt, vocab, seed=1), 8)
    prompts = random_prompts(args.jobs, args.prompt, vocab, seed=2)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        run = run_jobs(generator, prompts, args.new_tokens)
    if args.trace:
        prof.export_chrome_trace(args.trace)
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    spans = [(e.time_range.start, e.time_range.end, e.name[:70]) for e in kernels]
    busy, gaps = busy_intervals(spans)
    first = min(s for s, _, _ in spans)
    last = max(e for _, e, _ in spans)
    steps = args.new_tokens
    names = Counter(e.name for e in kernels)
    report("device_idle", jobs=args.jobs, new_tokens=args.new_tokens, wall_s=run.wall,
           tok_s=run.new_tokens / run.wall, kernel_span_ms=(last - first) / 1e3,
           busy_fraction=busy / (last - first),
           idle_ms_per_step=(last - first - busy) / 1e3 / steps,
           largest_gaps_us=[round(g[0], 1) for g in sorted(gaps, reverse=True)[:8]],
           common_kernels={k: v for k, v in names.most_common(12)})
    # What borders the gaps: the ops the GPU waited between (by total idle time per pair).
    pairs: Counter[tuple[str, str]] = Counter()
    for length, before, after in gaps:
        pairs[(before, after)] += length
    for (before, after), total in pairs.most_common(8):
        print(f"idle {total / 1e3:8.2f} ms  after {before!r}  before {after!r}")


if __name__ == "__main__":
    main()
