"""Per-job sequence state kept by the scheduler, its read-only view, and the page bookkeeping
between a sequence and the pool (prefix reuse at admission, registering filled pages, rewinds,
releases, the sequences' invariant).

A `Sequence` is the scheduler's bookkeeping for one job: its token ids (prompt then generated),
how many of them have their keys and values in the cache (``num_computed``), its page table and
the chain hashes of its full pages. It holds no reference to the job object or to tensors.

Prefix reuse at admission: `match_prefix` walks a waiting job's full pages through the pool's
hash index (each hit is a page the job shares: a prompt-cache hit or a page of a running job),
then offers the first page that misses to `PagePool.find_partial` for a copy of its matching
leading slots; `take_prefix_pages` gives the job what matched. A job never writes into a page it
shares, so when every page hits, the last one is copied rather than shared: its final slot is
recomputed to get the logits.

Dedup among jobs admitted close together (the same step, or while the first is still
prefilling): pages enter the pool's index only once computed, so a running job's not-yet-computed
prompt pages are listed in an `InflightIndex`. A waiting job whose next missing page would be
computed by a running job (whole page, or a longer partial match than the cache offers) is
*deferred* (when waiting saves at least MIN_PARTIAL_MATCH tokens over what the cache offers
now): it stays in the queue, uncounted as a skip, and is admitted once those pages are in the
pool — so 64 jobs sharing a document prefill it once, and the rest share or copy it.
"""

from __future__ import annotations

import enum
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field

from dyngen_core.engine.pages import (
    MIN_PARTIAL_MATCH,
    ROOT_HASH,
    PagePool,
    chain_hash,
    common_prefix_len,
)
from dyngen_core.engine.plan import PageCopy


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


@dataclass
class PrefixMatch:
    """What a job can reuse: ``hit_pages`` shared as they are, then ``copy_len`` leading slots of
    ``copy_src`` copied into a fresh page (``copy_src`` is None when nothing is copied)."""

    hit_pages: list[int]
    copy_src: int | None
    copy_len: int
    page_size: int

    @property
    def reused_tokens(self) -> int:
        return len(self.hit_pages) * self.page_size + self.copy_len


class InflightIndex:
    """Prefilling jobs by the parent hash of each page they have yet to compute."""

    def __init__(self) -> None:
        self._by_parent: dict[bytes, dict[int, Sequence]] = {}
        self._keys: dict[int, list[bytes]] = {}

    def add(self, seq: Sequence, page_size: int) -> None:
        """List every page of ``seq`` from its first uncomputed one to its last token."""
        self.remove(seq)
        first, last = seq.num_computed // page_size, (seq.num_tokens - 1) // page_size
        hashes = seq.hashes_upto(last, page_size)
        keys = [hashes[k - 1] if k else ROOT_HASH for k in range(first, last + 1)]
        for key in keys:
            self._by_parent.setdefault(key, {})[seq.job_id] = seq
        self._keys[seq.job_id] = keys

    def remove(self, seq: Sequence) -> None:
        for key in self._keys.pop(seq.job_id, ()):
            group = self._by_parent[key]
            group.pop(seq.job_id, None)
            if not group:
                del self._by_parent[key]

    def best_match(self, parent: bytes, page_index: int, tokens: tuple[int, ...],
                   page_size: int) -> int:
        """Longest match of ``tokens`` against page ``page_index`` of a job still computing it."""
        best = 0
        for other in self._by_parent.get(parent, {}).values():
            if other.num_computed >= (page_index + 1) * page_size:
                continue
            theirs = tuple(other.page_tokens(page_index, page_size))
            best = max(best, common_prefix_len(theirs, tokens))
        return best

    def __len__(self) -> int:
        return len(self._keys)


def match_prefix(seq: Sequence, pool: PagePool, inflight: InflightIndex | None, *,
                 share_running: bool) -> PrefixMatch | None:
    """What ``seq`` (waiting, holding no pages) can reuse; None means defer its admission.

    inflight: running jobs' uncomputed pages (None when dedup is off: never defer).
    share_running: whether pages referenced by running jobs may be shared or copied.
    """
    ps = pool.page_size
    tokens = seq.token_ids
    limit = len(tokens) - 1  # the last token is always computed, for its logits
    num_full = len(tokens) // ps
    hashes = seq.hashes_upto(num_full, ps)
    hits: list[int] = []
    parent = ROOT_HASH
    for k in range(num_full):
        page = pool.lookup(parent, tokens[k * ps:(k + 1) * ps], block_hash=hashes[k],
                           include_referenced=share_running)
        if page is None:
            break
        hits.append(page)
        parent = hashes[k]
    k = len(hits)
    if k * ps > limit:
        # Every page hit: copy the last one instead of sharing it, since its final slot is
        # rewritten when the last token is recomputed.
        last_hit = hits.pop()
        return PrefixMatch(hits, last_hit, limit - (k - 1) * ps, ps)
    page_tokens = tuple(tokens[k * ps:min((k + 1) * ps, len(tokens))])
    src, n = pool.find_partial(parent, page_tokens, include_referenced=share_running)
    if inflight is not None:
        pending = inflight.best_match(parent, k, page_tokens, ps)
        if pending >= n + MIN_PARTIAL_MATCH:  # waiting must save real work, not a token or two
            return None
    n = min(n, limit - k * ps)
    if src is None or n < MIN_PARTIAL_MATCH:
        return PrefixMatch(hits, None, 0, ps)
    return PrefixMatch(hits, src, n, ps)


def take_prefix_pages(seq: Sequence, match: PrefixMatch, pool: PagePool, watermark: int,
                      copies: list[PageCopy]) -> PrefixMatch | None:
    """Give ``seq`` its matched prefix pages (referenced) and, for a partly matching page, a
    fresh page with a copy queued in ``copies``, if the pages its whole prefill still needs
    fit while keeping ``watermark`` pages free. A copy whose cached source must outlive the
    copy needs one page more than computing those slots: when only that page is missing, the
    job takes its full pages and computes the rest itself (a job that needs the whole cache
    would otherwise wait forever). Returns the match taken, or None (nothing taken)."""
    cached_hits = sum(1 for p in match.hit_pages if pool.ref_count(p) == 0)
    src_cached = match.copy_src is not None and pool.ref_count(match.copy_src) == 0
    need = -(-seq.num_tokens // pool.page_size) - len(match.hit_pages) + cached_hits
    room = pool.free_count() - watermark
    if need + src_cached > room:
        if need > room or match.copy_src is None:
            return None
        match = PrefixMatch(match.hit_pages, None, 0, match.page_size)
    for page in match.hit_pages:
        pool.ref(page)
    seq.page_table = list(match.hit_pages)
    if match.copy_src is not None:
        pool.ref(match.copy_src)  # so allocating the copy's page cannot evict its source
        dst = pool.allocate()
        pool.release(match.copy_src)
        copies.append(PageCopy(match.copy_src, dst, match.copy_len))
        seq.page_table.append(dst)
    return match


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
