"""Page bookkeeping between a sequence and the pool: the size check at enqueue, reading a step's
sampled tokens (and applying one token per decode without them), registering filled pages (and
folding them into identical ones), dropping generated tokens and making a page writable after a
rewind, releasing a sequence's pages, and the sequence-side invariant checks."""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Mapping
from collections.abc import Sequence as SeqOf

from dyngen_core.engine.pages import ROOT_HASH, PagePool
from dyngen_core.engine.plan import SequenceSlice, StepOutcome, StepPlan
from dyngen_core.engine.sequence import Sequence, SequenceStatus
from dyngen_core.errors import JobTooLargeError


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


def register_full_pages(seq: Sequence, pool: PagePool, old_computed: int, new_computed: int, *,
                        fold: bool) -> None:
    """Register the pages that became fully computed between the two counts.

    fold: when an identical page is already registered, switch ``seq`` to it and release its own
        (dedup of generated pages); when False the own page stays, unregistered.
    """
    ps = pool.page_size
    first, last = old_computed // ps, new_computed // ps
    if first >= last:
        return
    hashes = seq.hashes_upto(last, ps)
    for k in range(first, last):
        page = seq.page_table[k]
        if pool.page_hash(page) == hashes[k]:
            continue
        parent = hashes[k - 1] if k else ROOT_HASH
        canonical = pool.register_full(page, parent, seq.page_tokens(k, ps), block_hash=hashes[k])
        if fold and canonical is not None and canonical != page:
            pool.ref(canonical)
            seq.page_table[k] = canonical
            pool.release(page)


