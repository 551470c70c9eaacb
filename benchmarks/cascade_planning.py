"""Host time of shared-prefix ("cascade") planning and table filling per CUDA-graph decode step.

Every graphed decode step plans its shared prefixes and, when a plan pays, writes the graph's
static table region (`GraphCascade.stage`, what `StepGraphs.run` calls: `GraphCascade.plan`,
then `StaticCascadeLayout.write`). This times both over 128 decode steps of 256 running jobs, as
the scheduler would plan them (each slice a fresh copy of its job's page table), for four
workloads:

- ``document``: 256 questions on one 31-page (7,936-token) document;
- ``documents8``: 8 documents of 16-31 pages, 32 questions each;
- ``system64``: a 2-page system prompt, then 64 conversations of 2-8 pages, 4 jobs each;
- ``none``: nothing shared.

Jobs are staggered (each at its own point of its answer), grow a page every 256 tokens, and end
after 1-512 new tokens (``--max-new``), a new job of the same workload taking the slot (about one
job ends every other step: the churn of a busy server); ``--max-new 0`` runs without churn.
The steps are drawn first, then run ``--repeat`` times through a fresh planner; each step's
fastest run counts (a busy machine's noise only adds time). Reports the median, mean, 90th
percentile and slowest step in microseconds, the steps that planned a cascade, and the key
reads their plans save in total (to check the plans, not just the time).

    python benchmarks/cascade_planning.py [--jobs 256] [--steps 128] [--max-new 512] [--seed 0]
        [--repeat 5] [--workloads document,documents8,system64,none]
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from types import SimpleNamespace
from typing import cast

import numpy as np
from _common import report

from dyngen_core.engine.cascade import CascadePolicy
from dyngen_core.engine.plan import SequenceSlice, StepPlan
from dyngen_core.kv.attention.triton.cascade_path import CascadePath
from dyngen_core.kv.storage import KVStorage

PAGE = 256
WORKLOADS = ("document", "documents8", "system64", "none")


@dataclass
class _Job:
    job_id: int
    table: list[int]
    pos: int  # the next decode's position
    left: int  # decodes before it ends


class Workload:
    """Page tables of running jobs as prefix dedup shapes them, advanced one decode at a time.

    kind: one of ``WORKLOADS``; jobs: running jobs; max_new: most new tokens of a job (0: jobs
    never end); seed: the random draws.
    """

    def __init__(self, kind: str, jobs: int, max_new: int, seed: int) -> None:
        self.rng = random.Random(seed)
        self.max_new = max_new
        self._next_page = 0
        self._next_job = 0
        self.prefixes = self._prefixes(kind, jobs)
        self.jobs = [self._job(i % len(self.prefixes), staggered=True) for i in range(jobs)]

    def _pages(self, count: int) -> list[int]:
        self._next_page += count
        return list(range(self._next_page - count, self._next_page))

    def _prefixes(self, kind: str, jobs: int) -> list[list[int]]:
        rng = self.rng
        if kind == "document":
            return [self._pages(31)]
        if kind == "documents8":
            return [self._pages(rng.randint(16, 31)) for _ in range(8)]
        if kind == "system64":
            system = self._pages(2)
            return [system + self._pages(rng.randint(2, 8)) for _ in range(64)]
        if kind == "none":
            return [[] for _ in range(jobs)]
        raise ValueError(f"unknown workload {kind!r}; choose from {', '.join(WORKLOADS)}")

    def _job(self, prefix: int, *, staggered: bool) -> _Job:
        rng = self.rng
        shared = self.prefixes[prefix]
        prompt = len(shared) * PAGE + rng.randint(16, 300)
        total = rng.randint(1, self.max_new) if self.max_new else 1 << 30
        done = rng.randint(0, min(total - 1, 600)) if staggered else 0
        pos = prompt + done
        table = list(shared) + self._pages(pos // PAGE + 1 - len(shared))
        self._next_job += 1
        return _Job(self._next_job, table, pos, total - done)

    def plan(self) -> StepPlan:
        """This step's decodes, each slice holding a copy of its job's page table."""
        return StepPlan(slices=[SequenceSlice(job.job_id, [1], job.pos, job.table[:], True)
                                for job in self.jobs])

    def advance(self) -> None:
        """Every job decodes one token; finished jobs give their place to new ones."""
        for index, job in enumerate(self.jobs):
            job.pos += 1
            job.left -= 1
            if job.left <= 0:
                self.jobs[index] = self._job(self.rng.randrange(len(self.prefixes)),
                                             staggered=False)
            elif job.pos // PAGE >= len(job.table):
                job.table.extend(self._pages(1))


def cascade_path() -> CascadePath:
    """The Triton backend's default cascade settings."""
    return CascadePath(CascadePolicy(), block_n=64, max_splits=32, decode_programs_per_sm=4)


