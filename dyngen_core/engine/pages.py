"""`PagePool`: which cache pages are free, cached or referenced, and what each one holds.

Integers and hashes only: the pool never sees a tensor or a job. Every page is in exactly one
state:

- referenced: ``ref_count > 0``; held by that many page tables.
- cached: unreferenced but still holding data that a later job may reuse. These pages sit in LRU
  order and ARE the prompt cache. A cached page holds a *record*: either a full page (its chained
  hash and its 256 token ids) or a partial page (the leading token ids of a page whose job left
  before filling it).
- free: unreferenced and holding nothing worth keeping.

Allocation prefers free pages, then evicts the least recently used cached page (dropping its
record). Hashes chain: a full page's hash covers its parent page's hash and its own token ids, so
one hash names a whole prefix. A hit is verified on the page's own token ids and parent hash; a
false hit would need a 128-bit blake2b collision of two different prefixes (probability about
2**-64 after 2**32 distinct pages), which we accept.

Partial records (kept only if at least `MIN_PARTIAL_MATCH` tokens long) make trailing-page reuse
possible: `find_partial` returns the recorded page whose first tokens match longest, and the
caller copies those slots into a page of its own. Records are indexed by parent hash and the first
`MIN_PARTIAL_MATCH` token ids, and at most `MAX_PARTIAL_CANDIDATES` of the most recent records per
key are compared, so a lookup stays cheap however large the cache grows.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Iterable, Sequence

from dyngen_core.errors import DynGenError

ROOT_HASH = b""
HASH_BYTES = 16
MIN_PARTIAL_MATCH = 16
MAX_PARTIAL_CANDIDATES = 16

HeadKey = tuple[bytes, tuple[int, ...]]


class PagePoolExhaustedError(DynGenError, RuntimeError):
    """`PagePool.allocate` was called with every page referenced (a scheduler bug: it must check
    `free_count` first)."""


def chain_hash(parent_hash: bytes, token_ids: Sequence[int]) -> bytes:
    """The hash naming the prefix that ends with this page: blake2b over the parent page's hash
    (`ROOT_HASH` for a job's first page) and the page's token ids packed as int64."""
    digest = hashlib.blake2b(parent_hash, digest_size=HASH_BYTES)
    digest.update(array("q", token_ids).tobytes())
    return digest.digest()


def prefix_hashes(token_ids: Sequence[int], page_size: int) -> list[bytes]:
    """The chained hashes of every full page of ``token_ids`` (pages of ``page_size`` tokens,
    a trailing partial page left out): the names the page pool gives those pages, so the
    hash at index k names the prefix ``token_ids[:(k + 1) * page_size]``."""
    if page_size < 1:
        raise ValueError(f"page_size must be >= 1; got {page_size}")
    hashes: list[bytes] = []
    parent = ROOT_HASH
    for start in range(0, len(token_ids) - page_size + 1, page_size):
        parent = chain_hash(parent, token_ids[start:start + page_size])
        hashes.append(parent)
    return hashes


def common_prefix_len(a: Sequence[int], b: Sequence[int], lo: int = 0,
                      hi: int | None = None) -> int:
    """Length of the longest common prefix of two sequences (binary search over C-speed slice
    comparisons rather than a Python loop), given that the first ``lo`` items agree and looking
    no further than ``hi`` (default: the shorter length)."""
    n = min(len(a), len(b)) if hi is None else hi
    if a[lo:n] == b[lo:n]:
        return n
    hi = n  # a[:lo] == b[:lo] and a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo


class PagePool:
    """Reference counts, records and the LRU prompt cache of ``num_pages`` pages.

    num_pages: pages in the cache.
    page_size: slots per page (256 by default).
    keep_cached: when False (prompt cache off) a page that loses its last reference drops its
        record and becomes free at once, so nothing is reused after its job leaves.
    """

    def __init__(self, num_pages: int, page_size: int = 256, *, keep_cached: bool = True) -> None:
        if num_pages < 1 or page_size < 1:
            raise ValueError(f"num_pages ({num_pages}) and page_size ({page_size}) must be >= 1")
        self.num_pages = num_pages
        self.page_size = page_size
        self.keep_cached = keep_cached
        self._refs = [0] * num_pages
        self._hash: list[bytes | None] = [None] * num_pages
        self._parent: list[bytes | None] = [None] * num_pages
        self._tokens: list[tuple[int, ...] | None] = [None] * num_pages
        # A stack, so page 0, 1, 2... are handed out first and recently freed pages are reused.
        self._free = list(range(num_pages - 1, -1, -1))
        self._cached: OrderedDict[int, None] = OrderedDict()
        self._by_hash: dict[bytes, int] = {}
        self._by_head: dict[HeadKey, dict[int, None]] = {}

    # ---- allocation and references -----------------------------------------------------------

    def free_count(self) -> int:
        """Pages `allocate` can hand out now: free plus cached (evictable) pages."""
        return len(self._free) + len(self._cached)

    def allocate(self) -> int:
        """Take a page (ref count 1, no record): a free one if any, else evict the least
        recently used cached page. Raises PagePoolExhaustedError if every page is referenced."""
        if self._free:
            page = self._free.pop()
        elif self._cached:
            page, _ = self._cached.popitem(last=False)
            self._drop_record(page)
        else:
            raise PagePoolExhaustedError(
                f"all {self.num_pages} pages are referenced; check free_count() before allocating"
            )
        self._refs[page] = 1
        return page

    def ref(self, page: int) -> None:
        """Add a reference to a page that holds data (referenced, or cached: a cache hit takes it
        out of the LRU)."""
        if self._refs[page] == 0:
            if page not in self._cached:
                raise ValueError(f"page {page} is free (holds no data); allocate() it instead")
            del self._cached[page]
        self._refs[page] += 1

    def release(self, page: int) -> None:
        """Drop one reference. At zero the page joins the most recent end of the LRU if it holds
        a record (and keep_cached is on), else it becomes free."""
        if self._refs[page] <= 0:
            raise ValueError(f"page {page} is not referenced; it was released too often")
        self._refs[page] -= 1
        if self._refs[page]:
            return
        if self.keep_cached and self._tokens[page] is not None:
            self._cached[page] = None
        else:
            self._drop_record(page)
            self._free.append(page)

    # ---- records and lookups -----------------------------------------------------------------

    def lookup(self, parent_hash: bytes, token_ids: Sequence[int], *,
               block_hash: bytes | None = None, include_referenced: bool = True) -> int | None:
        """The page holding exactly this full page after ``parent_hash``, or None.

        block_hash: the page's chain hash if the caller already has it (saves rehashing).
        include_referenced: when False only cached pages count (no sharing with running jobs).
        """
        key = block_hash if block_hash is not None else chain_hash(parent_hash, token_ids)
        page = self._by_hash.get(key)
        if page is None or self._parent[page] != parent_hash:
            return None
        if self._tokens[page] != tuple(token_ids):
            return None
        if not include_referenced and self._refs[page]:
            return None
        return page

    def register_full(self, page: int, parent_hash: bytes, token_ids: Sequence[int], *,
                      block_hash: bytes | None = None) -> int | None:
        """Record a referenced page that has just been filled and computed.

        Returns the page now named by the hash: ``page`` itself when newly registered; another
        page when an identical one is already registered (``page`` then keeps no record, and the
        caller may switch to the other page and release its own: dedup of generated pages); None
        on a hash collision with different content (``page`` keeps no record).
        """
        tokens = tuple(token_ids)
        if len(tokens) != self.page_size:
            raise ValueError(f"page {page}: {len(tokens)} token ids, a full page has "
                             f"{self.page_size}")
        if self._refs[page] <= 0:
            raise ValueError(f"page {page} is not referenced; only a job's own page is registered")
        key = block_hash if block_hash is not None else chain_hash(parent_hash, tokens)
        if self._hash[page] == key:
            return page
        self._drop_record(page)
        existing = self._by_hash.get(key)
        if existing is not None:
            same = self._tokens[existing] == tokens and self._parent[existing] == parent_hash
            return existing if same else None
        self._set_record(page, parent_hash, tokens, key)
        return page

    def record_partial(self, page: int, parent_hash: bytes, token_ids: Sequence[int]) -> None:
        """Note that a page's first slots hold these (computed) token ids, so `find_partial` can
        offer them for copying. Records shorter than MIN_PARTIAL_MATCH are not kept."""
        if self._hash[page] is not None:
            raise ValueError(f"page {page} is a registered full page; truncate() it first")
        self._drop_record(page)
        tokens = tuple(token_ids)
        if MIN_PARTIAL_MATCH <= len(tokens) < self.page_size:
            self._set_record(page, parent_hash, tokens, None)

    def truncate(self, page: int, num_tokens: int) -> None:
        """Keep only the first ``num_tokens`` of a page's record (a job rewound into it). A full
        page loses its hash and becomes a partial record. Only its single holder may do this."""
        if self._refs[page] != 1:
            raise ValueError(f"page {page} has {self._refs[page]} references; only an exclusively "
                             "held page can be truncated")
        tokens, parent = self._tokens[page], self._parent[page]
        if tokens is None or parent is None or num_tokens >= len(tokens):
            return
        self._drop_record(page)
        if num_tokens >= MIN_PARTIAL_MATCH:
            self._set_record(page, parent, tokens[:num_tokens], None)

    def find_partial(self, parent_hash: bytes, token_ids: Sequence[int], *,
                     include_referenced: bool = True) -> tuple[int | None, int]:
        """The recorded page after ``parent_hash`` whose first token ids match ``token_ids``
        longest, as ``(page, matching count)``; ``(None, 0)`` when no record matches at least
        MIN_PARTIAL_MATCH tokens. The caller copies the matching slots; it never shares the page.

        include_referenced: when False only cached pages are offered.
        """
        tokens = tuple(token_ids)
        if len(tokens) < MIN_PARTIAL_MATCH:
            return None, 0
        candidates = self._by_head.get((parent_hash, tokens[:MIN_PARTIAL_MATCH]))
        best, best_len = None, 0
        for i, page in enumerate(reversed(candidates or {})):
            if i == MAX_PARTIAL_CANDIDATES:
                break
            if not include_referenced and self._refs[page]:
                continue
            stored = self._tokens[page]
            assert stored is not None  # indexed pages always hold a record
            n = common_prefix_len(stored, tokens)
            if n > best_len:
                best, best_len = page, n
        return best, best_len

    def forget(self, page: int) -> None:
        """Drop what the pool knows of a page's contents (they were lost, e.g. a page copy that
        never ran): the page is no longer offered to lookups, and a cached page becomes free.
        A referenced page keeps its references."""
        self._drop_record(page)
        if self._refs[page] == 0 and page in self._cached:
            del self._cached[page]
            self._free.append(page)

    # ---- queries ------------------------------------------------------------------------------

    def ref_count(self, page: int) -> int:
        return self._refs[page]

    def page_hash(self, page: int) -> bytes | None:
        """The chain hash of a registered full page, else None."""
        return self._hash[page]

    def record_len(self, page: int) -> int:
        """How many leading token ids the page's record holds (0 without a record)."""
        tokens = self._tokens[page]
        return 0 if tokens is None else len(tokens)

    def cached_pages(self) -> list[int]:
        """Cached pages, least recently used first."""
        return list(self._cached)

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_cached(self) -> int:
        return len(self._cached)

    @property
    def num_referenced(self) -> int:
        return self.num_pages - len(self._free) - len(self._cached)

    # ---- relabelling and checks ---------------------------------------------------------------

    def remap(self, mapping: dict[int, int]) -> None:
        """Move pages to new ids (defragmentation): ``mapping`` sends old ids to new ids for pages
        that hold data; every target must be vacated (free, or itself moved). The caller moves
        the storage contents and rewrites page tables."""
        moved = {p: mapping.get(p, p) for p in range(self.num_pages) if self._holds_data(p)}
        if len(set(moved.values())) != len(moved):
            raise ValueError("remap sends two pages holding data to the same id")
        refs, hashes, parents, tokens = self._refs, self._hash, self._parent, self._tokens
        n = self.num_pages
        self._refs, self._hash, self._parent, self._tokens = [0] * n, [None] * n, [None] * n, \
            [None] * n
        self._by_hash, self._by_head = {}, {}
        for old, new in moved.items():
            self._refs[new] = refs[old]
            old_tokens, old_parent = tokens[old], parents[old]
            if old_tokens is not None and old_parent is not None:
                self._set_record(new, old_parent, old_tokens, hashes[old])
        self._cached = OrderedDict((moved[p], None) for p in self._cached)
        self._free = [p for p in range(n - 1, -1, -1) if not self._holds_data(p)]

    def check_invariant(self, page_tables: Iterable[Sequence[int]]) -> None:
        """Raise AssertionError unless every page is exactly one of free / cached / referenced,
        ref counts equal the page-table occurrences, and the hash index matches the records."""
        counts = [0] * self.num_pages
        for table in page_tables:
            for page in table:
                counts[page] += 1
        free = set(self._free)
        _require(len(free) == len(self._free), f"free list holds duplicates: {self._free}")
        for page in range(self.num_pages):
            self._check_page(page, counts[page], page in free)
        for key, page in self._by_hash.items():
            _require(self._hash[page] == key, f"hash index points at page {page} with another hash")
        indexed = sum(len(group) for group in self._by_head.values())
        recorded = sum(1 for t in self._tokens if t is not None)
        _require(indexed == recorded, f"{recorded} pages hold records but {indexed} are indexed")

    def _check_page(self, page: int, count: int, is_free: bool) -> None:
        refs, is_cached = self._refs[page], page in self._cached
        _require(refs == count, f"page {page}: ref count {refs} but {count} page-table entries")
        states = [name for name, on in (("referenced", refs > 0), ("cached", is_cached),
                                        ("free", is_free)) if on]
        _require(len(states) == 1, f"page {page} is {' and '.join(states) or 'in no state'}")
        if is_cached:
            _require(self._tokens[page] is not None, f"cached page {page} holds no record")
        if is_free:
            _require(self._tokens[page] is None, f"free page {page} still holds a record")
        if self._hash[page] is not None:
            _require(self._by_hash.get(self._hash[page]) == page,  # type: ignore[arg-type]
                     f"page {page} has a hash missing from the index")

    # ---- internals ----------------------------------------------------------------------------

    def _holds_data(self, page: int) -> bool:
        return self._refs[page] > 0 or page in self._cached

    def _set_record(self, page: int, parent: bytes, tokens: tuple[int, ...],
                    block_hash: bytes | None) -> None:
        self._parent[page], self._tokens[page], self._hash[page] = parent, tokens, block_hash
        if block_hash is not None:
            self._by_hash[block_hash] = page
        self._by_head.setdefault((parent, tokens[:MIN_PARTIAL_MATCH]), {})[page] = None

    def _drop_record(self, page: int) -> None:
        tokens, parent, block_hash = self._tokens[page], self._parent[page], self._hash[page]
        if tokens is None or parent is None:
            return
        if block_hash is not None and self._by_hash.get(block_hash) == page:
            del self._by_hash[block_hash]
        key = (parent, tokens[:MIN_PARTIAL_MATCH])
        group = self._by_head[key]
        del group[page]
        if not group:
            del self._by_head[key]
        self._tokens[page] = self._parent[page] = self._hash[page] = None


def _require(condition: bool, message: str) -> None:
    # An explicit raise, not `assert`: the invariant must also hold under `python -O`.
    if not condition:
        raise AssertionError(f"page invariant violated: {message}")
