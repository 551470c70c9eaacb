"""Per-job sequence state kept by the scheduler, its read-only view, and the page bookkeeping
between a sequence and the pool (registering filled pages, rewinds, releases, the sequences'
invariant).

A `Sequence` is the scheduler's bookkeeping for one job: its token ids (prompt then generated),
how many of them have their keys and values in the cache (``num_computed``), its page table and
the chain hashes of its full pages. It holds no reference to the job object or to tensors.
"""

from __future__ import annotations

import enum
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field

from dyngen_core.engine.pages import ROOT_HASH, PagePool, chain_hash


class SequenceStatus(enum.Enum):
    """WAITING: queued (or preempted), holds no pages. RUNNING: admitted, holds pages.
    FINISHED: finished or cancelled, pages released."""

    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False, slots=True)
class Sequence:
    """The scheduler's state for one job.

    token_ids: prompt then generated tokens. The last one's keys/values are never in the cache
        while running: it is fed by the next decode.
    num_computed: leading tokens whose keys/values are in the cache.
    page_table: page ids covering positions ``0 ..``; may run ahead of ``num_computed``.
    page_hashes: chain hashes of the full pages of ``token_ids`` (extended lazily).
    prefill_end: token count at the last admission; positions before it are prefill.
    num_cached_tokens: prompt tokens served from the cache, dedup or copies at first admission.
    num_skips: times later jobs were admitted while this one waited for pages.
    planned_pages / planned_ids / planned_drafts: the page table, fed tokens and (empty) drafts
        of the job's last decode slice, handed to its next decode slices while they still equal
        the job's (a plan's lists are never changed in place): a decode allocates no lists
        while nothing changed.
    """

    job_id: int
    token_ids: list[int]
    prompt_len: int
    max_new_tokens: int
    num_draft_tokens: int
    arrival: int
    num_computed: int = 0
    page_table: list[int] = field(default_factory=list)
    page_hashes: list[bytes] = field(default_factory=list)
    prefill_end: int = 0
    num_cached_tokens: int = 0
    num_skips: int = 0
    num_preemptions: int = 0
    admitted: bool = False
    status: SequenceStatus = SequenceStatus.WAITING
    planned_pages: list[int] | None = None
    planned_ids: list[int] | None = None
    planned_drafts: list[int] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_generated(self) -> int:
        return len(self.token_ids) - self.prompt_len

    @property
    def num_pending(self) -> int:
        """Tokens not yet in the cache; 1 means prefill is done and the next step decodes."""
        return len(self.token_ids) - self.num_computed

    def parent_hash(self, page_index: int, page_size: int) -> bytes:
        """The chain hash of the page before ``page_index`` (ROOT_HASH for the first page)."""
        return self.hashes_upto(page_index, page_size)[page_index - 1] if page_index else ROOT_HASH

    def hashes_upto(self, num_pages: int, page_size: int) -> list[bytes]:
        """Chain hashes of the first ``num_pages`` pages, which must be full; computed once."""
        hashes, tokens = self.page_hashes, self.token_ids
        while len(hashes) < num_pages:
            k = len(hashes)
            parent = hashes[k - 1] if k else ROOT_HASH
            hashes.append(chain_hash(parent, tokens[k * page_size:(k + 1) * page_size]))
        return hashes

    def page_tokens(self, page_index: int, page_size: int) -> list[int]:
        """The token ids that page ``page_index`` holds when complete (fewer for the last)."""
        return self.token_ids[page_index * page_size:(page_index + 1) * page_size]


class SequenceView:
    """Read-only view of a job's sequence state (copies are made only when asked for)."""

    __slots__ = ("_seq",)

    def __init__(self, seq: Sequence) -> None:
        self._seq = seq

    @property
    def job_id(self) -> int:
        return self._seq.job_id

    @property
    def token_ids(self) -> tuple[int, ...]:
        """Prompt then generated tokens (a copy)."""
        return tuple(self._seq.token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self._seq.token_ids)

    @property
    def last_token(self) -> int:
        return self._seq.token_ids[-1]

    @property
    def prompt_len(self) -> int:
        return self._seq.prompt_len

    @property
    def num_generated(self) -> int:
        return self._seq.num_generated

    @property
    def num_computed(self) -> int:
        return self._seq.num_computed

    @property
    def num_cached_tokens(self) -> int:
        return self._seq.num_cached_tokens

    @property
    def page_table(self) -> tuple[int, ...]:
        return tuple(self._seq.page_table)

    @property
    def status(self) -> SequenceStatus:
        return self._seq.status

    @property
    def num_preemptions(self) -> int:
        return self._seq.num_preemptions

    def __repr__(self) -> str:
        s = self._seq
        return (f"SequenceView(job_id={s.job_id}, status={s.status.value}, tokens={s.num_tokens}, "
                f"computed={s.num_computed}, pages={len(s.page_table)})")


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
