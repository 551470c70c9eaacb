"""`Speculator`: drafts for a step's decode slices (from a `runtime.drafters.Drafter`), how
many each job offers, and what each job's verify step accepted.

The generator asks `Speculator.propose` to fill the ``draft_ids`` of the decode slices of a
plan before running it; the target's forward then yields ``1 + k`` logits rows per drafting job,
the `StepSampler` draws every row, and `engine.speculation.accept_run` keeps the drafts that
equal the draws. The draft length of each job follows its acceptance and the step's measured
cost (`engine.speculation`); `build_speculator` picks the drafter for a generator's options.

Jobs draft only when `JobRecord.drafting` (the job did not opt out; no mirostat, whose state
moves with each token; no extra outputs) and their decode slice's inputs are known on the host.
A constrained job's drafts are cut before the first token the constraint forbids (it could not
be accepted).
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from dyngen_core.engine.plan import PENDING_TOKEN, SequenceSlice, StepPlan
from dyngen_core.engine.record import JobRecord
from dyngen_core.engine.speculation import DraftStats, NgramIndex, StepCostModel
from dyngen_core.kv.attention import AttentionBackend
from dyngen_core.kv.cache import Cache
from dyngen_core.model import Model
from dyngen_core.runtime.drafters import (
    Drafter,
    DraftRequest,
    DraftSampling,
    ModelDrafter,
    NgramDrafter,
)

# No job's probe is due (`Speculator.propose`'s earliest probe step while none is known).
_NO_PROBE = 1 << 62

# A NamedTuple's own constructor is a Python function; a step builds a request and a draft for
# every drafting job (256 a step), so they are built with ``tuple.__new__`` (instances all the
# same, in a fraction of the time), every field given.
_new_tuple = tuple.__new__


class SleepingJobs:
    """Jobs whose drafts do not pay and whose probe is not yet due, as columns of the
    statistics that decide when they wake (a snapshot of each job's `DraftStats`, which do
    not change until the job offers again).

    At 256 jobs with drafting switched off by cost, asking each job every step whether it pays
    again (`DraftStats.pays`) or its probe came due (`DraftStats.next_probe`) is a Python call
    per job; `wake` asks all of them in a few array operations, computing exactly what those
    two methods compute (and asks the methods themselves while fewer than `ARRAY_FROM` sleep,
    where the arrays' fixed cost would be the larger).
    """

    ARRAY_FROM = 32

    def __init__(self) -> None:
        self.rows: dict[int, int] = {}  # job -> its row
        self._jobs: list[int] = []
        self._stats: list[DraftStats] = []
        self._alpha = np.zeros(0)
        self._last_offer = np.zeros(0, dtype=np.int64)
        self._interval = np.zeros(0, dtype=np.int64)
        self._misses = np.zeros(0, dtype=np.int64)

    def __len__(self) -> int:
        return len(self._jobs)

    def add(self, job_id: int, stats: DraftStats) -> None:
        """Put a job to sleep with its statistics as they are now."""
        row = len(self._jobs)
        if row == len(self._alpha):
            size = max(16, 2 * row)
            self._alpha = np.resize(self._alpha, size)
            self._last_offer = np.resize(self._last_offer, size)
            self._interval = np.resize(self._interval, size)
            self._misses = np.resize(self._misses, size)
        self._jobs.append(job_id)
        self._stats.append(stats)
        self.rows[job_id] = row
        self._alpha[row] = stats.alpha
        self._last_offer[row] = stats.last_offer
        self._interval[row] = stats.probe_interval
        self._misses[row] = stats.misses

    def remove(self, job_id: int) -> None:
        """Wake a job (or forget one that ended); nothing if it is not asleep."""
        row = self.rows.pop(job_id, None)
        if row is None:
            return
        last = len(self._jobs) - 1
        moved, moved_stats = self._jobs.pop(), self._stats.pop()
        if row != last:  # the last row takes the freed one
            self._jobs[row], self._stats[row] = moved, moved_stats
            self.rows[moved] = row
            for column in (self._alpha, self._last_offer, self._interval, self._misses):
                column[row] = column[last]

    def wake(self, threshold: float, probe: float, step: int) -> int:
        """Take out every job that pays again at ``threshold`` or whose probe (costing
        ``probe``) is due at engine step ``step``; returns the earliest probe step of those
        that sleep on (`_NO_PROBE` when none)."""
        count = len(self._jobs)
        if count < self.ARRAY_FROM:
            return self._wake_each(threshold, probe, step)
        alpha = self._alpha[:count]
        # DraftStats.next_probe, every job at once.
        cost = np.minimum(np.ceil((probe - alpha) / DraftStats.PROBE_BUDGET),
                          DraftStats.MAX_PROBE_WAIT).astype(np.int64)
        due = self._last_offer[:count] + np.maximum(self._interval[:count], cost)
        interval = DraftStats.PROBE_INTERVAL
        due = -(-due // interval) * interval
        # DraftStats.pays, every job at once.
        pays = (alpha > threshold) & (self._misses[:count] < DraftStats.MAX_MISSES)
        woken = pays | (due <= step)
        staying = due[~woken]
        earliest = int(staying.min()) if len(staying) else _NO_PROBE
        for row in np.flatnonzero(woken)[::-1].tolist():  # the last rows first
            self.remove(self._jobs[row])
        return earliest

    def _wake_each(self, threshold: float, probe: float, step: int) -> int:
        """`wake`, one job at a time."""
        earliest = _NO_PROBE
        for job_id, stats in list(zip(self._jobs, self._stats)):
            due = stats.next_probe(probe)
            if stats.pays(threshold) or due <= step:
                self.remove(job_id)
            else:
                earliest = min(earliest, due)
        return earliest


class Speculator:
    """Drafts for plans and the bookkeeping of what was accepted (see the module docstring).

    drafter: an `NgramDrafter` or `ModelDrafter`.
    max_draft_tokens: the most drafts a job offers in one step (pages are reserved for them).
    page_size: the cache's page size (a slice drafts no further than its pages reach).
    """

    # The measured draft cost is the median of the last `DRAFT_COST_SAMPLES` passes' costs,
    # the drafter's own estimate counted `DRAFT_COST_PRIOR` times until passes replace it: a
    # pass that pays a one-time cost (the first indexing of prompts, a kernel's compilation)
    # moves it little, and a drafter slower than its estimate is seen within a few passes.
    DRAFT_COST_SAMPLES = 8
    DRAFT_COST_PRIOR = 3

    def __init__(self, drafter: Drafter, max_draft_tokens: int, page_size: int) -> None:
        if max_draft_tokens < 1:
            raise ValueError(f"num_draft_tokens must be >= 1, not {max_draft_tokens}")
        self.drafter = drafter
        self.max_draft_tokens = max_draft_tokens
        self.page_size = page_size
        self.costs = StepCostModel()
        # One draft position's cost over a target decode step of the same jobs: the drafter's
        # own estimate, then measured (the drafter's time over the cost model's step time, the
        # median of recent passes) while ``measure_draft_cost``; benchmarks that pin it turn
        # the measuring off.
        self.draft_cost_ratio = drafter.cost_ratio
        self.measure_draft_cost = True
        self._draft_costs = deque([self.draft_cost_ratio] * self.DRAFT_COST_PRIOR,
                                  maxlen=self.DRAFT_COST_SAMPLES)
        # What a pass of probes costs, in steps (the median of the last passes that only
        # probed; 0 until one is measured): a probe costs at least that, in produced tokens
        # (the pass and the step are both shared by the batch, whose jobs probe together). A
        # draft model's probe pays a catch-up forward over every token since the job last
        # drafted, several times an ordinary draft position.
        self.probe_cost = 0.0
        self._probe_costs: deque[float] = deque(maxlen=self.DRAFT_COST_SAMPLES)
        self._stats: dict[int, DraftStats] = {}
        self.accepted = self.rejected = 0
        self._steps = 0
        self._next_probe: int | None = None  # the earliest step a job not drafting probes
        # Jobs whose drafts pay (or that are new): their steps do not overlap the next.
        self._on: set[int] = set()
        self._asleep = SleepingJobs()

    def wants_tokens(self) -> bool:
        """Whether the next step should have this step's tokens on the host (drafts are made
        there): some job drafts, or a job's probe comes due in the next step."""
        return bool(self._on) or (self._next_probe is not None
                                  and self._steps + 1 >= self._next_probe)

    def follow(self, plan: StepPlan) -> None:
        self.drafter.follow(plan)

    def propose(self, plan: StepPlan, records: Mapping[int, JobRecord]) -> int:
        """Set the ``draft_ids`` of ``plan``'s drafting decode slices (and their records');
        returns how many drafts were set."""
        self._steps += 1
        decodes = [s for s in plan.slices if s.sample and len(s.token_ids) == 1]
        self._next_probe = None
        if not decodes:
            return 0
        drafter, step, on = self.drafter, self._steps, self._on
        samples, page_size, max_draft = drafter.samples, self.page_size, self.max_draft_tokens
        threshold = self.costs.threshold(len(decodes), self.draft_cost_ratio)
        probe = max(threshold, self.probe_cost)  # what a one-token probe costs
        probes_only = True
        longest = 0
        asleep = self._asleep
        # The earliest step a job not drafting probes: those asleep, then those seen below.
        next_probe = asleep.wake(threshold, probe, step)
        sleeping = asleep.rows
        requests: list[DraftRequest] = []
        slices: list[SequenceSlice] = []
        drafting: list[JobRecord] = []
        for sl in decodes:
            job_id = sl.job_id
            if job_id in sleeping:
                continue
            record = records.get(job_id)
            if record is None or not record.drafting:
                continue
            stats = self._stats.get(job_id) or self._stats_of(job_id)
            if sl.token_ids[0] == PENDING_TOKEN or sl.start_pos != len(record.history) - 1:
                # No input on the host yet: a job that drafts (or is new) stays on, so the
                # next step has its tokens; any other may probe when due.
                if job_id not in on:
                    next_probe = min(next_probe, stats.next_probe(probe))
                continue
            if not stats.pays(threshold):
                due = stats.next_probe(probe)
                if step < due:  # what `stats.length` says: no draft pays, no probe due
                    on.discard(job_id)
                    next_probe = min(next_probe, due)
                    asleep.add(job_id, stats)
                    continue
            # Drafts stop before max_new_tokens and inside the slice's pages (a prompt's last
            # token, fed alone after a prompt-cache hit, has no page reserved past it).
            job = record.job
            room = min(job.max_new_tokens - len(job.new_token_ids) - 1,
                       len(sl.page_table) * page_size - sl.start_pos - 1, max_draft)
            length = stats.length(room, threshold, step, probe)
            if length == 0:
                on.discard(job_id)
                next_probe = min(next_probe, stats.next_probe(probe))
                continue
            probes_only = probes_only and stats.probing
            if length > longest:
                longest = length
            on.add(job_id)
            sampling = self._sampling(record) if samples else None
            requests.append(_new_tuple(DraftRequest, (job_id, record.history, sl.page_table,
                                                      length, sampling, record.matcher)))
            slices.append(sl)
            drafting.append(record)
        self._next_probe = None if next_probe == _NO_PROBE else next_probe
        if not requests:
            return 0
        started = time.perf_counter()
        drafts = drafter.draft(requests)
        self._measure_draft_cost(time.perf_counter() - started, len(decodes), longest,
                                 probes_only)
        if len(drafts) != len(requests):
            raise RuntimeError(f"the drafter answered {len(drafts)} of {len(requests)} requests")
        total = 0
        for sl, record, (tokens, probs) in zip(slices, drafting, drafts):
            keep = len(tokens) if record.matcher is None else allowed_prefix(record.matcher,
                                                                             tokens)
            if not keep:  # nothing to verify: the offer missed
                self._stats[record.job_id].miss()
            else:
                # The drafter's lists are its answer's own: no copy unless cut.
                sl.draft_ids = record.draft_ids = tokens if keep == len(tokens) else tokens[:keep]
                record.draft_probs = None if probs is None else probs[:keep]
                total += keep
        return total

    def _measure_draft_cost(self, seconds: float, batch: int, positions: int,
                            probes_only: bool) -> None:
        """Fold one drafting pass (``seconds`` for ``positions`` draft positions of a step of
        ``batch`` decodes; ``probes_only``: every job in it probed) into ``draft_cost_ratio``
        and, for a pass of probes, into ``probe_cost``, once the cost model predicts a step."""
        step = self.costs.predict(batch)
        if not self.measure_draft_cost or not step or positions < 1:
            return
        self._draft_costs.append(seconds / (positions * step))
        self.draft_cost_ratio = statistics.median(self._draft_costs)
        if probes_only:
            self._probe_costs.append(seconds / step)
            self.probe_cost = statistics.median(self._probe_costs)

    def _sampling(self, record: JobRecord) -> DraftSampling | None:
        """How a drafter that samples draws this job's drafts; None (draft greedily) for a
        greedy job, and for a job the user seeded: its output must be plain decoding's, which
        only deterministic drafts keep (sampled drafts follow the same distribution with other
        draws, and how many a step takes depends on the batch)."""
        settings = record.settings
        if not self.drafter.samples or settings.is_greedy or record.job.seed is not None \
                or record.seed is None:
            return None
        return DraftSampling(settings.temperature, settings.top_k, record.seed, record.counter)

    def settle(self, record: JobRecord, run_length: int) -> None:
        """Count a verify step of ``record`` that yielded ``run_length`` tokens (call after
        they reached its history), and clear its drafts. A job that offered no draft in the
        step (it decoded one token beside the drafting jobs) has nothing to count."""
        proposed = len(record.draft_ids)
        if proposed:
            accepted = run_length - 1
            stats = self._stats.get(record.job_id) or self._stats_of(record.job_id)
            stats.record(proposed, accepted)
            self.accepted += accepted
            self.rejected += proposed - accepted
        self.drafter.settle(record.job_id, len(record.history) - 1)
        record.draft_ids = ()
        record.draft_probs = None

    def forget(self, job_id: int) -> None:
        self._stats.pop(job_id, None)
        self._on.discard(job_id)
        self._asleep.remove(job_id)
        self.drafter.forget(job_id)

    def job_totals(self, job_id: int) -> tuple[int, int]:
        """(accepted, rejected) drafts of a job so far."""
        stats = self._stats.get(job_id)
        return (0, 0) if stats is None else (stats.total_accepted, stats.total_rejected)

    def _stats_of(self, job_id: int) -> DraftStats:
        stats = self._stats.get(job_id)
        if stats is None:
            stats = self._stats[job_id] = DraftStats()
            self._on.add(job_id)
        return stats