def drop_generated(seq: Sequence, pool: PagePool, n: int) -> None:
    """Drop ``seq``'s last ``n`` tokens (at most its generated ones). A running sequence also
    releases the pages past its new end, and the page its next decode writes is made writable
    (`make_writable`)."""
    del seq.token_ids[-n:]
    ps = pool.page_size
    del seq.page_hashes[seq.num_tokens // ps:]
    seq.prefill_end = min(seq.prefill_end, seq.num_tokens)
    if seq.status is not SequenceStatus.RUNNING:
        return
    seq.num_computed = min(seq.num_computed, seq.num_tokens - 1)
    keep = (seq.num_tokens - 1) // ps + 1
    for page in reversed(seq.page_table[keep:]):
        pool.release(page)
    del seq.page_table[keep:]
    if len(seq.page_table) == keep:
        make_writable(seq, pool, keep - 1)


def make_writable(seq: Sequence, pool: PagePool, k: int) -> None:
    """After a rewind, page ``k`` is the one the next decode writes: nothing may be registered
    beyond ``num_computed`` in it. Truncate its record if ``seq`` holds it alone; if it is
    shared, give it up and recompute its tokens in a fresh page."""
    page, start = seq.page_table[k], k * pool.page_size
    kept = max(0, seq.num_computed - start)
    if pool.record_len(page) <= kept:
        return
    if pool.ref_count(page) == 1:
        pool.truncate(page, kept)
    else:
        pool.release(page)
        del seq.page_table[k:]
        seq.num_computed = min(seq.num_computed, start)


def record_partial_page(seq: Sequence, pool: PagePool) -> None:
    """Note the computed leading slots of ``seq``'s partly filled last page, when it holds that
    page alone and unregistered, so a later job can copy them."""
    ps, nc = pool.page_size, seq.num_computed
    k = nc // ps
    if nc % ps and k < len(seq.page_table):
        page = seq.page_table[k]
        if pool.ref_count(page) == 1 and pool.page_hash(page) is None:
            pool.record_partial(page, seq.parent_hash(k, ps), seq.token_ids[k * ps:nc])


def release_pages(seq: Sequence, pool: PagePool, *, record: bool) -> None:
    """Release all of ``seq``'s pages, last page first (so the LRU evicts suffixes before the
    prefixes other jobs may share), and empty its page table.

    record: first note the computed leading slots of a partly filled last page, so a later job
        (a preempted job's recompute, the next chat turn) can copy them.
    """
    if record:
        record_partial_page(seq, pool)
    for page in reversed(seq.page_table):
        pool.release(page)
    seq.page_table = []


def check_sequences(jobs: Mapping[int, Sequence], waiting: Collection[Sequence],
                    running: Mapping[int, Sequence], pool: PagePool) -> None:
    """Raise AssertionError unless: every job is waiting xor running; waiting jobs hold no pages;
    a running job's pages cover its computed tokens; its registered pages carry the hashes of
    its own tokens; and every page it will still write is exclusive and unregistered."""
    _require(len(jobs) == len(waiting) + len(running),
             f"{len(jobs)} jobs but {len(waiting)} waiting + {len(running)} running")
    for seq in waiting:
        _require(seq.status is SequenceStatus.WAITING and not seq.page_table
                 and seq.num_computed == 0, f"waiting job {seq.job_id} holds pages or progress")
    for seq in running.values():
        _check_running(seq, pool)


def _check_running(seq: Sequence, pool: PagePool) -> None:
    ps, nc, job = pool.page_size, seq.num_computed, seq.job_id
    _require(seq.status is SequenceStatus.RUNNING, f"job {job} is listed running but {seq.status}")
    _require(nc <= seq.num_tokens - 1, f"job {job}: {nc} tokens computed of {seq.num_tokens}")
    _require(len(seq.page_table) * ps >= nc,
             f"job {job}: {len(seq.page_table)} pages cannot hold {nc} computed tokens")
    hashes = seq.hashes_upto(nc // ps, ps)
    for k in range(nc // ps):
        page_hash = pool.page_hash(seq.page_table[k])
        _require(page_hash is None or page_hash == hashes[k],
                 f"job {job}: page {seq.page_table[k]} at index {k} is registered with another "
                 "prefix's hash")
    for k in range(nc // ps, len(seq.page_table)):
        page = seq.page_table[k]
        _require(pool.ref_count(page) == 1 and pool.page_hash(page) is None,
                 f"job {job} will write page {page} (index {k}) but it is shared or registered")
        _require(pool.record_len(page) <= max(0, nc - k * ps),
                 f"job {job}: page {page} records more tokens than the job has computed")


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise AssertionError(f"sequence invariant violated: {message}")


def resolve_pending(jobs: Mapping[int, Sequence], plan: StepPlan, tokens: SeqOf[int],
                    pending: int) -> None:
    """Replace the ``pending`` placeholders of ``plan``'s sampled tokens by ``tokens`` (one
    per sampling slice, in plan order). Jobs finished since are skipped; preempted ones are
    resolved too (they recompute their tokens later).

    A page is registered only when its last position is computed, one step after the token
    there was sampled: by then it was resolved, so no placeholder is ever hashed."""
    slices = plan.slices
    if len(tokens) != len(slices):  # some slices sample nothing: pair the others with tokens
        slices = [sl for sl in slices if sl.sample]
    get = jobs.get
    for sl, token in zip(slices, tokens, strict=True):
        seq = get(sl.job_id)
        if seq is None:
            continue
        index = sl.start_pos + len(sl.token_ids)  # `end_pos`, inlined: this runs per job
        ids = seq.token_ids
        if index >= len(ids) or ids[index] != pending:
            raise RuntimeError(f"job {sl.job_id} has no pending token at position {index}; "
                               "resolve each overlapped step once, in order")
        ids[index] = token


def apply_decode_tokens(running: Mapping[int, Sequence], plan: StepPlan, tokens: SeqOf[int],
                        page_size: int,
                        advance: Callable[[Sequence, SequenceSlice, int, SeqOf[int]], None]
                        ) -> None:
    """`Scheduler.apply_tokens`: ``tokens[i]`` is the token of ``plan``'s ``i``-th sampling
    slice. A decode of one token that fills no page is applied here (all it changes is the
    computed count and the new token); any other slice goes through ``advance`` (the
    scheduler's general step: ``advance(seq, slice, accepted drafts, new tokens)``). Jobs no
    longer in ``running`` are skipped."""
    slices = plan.slices
    if len(tokens) == len(slices):  # every slice samples (steady decoding): pair them directly
        paired: Iterable[tuple[SequenceSlice, int | None]] = zip(slices, tokens, strict=True)
    else:
        next_token = iter(tokens).__next__
        paired = [(sl, next_token() if sl.sample else None) for sl in slices]
    get = running.get
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
