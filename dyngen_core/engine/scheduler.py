"""`Scheduler`: admission, chunked prefill, decode, preemption and fairness over the page pool.

One step is ``plan = schedule()`` -> the runner computes it -> ``apply(plan, outcome)``. Pure
Python; the scheduler owns every job's `Sequence` and the `PagePool`, and knows no tensors.

- Running jobs come first, oldest first: a job whose prefill is done gets one decode slice (its
  last token, plus room for its drafts); a job still prefilling gets the next chunk. Prompt tokens
  per step are capped by ``max_chunk_size`` over all jobs; decodes come on top.
- Pages are allocated on demand, for the positions a slice writes. When none are left the newest
  running job is preempted: its pages go back to the pool (full ones keep their hashes, so its
  recompute is mostly cache hits) and it re-enters the queue at the front. No job is admitted in
  a step that preempted.
- Admission is FIFO up to ``max_batch_size`` running jobs. A job is admitted when the pages its
  whole prefill still needs fit (keeping a small watermark while others run); prefix pages come
  from the cache or running jobs (see `dyngen_core.engine.sequence`, which also explains how
  jobs sharing a prefix with a job still prefilling wait for it instead of recomputing it). A
  waiting job passed over ``max_skips`` times blocks later jobs until it fits.
- When pages fill they are registered (hashed); an identical page already held is used instead
  (dedup of generated pages). Finished jobs release pages tail-first, so the LRU evicts suffixes
  before prefixes.
- Defragmentation is planned when the queue is empty (every ``DEFRAG_INTERVAL`` steps, or on
  `defragment()`); its page copies lead the next plan's ``copies``, so the runner only ever runs
  plans.
- Overlapped steps: a step may be applied with `PENDING_TOKEN`s before its tokens are known
  (`apply_tokens`), the next one planned, and the tokens put in later (`resolve_tokens`).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from collections.abc import Sequence as SequenceOf
from dataclasses import dataclass, field
from itertools import islice

from dyngen_core.config import CacheConfig, SchedulerConfig
from dyngen_core.engine.defrag import plan_defrag
from dyngen_core.engine.pages import PagePool
from dyngen_core.engine.plan import PENDING_TOKEN, PageCopy, SequenceSlice, StepOutcome, StepPlan
from dyngen_core.engine.results import GeneratorStats
from dyngen_core.engine.sequence import (
    InflightIndex,
    PrefixMatch,
    Sequence,
    SequenceStatus,
    SequenceView,
    check_sequences,
    drop_generated,
    match_prefix,
    record_partial_page,
    register_full_pages,
    release_pages,
    take_prefix_pages,
)
from dyngen_core.errors import JobError, JobTooLargeError

DEFRAG_INTERVAL = 64
ADMISSION_LOOKAHEAD = 64
WATERMARK_FRACTION = 0.01

RUNNING, WAITING, FINISHED = SequenceStatus.RUNNING, SequenceStatus.WAITING, SequenceStatus.FINISHED


@dataclass
class _Step:
    budget: int
    copies: list[PageCopy]
    slices: dict[int, SequenceSlice] = field(default_factory=dict)
    preempted: bool = False


class Scheduler:
    """Decides what each step computes and keeps every job's pages.

    cache: the cache's size and page size (``cache.num_pages`` pages).
    config: batch size, chunk size, fairness and the dedup / prompt cache / defrag switches.
        ``dedup=False``: no page is shared with or copied from a running job, and filled pages
        are not folded into identical ones. ``prompt_cache=False``: released pages drop their
        records, so nothing outlives its job. ``defrag=False``: no automatic defragmentation.
    """

    def __init__(self, cache: CacheConfig, config: SchedulerConfig | None = None) -> None:
        self.cache_config = cache
        self.config = config or SchedulerConfig()
        self.page_size = cache.page_size
        self.pool = PagePool(cache.num_pages, cache.page_size,
                             keep_cached=self.config.prompt_cache)
        self._jobs: dict[int, Sequence] = {}
        self._waiting: deque[Sequence] = deque()
        self._running: dict[int, Sequence] = {}  # admission order: the last one is the newest
        self._inflight = InflightIndex()
        self._pending_copies: list[PageCopy] = []
        self._arrivals = self._steps = self._preemptions = 0
        self._prefill_computed = self._prefill_reused = 0

    @property
    def _registering(self) -> bool:
        return self.config.dedup or self.config.prompt_cache

    # ---- jobs ---------------------------------------------------------------------------------

    def add(self, job_id: int, prompt_ids: SequenceOf[int], max_new_tokens: int, *,
            num_draft_tokens: int = 0) -> None:
        """Queue a job. ``num_draft_tokens``: speculative tokens each decode may carry (pages for
        them are allocated ahead, never past the job's last position: drafts never reach past
        ``max_new_tokens``, so they take no room the job does not need anyway; the caller
        assigns ``SequenceSlice.draft_ids`` up to that many, within the slice's pages).

        Raises JobTooLargeError if the job could never fit in the whole cache, JobError for a
        duplicate id, an empty prompt or negative counts."""
        if job_id in self._jobs:
            raise JobError(f"job id {job_id} is already queued or running; use a new id")
        tokens = [int(t) for t in prompt_ids]
        if not tokens:
            raise JobError(f"job {job_id} has an empty prompt; pass at least one token id")
        if max_new_tokens < 0 or num_draft_tokens < 0:
            raise JobError(f"job {job_id}: max_new_tokens ({max_new_tokens}) and "
                           f"num_draft_tokens ({num_draft_tokens}) must be >= 0")
        check_fits(job_id, len(tokens) + max_new_tokens, self.pool,
                   f"{len(tokens)} prompt + {max_new_tokens} new")
        seq = Sequence(job_id, tokens, len(tokens), max_new_tokens, num_draft_tokens,
                       arrival=self._arrivals)
        self._arrivals += 1
        self._jobs[job_id] = seq
        self._waiting.append(seq)

    def finish(self, job_id: int) -> bool:
        """Remove a job (waiting or running); its pages are released at once, tail-first.
        Returns False if the id is unknown (already finished or never added)."""
        seq = self._jobs.pop(job_id, None)
        if seq is None:
            return False
        if seq.status is RUNNING:
            self._leave_running(seq)
        else:
            self._waiting.remove(seq)
        seq.status = FINISHED
        return True

    def cancel(self, job_id: int) -> bool:
        """Same as `finish`: stop a waiting or running job and release its pages now."""
        return self.finish(job_id)

    def clear(self) -> None:
        """Cancel every job; the prompt cache keeps what finished jobs left."""
        for job_id in reversed(list(self._jobs)):
            self.finish(job_id)

    def rewind(self, job_id: int, num_tokens: int) -> None:
        """Drop a job's last ``num_tokens`` generated tokens (never prompt tokens). Pages past
        the new end are released; a kept page the job shares is given up and recomputed."""
        seq = self._require(job_id)
        n = min(num_tokens, seq.num_generated)
        if n > 0:
            self._inflight.remove(seq)  # a no-op unless it is prefilling
            drop_generated(seq, self.pool, n)

    # ---- one step -----------------------------------------------------------------------------

    def schedule(self) -> StepPlan:
        """Plan the next step (see the module docstring for the policy)."""
        self._steps += 1
        if self.config.defrag and not self._waiting and self._steps % DEFRAG_INTERVAL == 0:
            self.defragment()
        step = _Step(budget=self.config.max_chunk_size, copies=self._pending_copies)
        self._pending_copies = []
        slices, ps, running, make = step.slices, self.page_size, RUNNING, SequenceSlice
        for seq in list(self._running.values()):
            if seq.status is not running:
                continue  # preempted earlier in this step
            tokens = seq.token_ids
            start = len(tokens) - 1
            if start != seq.num_computed:
                if step.budget > 0:
                    self._schedule_prefill(seq, step)
            elif len(tokens) - seq.prompt_len >= seq.max_new_tokens:
                continue  # its last token is still in flight (`PENDING_TOKEN`); it ends there
            elif (start + seq.num_draft_tokens) // ps < len(table := seq.page_table):
                # The pages are there: a decode slice, built inline. It shares the lists of
                # the job's last decode slice while they are equal (in overlapped steps the
                # fed token is always `PENDING_TOKEN`): plans never change their lists.
                fed, pages, drafts = seq.planned_ids, seq.planned_pages, seq.planned_drafts
                if fed is None or fed[0] != tokens[start]:
                    fed = seq.planned_ids = [tokens[start]]
                if pages != table:
                    pages = seq.planned_pages = table[:]
                if drafts:
                    drafts = seq.planned_drafts = []
                slices[seq.job_id] = make(seq.job_id, fed, start, pages, True, drafts)
            else:
                self._schedule_decode(seq, step)
        if not step.preempted:
            self._admit(step)
        return StepPlan(slices=list(step.slices.values()), copies=step.copies)

    def apply(self, plan: StepPlan, outcome: StepOutcome) -> None:
        """Advance every job in ``plan`` by what ``outcome`` says was computed and sampled.
        Slices of jobs finished or cancelled since `schedule` are ignored."""
        running = self._running
        for sl in plan.slices:
            seq = running.get(sl.job_id)
            if seq is not None:
                accepted, new_tokens = sampled_tokens(sl, outcome)
                self._advance(seq, sl, accepted, new_tokens)

    def apply_tokens(self, plan: StepPlan, tokens: SequenceOf[int]) -> None:
        """`apply` for a step that sampled exactly one token per sampling slice and no drafts:
        ``tokens[i]`` is the token of the ``i``-th slice with ``sample=True``, in plan order.
        Saves building a `SampledTokens` per job; the result is the same as `apply`'s. A decode
        of one token that fills no page is applied inline (all it changes is the computed count
        and the new token); any other slice goes through `_advance`. Jobs no longer running are
        skipped."""
        slices = plan.slices
        if len(tokens) == len(slices):  # every slice samples (steady decoding): pair directly
            paired: Iterable[tuple[SequenceSlice, int | None]] = zip(slices, tokens, strict=True)
        else:
            next_token = iter(tokens).__next__
            paired = [(sl, next_token() if sl.sample else None) for sl in slices]
        get, page_size, advance = self._running.get, self.page_size, self._advance
        for sl, token in paired:
            seq = get(sl.job_id)
            if seq is None:
                continue
            start = sl.start_pos
            if sl.draft_ids:
                raise ValueError(f"apply_tokens: the slice of job {sl.job_id} carries drafts; "
                                 "use apply with the accepted draft count")
            if token is None or len(sl.token_ids) != 1 or start != seq.num_computed \
                    or start < seq.prefill_end or (start + 1) % page_size == 0:
                advance(seq, sl, 0, () if token is None else (token,))
            else:
                seq.num_computed = start + 1
                seq.token_ids.append(token)

    def resolve_tokens(self, plan: StepPlan, tokens: SequenceOf[int]) -> None:
        """Put the real tokens where ``apply_tokens(plan, [PENDING_TOKEN] * n)`` left
        placeholders (overlapped steps): ``tokens`` has one token per sampling slice, in plan
        order. Jobs finished since are skipped; preempted ones are resolved too (they recompute
        their tokens later). A page is registered only when its last position is computed, one
        step after the token there was sampled: by then it was resolved, so no placeholder is
        ever hashed."""
        slices = plan.slices
        if len(tokens) != len(slices):  # some slices sample nothing: pair the others
            slices = [sl for sl in slices if sl.sample]
        get = self._jobs.get
        for sl, token in zip(slices, tokens, strict=True):
            seq = get(sl.job_id)
            if seq is None:
                continue
            index = sl.start_pos + len(sl.token_ids)  # `end_pos`, inlined: this runs per job
            ids = seq.token_ids
            if index >= len(ids) or ids[index] != PENDING_TOKEN:
                raise RuntimeError(f"job {sl.job_id} has no pending token at position {index}; "
                                   "resolve each overlapped step once, in order")
            ids[index] = token

    def _advance(self, seq: Sequence, sl: SequenceSlice, accepted: int,
                 new_tokens: SequenceOf[int]) -> None:
        """Mark one slice computed, append its sampled tokens and register filled pages."""
        start = sl.start_pos
        if start != seq.num_computed:
            raise RuntimeError(
                f"plan slice of job {sl.job_id} starts at {start} but the job has "
                f"{seq.num_computed} tokens computed; apply each plan once, in order")
        fed_end = start + len(sl.token_ids)
        seq.num_computed = fed_end + accepted
        seq.token_ids.extend(new_tokens)
        if seq.num_computed // self.page_size > start // self.page_size and self._registering:
            register_full_pages(seq, self.pool, start, seq.num_computed, fold=self.config.dedup)
        if start < seq.prefill_end:
            self._prefill_computed += min(fed_end, seq.prefill_end) - start
            self._after_prefill_slice(seq)

    def abort(self, plan: StepPlan) -> None:
        """Call when a step of ``plan`` failed before it was applied (its jobs are finished by
        the caller or keep waiting for a retry). The plan's page copies (defragmentation,
        partial-page reuse) may not have run: every copy target loses its record, so no later
        prompt reads it as a cache hit, and a running job that holds one is preempted to
        recompute it."""
        targets = {copy.dst for copy in plan.copies}
        if not targets:
            return
        for seq in list(self._running.values()):
            if not targets.isdisjoint(seq.page_table):
                self._preempt(seq, record=False)
        for page in targets:
            self.pool.forget(page)

    def defragment(self, *, max_moves: int | None = None) -> int:
        """Compact and order the used pages if fragmentation is worth it (see
        `dyngen_core.engine.defrag`; ``max_moves`` caps the pages moved, None for its default).
        Page tables and the pool are relabelled now; the page copies lead the next plan's
        ``copies`` (do not run them separately). Call between `apply` and `schedule`. Returns
        the number of page copies queued."""
        running = list(self._running.values())
        plan = plan_defrag([s.page_table for s in running], self.pool.cached_pages(),
                           self.pool.num_pages, self.page_size, max_moves=max_moves)
        if plan is None:
            return 0
        self.pool.remap(plan.mapping)
        for seq in running:
            seq.page_table = [plan.mapping.get(p, p) for p in seq.page_table]
        self._pending_copies.extend(plan.copies)
        return len(plan.copies)

    # ---- queries ------------------------------------------------------------------------------

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        return len(self._running)

    def sequence(self, job_id: int) -> SequenceView | None:
        """A read-only view of a job's state, or None for an unknown (finished) job."""
        seq = self._jobs.get(job_id)
        return None if seq is None else SequenceView(seq)

    def stats(self) -> GeneratorStats:
        """Pages by state, prefill tokens computed and reused, jobs running and waiting,
        preemptions (`results.GeneratorStats`)."""
        pool = self.pool
        return GeneratorStats(
            pages_total=pool.num_pages, pages_referenced=pool.num_referenced,
            pages_cached=pool.num_cached, pages_free=pool.num_free,
            prefill_tokens_computed=self._prefill_computed,
            prefill_tokens_reused=self._prefill_reused,
            jobs_active=len(self._running), jobs_pending=len(self._waiting),
            preemptions=self._preemptions,
        )

    def check_invariant(self) -> None:
        """Raise AssertionError unless the page invariant of DESIGN.md §4 holds, together with
        the sequences' own consistency (see `check_sequences`)."""
        self.pool.check_invariant(s.page_table for s in self._running.values())
        check_sequences(self._jobs, self._waiting, self._running, self.pool)

    # ---- internals: running jobs --------------------------------------------------------------

    def _schedule_decode(self, seq: Sequence, step: _Step) -> None:
        """A decode that needs a new page (`schedule` plans the others inline)."""
        start = len(seq.token_ids) - 1
        end = min(start + 1 + seq.num_draft_tokens, seq.prompt_len + seq.max_new_tokens)
        if self._ensure_pages(seq, end, step):
            step.slices[seq.job_id] = SequenceSlice(seq.job_id, [seq.token_ids[-1]], start,
                                                    list(seq.page_table), True)

    def _schedule_prefill(self, seq: Sequence, step: _Step) -> None:
        start = seq.num_computed
        end = min(seq.num_tokens, start + step.budget)
        if self._ensure_pages(seq, end, step):
            step.budget -= end - start
            step.slices[seq.job_id] = SequenceSlice(seq.job_id, seq.token_ids[start:end], start,
                                                    list(seq.page_table), end == seq.num_tokens)

    def _ensure_pages(self, seq: Sequence, end_pos: int, step: _Step) -> bool:
        """Give ``seq`` pages up to position ``end_pos``, preempting the newest running jobs
        while none are left; False if ``seq`` itself was preempted."""
        need = -(-end_pos // self.page_size) - len(seq.page_table)
        while need > self.pool.free_count():
            victim = next(reversed(self._running.values()))
            self._preempt(victim)
            step.slices.pop(victim.job_id, None)
            step.preempted = True
            if victim is seq:
                return False
        for _ in range(need):
            seq.page_table.append(self.pool.allocate())
        return True

    def _preempt(self, seq: Sequence, *, record: bool = True) -> None:
        """Send a running job back to the front of the queue, releasing its pages (``record``:
        note its partly computed last page for reuse, when the prompt cache is on)."""
        self._leave_running(seq, record=record)
        seq.status = WAITING
        seq.num_computed = 0
        seq.num_preemptions += 1
        self._preemptions += 1
        self._waiting.appendleft(seq)

    def _leave_running(self, seq: Sequence, *, record: bool = True) -> None:
        release_pages(seq, self.pool, record=record and self.config.prompt_cache)
        del self._running[seq.job_id]
        self._inflight.remove(seq)

    def _after_prefill_slice(self, seq: Sequence) -> None:
        """Record the partly computed last page so others can copy it; leave the in-flight index
        once the prefill is done."""
        if self.config.dedup:
            record_partial_page(seq, self.pool)
        if seq.num_pending <= 1:
            self._inflight.remove(seq)

    # ---- internals: admission -----------------------------------------------------------------

    def _admit(self, step: _Step) -> None:
        admitted = 0
        passed: list[tuple[Sequence, int]] = []
        lookahead = max(ADMISSION_LOOKAHEAD, self.config.max_batch_size)
        for seq in list(islice(self._waiting, lookahead)):
            if len(self._running) >= self.config.max_batch_size or step.budget <= 0:
                break
            match = self._match(seq)
            if match is None:
                continue  # deferred: a running job is computing its prefix
            if self._try_admit(seq, match, step):
                admitted += 1
                continue
            passed.append((seq, admitted))
            if seq.num_skips >= self.config.max_skips:
                break  # fairness: nobody overtakes a job skipped this often
        for seq, admitted_before in passed:
            if admitted > admitted_before:
                seq.num_skips += 1

    def _match(self, seq: Sequence) -> PrefixMatch | None:
        if not self._registering:
            return PrefixMatch([], None, 0, self.page_size)
        inflight = self._inflight if self.config.dedup else None
        return match_prefix(seq, self.pool, inflight, share_running=self.config.dedup)

    def _try_admit(self, seq: Sequence, match: PrefixMatch, step: _Step) -> bool:
        watermark = max(1, int(self.pool.num_pages * WATERMARK_FRACTION)) if self._running else 0
        taken = take_prefix_pages(seq, match, self.pool, watermark, step.copies)
        if taken is None:
            return False
        self._waiting.remove(seq)
        self._start_running(seq, taken.reused_tokens)
        self._schedule_prefill(seq, step)
        return True

    def _start_running(self, seq: Sequence, reused: int) -> None:
        seq.status = RUNNING
        seq.num_computed = reused
        seq.prefill_end = seq.num_tokens
        if not seq.admitted:
            seq.admitted = True
            seq.num_cached_tokens = min(reused, seq.prompt_len)
        self._prefill_reused += reused
        self._running[seq.job_id] = seq
        if self.config.dedup:
            self._inflight.add(seq, self.page_size)

    def _require(self, job_id: int) -> Sequence:
        seq = self._jobs.get(job_id)
        if seq is None:
            raise KeyError(f"job {job_id} is not queued or running (finished, cancelled or "
                           "never added)")
        return seq


def check_fits(job_id: int, num_tokens: int, pool: PagePool, breakdown: str) -> None:
    """Raise JobTooLargeError if ``num_tokens`` cache slots (described by ``breakdown``) need more
    pages than the whole pool holds."""
    ps, total = pool.page_size, pool.num_pages
    pages = -(-num_tokens // ps)
    if pages > total:
        raise JobTooLargeError(
            f"job {job_id} needs up to {pages} pages of {ps} tokens ({breakdown} tokens) but the "
            f"whole cache holds {total} pages ({total * ps} tokens); build a larger cache "
            f"(max_tokens >= {pages * ps}) or shorten the prompt or max_new_tokens")


def sampled_tokens(sl: SequenceSlice, outcome: StepOutcome) -> tuple[int, list[int]]:
    """(accepted draft count, tokens to append) for one slice of a plan, validated."""
    if not sl.sample:
        return 0, []
    sampled = outcome.sampled.get(sl.job_id)
    if sampled is not None and not sl.draft_ids and not sampled.num_draft_accepted \
            and len(sampled.token_ids) == 1:
        return 0, sampled.token_ids  # the common case: one decode token
    if sampled is None:
        raise ValueError(f"the outcome has no sampled tokens for job {sl.job_id}, whose slice "
                         "asked for sampling")
    accepted = sampled.num_draft_accepted
    if not 0 <= accepted <= len(sl.draft_ids) or len(sampled.token_ids) != accepted + 1:
        raise ValueError(
            f"job {sl.job_id}: {len(sampled.token_ids)} sampled tokens with {accepted} of "
            f"{len(sl.draft_ids)} drafts accepted; expected accepted drafts + 1 tokens")
    return accepted, list(sampled.token_ids)