def workload_plans(kind: str, jobs: int, max_new: int, seed: int, steps: int) -> list[StepPlan]:
    """``steps`` successive decode plans of a workload (built before any timing)."""
    workload = Workload(kind, jobs, max_new, seed)
    plans = []
    for _ in range(steps):
        plans.append(workload.plan())
        workload.advance()
    return plans


def time_steps(plans: list[StepPlan], step: Callable[[StepPlan], int]
               ) -> tuple[list[float], list[int]]:
    """Microseconds of ``step`` per plan, and the key reads each step's plan saves."""
    times, saved = [], []
    for plan in plans:
        start = time.perf_counter()
        saved.append(step(plan))
        times.append((time.perf_counter() - start) * 1e6)
    return times, saved


def stepper(jobs: int) -> Callable[[StepPlan], int]:
    """Plan and write one step as `GraphCascade.stage` and its writer do (a fresh planner and
    table region); returns the key reads the step's plan saves (0: no cascade)."""
    path = cascade_path()
    storage = cast(KVStorage, SimpleNamespace(mode="fp16", page_size=PAGE))
    tables = path.graph_tables(storage, 32, 8, jobs)  # Llama-3-8B heads: 4 per KV head
    assert tables is not None
    region = np.zeros(tables.size, dtype=np.int32)

    def step(plan: StepPlan) -> int:
        cascade = tables.plan(plan)
        if cascade is None:
            return 0
        tables.layout.write(cascade, len(plan.slices), region)
        return cascade.saved_keys

    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=256)
    parser.add_argument("--steps", type=int, default=128)
    parser.add_argument("--warmup", type=int, default=8)
    parser.add_argument("--max-new", type=int, default=512)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeat", type=int, default=5,
                        help="runs of the same steps; each step's fastest run counts (a busy "
                             "machine's noise only ever adds time)")
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    args = parser.parse_args()
    for kind in args.workloads.split(","):
        plans = workload_plans(kind, args.jobs, args.max_new, args.seed,
                               args.warmup + args.steps)
        best: list[float] = []
        saved: list[int] = []
        gc.collect()
        gc.disable()  # a collection landing in one step says nothing of planning
        try:
            for _ in range(args.repeat):
                times, saved = time_steps(plans, stepper(args.jobs))
                times = times[args.warmup:]
                best = times if not best else [min(a, b) for a, b in zip(best, times)]
        finally:
            gc.enable()
        saved = saved[args.warmup:]
        best.sort()
        report("cascade_planning", workload=kind, jobs=args.jobs, steps=args.steps,
               max_new=args.max_new, median_us=round(statistics.median(best), 1),
               mean_us=round(statistics.fmean(best), 1),
               p90_us=round(best[int(0.9 * (len(best) - 1))], 1),
               max_us=round(best[-1], 1), cascade_steps=sum(keys > 0 for keys in saved),
               saved_keys=sum(saved))


if __name__ == "__main__":
    main()