def allowed_prefix(matcher: Any, tokens: Sequence[int]) -> int:
    """How many leading ``tokens`` a constraint matcher allows in a row, up to one that
    completes it (all of them without one); the matcher is left as it was found."""
    if matcher is None or not tokens:
        return len(tokens)
    return len(matcher.masks_along(tokens)) - 1


def build_speculator(model: Model, cache: Cache, draft_model: Model | None,
                draft_cache: Cache | None, num_draft_tokens: int, use_ngram_draft: bool,
                backend: str | AttentionBackend, cuda_graphs: bool, max_batch_size: int
                ) -> Speculator | None:
    """The `Speculator` for a generator's draft options (see `DynamicGenerator`), or None
    without a drafter; raises ValueError naming a bad or conflicting option."""
    if draft_model is None and not use_ngram_draft:
        if draft_cache is not None:
            raise ValueError("draft_cache was given without a draft_model; pass both")
        return None
    if draft_model is not None and use_ngram_draft:
        raise ValueError("use_ngram_draft=True and a draft_model were both given; choose one "
                         "drafter")
    window = getattr(cache.storage, "recent_window", 0)
    if window:
        raise ValueError(
            f"speculative decoding needs a target cache without a recent window (this "
            f"{cache.mode} cache keeps {window} positions unquantized, "
            "and rejected drafts would push verified ones out of it): use cache_mode 'fp16' "
            "or 'q8', or build the Cache with recent_window=0")
    if not isinstance(num_draft_tokens, int) or num_draft_tokens < 1:
        raise ValueError(f"num_draft_tokens must be an integer >= 1, not {num_draft_tokens!r}")
    if draft_model is None:
        limit = NgramIndex.TOKEN_LIMIT
        if model.config.vocab_size > limit:
            raise ValueError(f"use_ngram_draft=True supports vocabularies of up to {limit:,} "
                             f"tokens, not {model.config.vocab_size:,}; use a draft model")
        return Speculator(NgramDrafter(page_size=cache.page_size), num_draft_tokens,
                          cache.page_size)
    if draft_cache is None:
        draft_cache = Cache(draft_model, max_tokens=cache.max_tokens, page_size=cache.page_size)
    drafter = ModelDrafter(
        draft_model, draft_cache, target_cache=cache,
        target_vocab_size=model.config.vocab_size,
        backend=backend if isinstance(backend, str) else "auto", cuda_graphs=cuda_graphs,
        max_batch_size=max_batch_size, target_model=model)
    return Speculator(drafter, num_draft_tokens, cache.page_size)


__all__ = ["SleepingJobs", "Speculator", "allowed_prefix", "build_speculator"]
