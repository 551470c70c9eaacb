"""`RoutedPrefixes`: per replica, the page hashes of the prompts a router sent there — the
router's picture of each replica's prompt cache.

A replica's engine keeps a prompt's full pages, named by their chained hashes, in an LRU prompt
cache of a bounded number of pages (`dyngen_core.engine.pages`). The router cannot see that
cache (it lives in another process, behind the engine's public API), so it keeps its own record
of what it routed to each replica, bounded by the same number of pages and evicted in the same
order: least recently routed first and, within one prompt, its last page first (a finished job
frees its pages tail-first). The record is an approximation: it does not see evictions forced
by other traffic a replica receives (another router, a direct caller), nor pages of generated
text; it errs towards a replica that used to hold a prefix, which costs a recompute, never a
wrong answer.

Because hashes chain, a prompt's match on a replica is the number of its leading pages found in
that replica's record: page k can be reused only if pages 0..k-1 are too.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterable, Sequence


class RoutedPrefixes:
    """Bounded LRU records of page hashes, one per replica.

    pages_per_replica: the most hashes kept per replica (the replica cache's page count).
    """

    def __init__(self, pages_per_replica: int) -> None:
        if pages_per_replica < 1:
            raise ValueError(f"pages_per_replica must be >= 1; got {pages_per_replica}")
        self.pages_per_replica = pages_per_replica
        self._records: dict[Hashable, OrderedDict[bytes, None]] = {}

    def matched_pages(self, replica: Hashable, hashes: Sequence[bytes]) -> int:
        """How many leading pages of a prompt (its chained ``hashes``) ``replica`` holds."""
        record = self._records.get(replica)
        if not record:
            return 0
        count = 0
        for page_hash in hashes:
            if page_hash not in record:
                break
            count += 1
        return count

    def recorded_pages(self, replica: Hashable) -> int:
        """How many page hashes the record of ``replica`` holds."""
        return len(self._records.get(replica, ()))

    def record(self, replica: Hashable, hashes: Sequence[bytes]) -> None:
        """Note that a prompt with these page ``hashes`` went to ``replica``: its pages become
        the most recent (its first page most recent of all), and the oldest pages beyond
        ``pages_per_replica`` are forgotten."""
        record = self._records.setdefault(replica, OrderedDict())
        for page_hash in reversed(hashes[:self.pages_per_replica]):
            record[page_hash] = None
            record.move_to_end(page_hash)
        while len(record) > self.pages_per_replica:
            record.popitem(last=False)

    def keep_only(self, replicas: Iterable[Hashable]) -> None:
        """Forget every replica not in ``replicas`` (gone replicas free their caches)."""
        alive = set(replicas)
        for replica in [r for r in self._records if r not in alive]:
            del self._records[replica]

    def forget(self, replica: Hashable) -> None:
        """Drop the record of ``replica`` (it died or was removed)."""
        self._records.pop(replica, None)
