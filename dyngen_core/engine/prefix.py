"""Prefix reuse at admission: which pages of a waiting job are already in the cache.

`match_prefix` walks a job's full pages through the pool's hash index (each hit is a page the job
shares: a prompt-cache hit or a page of a running job), then offers the first page that misses to
`PagePool.find_partial` for a copy of its matching leading slots. A job never writes into a page
it shares, so when every page hits, the last one is copied rather than shared: its final slot is
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

from dataclasses import dataclass

from dyngen_core.engine.pages import MIN_PARTIAL_MATCH, ROOT_HASH, PagePool, common_prefix_len
from dyngen_core.engine.plan import PageCopy
from dyngen_core.engine.sequence import Sequence


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
                      copies: list[PageCopy]) -> bool:
    """Give ``seq`` its matched prefix pages (referenced) and, for a partly matching page, a
    fresh page with a copy queued in ``copies``, if the pages its whole prefill still needs
    fit while keeping ``watermark`` pages free; False (nothing taken) otherwise."""
    cached_hits = sum(1 for p in match.hit_pages if pool.ref_count(p) == 0)
    src_cached = match.copy_src is not None and pool.ref_count(match.copy_src) == 0
    need = -(-seq.num_tokens // pool.page_size) - len(match.hit_pages) + cached_hits + src_cached
    if need > pool.free_count() - watermark:
        return False
    for page in match.hit_pages:
        pool.ref(page)
    seq.page_table = list(match.hit_pages)
    if match.copy_src is not None:
        pool.ref(match.copy_src)  # so allocating the copy's page cannot evict its source
        dst = pool.allocate()
        pool.release(match.copy_src)
        copies.append(PageCopy(match.copy_src, dst, match.copy_len))
        seq.page_table.append(dst)
    return True
