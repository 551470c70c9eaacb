"""Host cost of n-gram drafting per step at 256 jobs: `Speculator.propose` and `settle`.

    python benchmarks/speculative_host.py [--jobs 256] [--prompt-tokens 512] [--steps 300]
        [--modes all,off,costed] [--text copy|random] [--shared-prompt] [--baseline TREE]
        [--profile 25]

No model: each job's "target" output is fixed in advance, after a random prompt of
--prompt-tokens tokens: ``copy`` text copies spans of what came before (4 to 24 tokens) between
short runs of random tokens, so n-gram drafts are often accepted and histories grow by several
tokens a step; ``random`` text is random tokens (drafts almost never accepted). Every step plans
one decode slice per job (as the scheduler does), asks `Speculator.propose` for drafts, checks
them against the target's tokens (`accept_run`), appends the run to the job's history as the
generator does (`JobRecord.on_token`) and, when any job drafted, settles every job
(`Speculator.settle`), as the generator does after a verify step. Only ``propose`` and
``settle`` are timed.

Modes: ``all``: the speculator's cost model says drafting is free, so every job drafts whose
drafts pay (with an n-gram drafter, all of them); ``off``: the cost model says drafts never pay
(jobs only probe one token every `DraftStats.PROBE_INTERVAL` steps); ``costed``: the cost model
of an 8B-like step (`STEP_SECONDS`), where drafts pay as acceptance earns them.

Figures are medians over the steps after --warmup, per step for all jobs: ``propose_ms``,
``settle_ms``, ``total_ms``; ``drafter_ms``, the part of ``propose_ms`` spent in the drafter (the
rest is the speculator's own per-job work); ``total_cpu_ms``, the total in this thread's CPU
time, which leaves out the time other processes of a loaded machine held the core. Also:
``first_ms``, the first step's ``propose``, where every job's prompt is indexed
(``--shared-prompt``: every prompt is one document, whose pages the jobs share as deduplicated
jobs do, plus a few tokens of the job's own); ``overlap_lost``, the share of steps after which
the speculator wants the next step's inputs on the host (`Speculator.wants_tokens`), where the
engine gives up overlapping steps.

Each tree runs --rounds fresh simulations, alternating with the other tree's; the figures
reported are the medians of the rounds' medians. ``--baseline TREE``: also run TREE's
speculator (its ``runtime/speculator.py`` with the modules it drafts with, `BASELINE_MODULES`,
loaded beside this checkout's; the rest of the engine is this checkout's), so that a shared
machine's load falls on both alike; the drafts proposed (a digest of every step's) must be the
same in every run.
``--profile N`` prints the N most expensive functions of this checkout's speculator (cProfile,
by own time) in its first ``all`` round.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import hashlib
import importlib.util
import json
import os
import pstats
import random
import statistics
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dyngen_core import Job, SamplerSettings  # noqa: E402
from dyngen_core.engine.plan import SequenceSlice, StepPlan  # noqa: E402
from dyngen_core.engine.record import JobRecord  # noqa: E402
from dyngen_core.engine.speculation import accept_run  # noqa: E402
from dyngen_core.runtime import speculator as this_speculator  # noqa: E402

GREEDY = SamplerSettings.greedy()
PAGE_SIZE = 256
# With --shared-prompt, the tokens of each prompt after the shared document.
QUESTION_TOKENS = 16
# What the speculator's cost model is shown a step of N tokens costs, by mode. all: the same
# whatever it feeds, and enough that drafting's own measured cost stays small beside it (a
# 256-job decode step of an 8B model on the H200 is ~10 ms); off: only what it feeds; costed:
# an 8B-like step, 4 ms plus 20 us a token (drafts pay where acceptance earns them).
STEP_SECONDS = {"all": lambda tokens: 20e-3, "off": lambda tokens: 1e-6 * tokens,
                "costed": lambda tokens: 4e-3 + 20e-6 * tokens}
# The modules a --baseline tree brings (those it has), in the order they import each other.
BASELINE_MODULES = ("dyngen_core.engine.ngram_native", "dyngen_core.engine.speculation",
                    "dyngen_core.runtime.drafters", "dyngen_core.runtime.speculator")
# Per-step figures reported as the median of the rounds' medians.
MEDIANS = ("propose_ms", "settle_ms", "drafter_ms", "first_ms", "total_ms", "total_cpu_ms",
           "mean_total_ms")


class NoStream:
    """A job's text stream where nothing stops or is banned (only its stop ids are read)."""

    stop_token_ids: frozenset[int] = frozenset()
    completion = ""

    def advance(self, token_id: int) -> str:
        return ""


