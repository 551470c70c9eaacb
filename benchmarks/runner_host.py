"""Host time of a graphed decode step in the runner, 256 jobs: what `ModelRunner.run` does on
the host before it copies the step's inputs and replays a CUDA graph (`StepGraphs`).

`host_overhead.py` measures the scheduler, sampler and emitter around a stand-in runner; this
measures what the stand-in leaves out. A real `Scheduler` plans steady decode steps of
``--jobs`` jobs with ``--prompt``-token prompts (their pages crossed as they grow), and each
step is timed through: the graph check (`graphs.decode_query_len`), the staging of its inputs
into buffers shaped like the graphs' (`graphs.DecodeStaging`) and the shared-prefix planning
the Triton backend's graphs ask for every step (`cascade.SharedPrefixTracker`). Pure host
work: it runs on the CPU, and the figures are the CPU's. ``--drafts K`` times verify steps
instead (each job its token and K drafts, staged by `DecodeStaging.stage_verify`; a graphed
verify step holds at most `graphs.MAX_VERIFY_TOKENS` tokens, so at most 512 / (K + 1) jobs;
the shared-prefix planner takes decodes only and is not timed then).

    python benchmarks/runner_host.py [--jobs 256] [--prompt 512] [--steps 300] [--drafts K]

``check_ms``, ``stage_ms``, ``cascade_ms``: the medians of each part; ``total_ms`` the median
of their sum per step.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import replace

from _common import report

from dyngen_core.config import CacheConfig, SchedulerConfig
from dyngen_core.engine.cascade import SharedPrefixTracker
from dyngen_core.engine.scheduler import Scheduler
from dyngen_core.runtime.graphs import (
    MAX_VERIFY_TOKENS,
    DecodeStaging,
    DecodeViews,
    decode_query_len,
)

PAGE_SIZE = 256


def decoding_scheduler(jobs: int, prompt: int, steps: int, drafts: int = 0) -> Scheduler:
    """A scheduler with ``jobs`` distinct prompts prefilled: every later plan is a decode."""
    total = jobs * (prompt + steps + 2 * PAGE_SIZE)
    scheduler = Scheduler(CacheConfig(max_tokens=total, page_size=PAGE_SIZE),
                          SchedulerConfig(max_batch_size=jobs, max_chunk_size=jobs * prompt))
    for job in range(jobs):
        scheduler.add(job, [1 + (job * 7919 + i) % 30000 for i in range(prompt)],
                      steps + drafts + 8, num_draft_tokens=drafts)
    for _ in range(4):
        plan = scheduler.schedule()
        if all(len(s.token_ids) == 1 for s in plan.slices):
            break
        scheduler.apply_tokens(plan, [5] * sum(s.sample for s in plan.slices))
    return scheduler


def measure(jobs: int, prompt: int, steps: int, drafts: int = 0) -> dict[str, float]:
    scheduler = decoding_scheduler(jobs, prompt, steps, drafts)
    width = -(-(prompt + steps + drafts + 16) // PAGE_SIZE)
    staging = DecodeStaging(DecodeViews.zeros(jobs, width, max(jobs, MAX_VERIFY_TOKENS)),
                            PAGE_SIZE)
    tracker = SharedPrefixTracker(PAGE_SIZE)
    max_context = width * PAGE_SIZE
    parts: dict[str, list[float]] = {"check": [], "stage": [], "cascade": [], "total": []}
    clock = time.perf_counter
    for step in range(steps):
        plan = scheduler.schedule()
        slices = plan.slices
        if drafts:  # the same decodes carrying drafts (the scheduler made room for them)
            slices = [replace(s, draft_ids=list(range(5, 5 + drafts))) for s in slices]
        start = clock()
        query_len = decode_query_len(slices, max_context)
        checked = clock()
        if drafts:
            staging.stage_verify(slices, len(slices), drafts + 1)
        else:
            staging.stage(slices, len(slices), None)
        staged = clock()
        if not drafts:
            tracker.plan(slices)
        end = clock()
        if query_len != 1 + drafts or len(slices) != jobs:
            raise RuntimeError(f"step {step} is not a decode of every job")
        parts["check"].append(checked - start)
        parts["stage"].append(staged - checked)
        parts["cascade"].append(end - staged)
        parts["total"].append(end - start)
        scheduler.apply_tokens(plan, [7] * len(slices))
    return {f"{name}_ms": sorted(values)[len(values) // 2] * 1e3
            for name, values in parts.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--jobs", type=int, default=256)
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--drafts", type=int, default=0,
                        help="time verify steps of this many drafts a job")
    args = parser.parse_args()
    if args.drafts and args.jobs * (args.drafts + 1) > MAX_VERIFY_TOKENS:
        parser.error(f"a graphed verify step holds {MAX_VERIFY_TOKENS} tokens: at most "
                     f"{MAX_VERIFY_TOKENS // (args.drafts + 1)} jobs of {args.drafts} drafts")
    name = "runner_host.verify_step" if args.drafts else "runner_host.decode_step"
    report(name, device="cpu", jobs=args.jobs, prompt=args.prompt, drafts=args.drafts,
           **measure(args.jobs, args.prompt, args.steps, args.drafts))


if __name__ == "__main__":
    main()