def target_text(rng: random.Random, prompt_tokens: int, total: int, vocab: int,
                copy: bool, document: list[int]) -> list[int]:
    """A random prompt (``document`` first, then random tokens), then (``copy``) copies of
    earlier spans between short random runs, or random tokens; ``total`` tokens in all."""
    text = document + [rng.randrange(vocab) for _ in range(prompt_tokens - len(document))]
    while len(text) < total:
        text.extend(rng.randrange(vocab) for _ in range(rng.randint(1, 4)))
        if copy:
            length = rng.randint(4, 24)
            start = rng.randrange(len(text) - length)
            text.extend(text[start:start + length])
    return text[:total]


def load_baseline(tree: Path) -> ModuleType:
    """TREE's ``runtime/speculator.py`` as a module, bound to TREE's versions of the modules it
    drafts with (`BASELINE_MODULES` that TREE has; the rest of dyngen_core is this checkout's)."""
    def load(name: str, path: Path) -> ModuleType:
        spec = importlib.util.spec_from_file_location(name, path)
        assert spec is not None and spec.loader is not None
        module = sys.modules[name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module

    ours = {name: sys.modules.get(name) for name in BASELINE_MODULES}
    try:
        for name in BASELINE_MODULES:  # each bound before the next one imports it
            path = tree / (name.replace(".", "/") + ".py")
            if path.is_file():
                sys.modules[name] = load("baseline_" + name.rsplit(".", 1)[1], path)
        return sys.modules["dyngen_core.runtime.speculator"]
    finally:
        for name, module in ours.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module


class Simulation:
    """One speculator (from ``module``) generating for its own jobs, a step at a time."""

    def __init__(self, module: ModuleType, args: argparse.Namespace, mode: str) -> None:
        rng = random.Random(args.seed)
        total = args.prompt_tokens + (args.warmup + args.steps) * (args.draft_tokens + 1) + 1
        # --shared-prompt: every prompt begins with one document, its last QUESTION_TOKENS
        # tokens the job's own; the document's full pages are shared (deduplicated).
        shared = max(0, args.prompt_tokens - QUESTION_TOKENS) if args.shared_prompt else 0
        document = [rng.randrange(args.vocab) for _ in range(shared)]
        self.texts = [target_text(rng, args.prompt_tokens, total, args.vocab,
                                  args.text == "copy", document) for _ in range(args.jobs)]
        self.records: dict[int, JobRecord] = {}
        self.tables: dict[int, list[int]] = {}
        pages = total // PAGE_SIZE + 2
        for job_id, text in enumerate(self.texts):
            job = Job(input_ids=text[:args.prompt_tokens], max_new_tokens=total,
                      gen_settings=GREEDY)
            job.job_id = job_id
            self.records[job_id] = JobRecord(job=job, stream=NoStream(), settings=GREEDY,
                                             seed=job_id, speculative=True)
            own = list(range((job_id + 1) * pages, (job_id + 2) * pages))
            self.tables[job_id] = list(range(shared // PAGE_SIZE)) + own[shared // PAGE_SIZE:]
        drafter = module.NgramDrafter()
        self.speculator = module.Speculator(drafter, args.draft_tokens, PAGE_SIZE)
        # The drafter's cost stays what the drafter says (0 for lookups): measured, it would let
        # one tree's slower drafting switch jobs off that the other's keeps on, and the trees
        # would time different work (the digest checks they propose the same drafts).
        self.speculator.measure_draft_cost = False
        self.draft_s = 0.0  # this step's time inside the drafter (part of ``propose``)
        draft = drafter.draft

        def timed_draft(requests: Any) -> Any:
            began = time.perf_counter()
            try:
                return draft(requests)
            finally:
                self.draft_s += time.perf_counter() - began

        drafter.draft = timed_draft
        for _ in range(8):
            for tokens in (256, 1024):
                self.speculator.costs.record(tokens, STEP_SECONDS[mode](tokens))
        self.digest = hashlib.sha256()
        self.propose_s: list[float] = []
        self.settle_s: list[float] = []
        self.drafter_s: list[float] = []
        self.first_s: float | None = None  # the first step's propose: every prompt indexed
        self.cpu_s: list[float] = []  # propose and settle, this thread's CPU time
        self.drafting: list[int] = []
        self.no_overlap: list[bool] = []  # the next step needs this one's tokens on the host

    def step(self, measure: bool, profile: cProfile.Profile | None = None) -> None:
        """One decode (or verify) step of every job."""
        records, speculator = self.records, self.speculator
        plan = StepPlan(slices=[
            SequenceSlice(job_id, [r.history[-1]], len(r.history) - 1, self.tables[job_id], True)
            for job_id, r in records.items()])
        if profile is not None:
            profile.enable()
        self.draft_s = 0.0
        started, started_cpu = time.perf_counter(), time.thread_time()
        speculator.propose(plan, records)
        proposed, proposed_cpu = time.perf_counter(), time.thread_time()
        if profile is not None:
            profile.disable()
        runs = []
        for sl in plan.slices:
            at = len(records[sl.job_id].history)
            drafts = list(sl.draft_ids)
            self.digest.update(repr((sl.job_id, at, drafts)).encode())
            runs.append(accept_run(drafts, self.texts[sl.job_id][at:at + len(drafts) + 1]))
        for sl, run in zip(plan.slices, runs, strict=True):
            record = records[sl.job_id]
            for token in run:
                record.job.new_token_ids.append(token)
                record.on_token(token)
        settle = settle_cpu = 0.0
        if any(sl.draft_ids for sl in plan.slices):  # a verify step: every job settles
            if profile is not None:
                profile.enable()
            began, began_cpu = time.perf_counter(), time.thread_time()
            for sl, run in zip(plan.slices, runs, strict=True):
                speculator.settle(records[sl.job_id], len(run))
            settle = time.perf_counter() - began
            settle_cpu = time.thread_time() - began_cpu
            if profile is not None:
                profile.disable()
        if self.first_s is None:
            self.first_s = proposed - started
        if measure:
            self.propose_s.append(proposed - started)
            self.settle_s.append(settle)
            self.drafter_s.append(self.draft_s)
            self.cpu_s.append(proposed_cpu - started_cpu + settle_cpu)
            self.drafting.append(sum(bool(sl.draft_ids) for sl in plan.slices))
            self.no_overlap.append(speculator.wants_tokens())

    def figures(self) -> dict[str, Any]:
        totals = [p + s for p, s in zip(self.propose_s, self.settle_s, strict=True)]
        return {
            "propose_ms": round(statistics.median(self.propose_s) * 1e3, 4),
            "settle_ms": round(statistics.median(self.settle_s) * 1e3, 4),
            "drafter_ms": round(statistics.median(self.drafter_s) * 1e3, 4),
            "first_ms": round((self.first_s or 0.0) * 1e3, 4),
            "total_ms": round(statistics.median(totals) * 1e3, 4),
            "total_cpu_ms": round(statistics.median(self.cpu_s) * 1e3, 4),
            "mean_total_ms": round(statistics.fmean(totals) * 1e3, 4),
            "drafting_jobs_per_step": round(statistics.fmean(self.drafting), 1),
            "overlap_lost": round(statistics.fmean(self.no_overlap), 4),
            "accepted": self.speculator.accepted, "rejected": self.speculator.rejected,
            "final_context": round(statistics.fmean(len(r.history)
                                                    for r in self.records.values())),
            "drafts_digest": self.digest.hexdigest()[:16],
        }


def report(fields: dict[str, Any]) -> None:
    """One figure as a ``BENCH`` JSON line (appended to $DYNGEN_BENCH_OUT when set)."""
    line = json.dumps({"benchmark": "speculative_host", **fields})
    print("BENCH " + line, flush=True)
    target = os.environ.get("DYNGEN_BENCH_OUT")
    if target:
        with open(target, "a", encoding="utf-8") as f:
            f.write(line + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=256)
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--steps", type=int, default=300, help="measured steps")
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--draft-tokens", type=int, default=4, help="num_draft_tokens")
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--text", choices=("copy", "random"), default="copy")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--shared-prompt", action="store_true",
                        help="every prompt is one document plus the job's own "
                             f"{QUESTION_TOKENS} tokens, the document's pages shared")
    parser.add_argument("--modes", default="all,off")
    parser.add_argument("--baseline", type=Path, default=None,
                        help="a checkout whose speculator runs beside this one's")
    parser.add_argument("--rounds", type=int, default=3,
                        help="simulations per tree, alternating between trees")
    parser.add_argument("--profile", type=int, default=0)
    args = parser.parse_args()
    trees: dict[str, ModuleType] = {"this": this_speculator}
    if args.baseline is not None:
        trees["baseline"] = load_baseline(args.baseline)
    common = {"jobs": args.jobs, "prompt_tokens": args.prompt_tokens, "text": args.text,
              "steps": args.steps, "draft_tokens": args.draft_tokens}
    for mode in args.modes.split(","):
        rounds: dict[str, list[dict[str, Any]]] = {name: [] for name in trees}
        for _ in range(args.rounds):
            for name, module in trees.items():
                profile = (cProfile.Profile() if args.profile and mode == "all"
                           and name == "this" and not rounds[name] else None)
                sim = Simulation(module, args, mode)
                for step in range(args.warmup + args.steps):
                    measure = step >= args.warmup
                    sim.step(measure, profile if measure else None)
                rounds[name].append(sim.figures())
                del sim
                gc.collect()
                if profile is not None:
                    pstats.Stats(profile).sort_stats("tottime").print_stats(args.profile)
        for name, figures in rounds.items():
            report({"tree": name, "mode": mode, **common, "rounds": len(figures),
                    **{key: statistics.median(f[key] for f in figures) for key in MEDIANS},
                    **{key: value for key, value in figures[0].items() if key not in MEDIANS}})
        digests = {f["drafts_digest"] for figures in rounds.values() for f in figures}
        assert len(digests) == 1, f"mode {mode}: the speculators proposed different drafts"

if __name__ == "__main__":
    main()
