"""`prefix_hashes` (the page pool's names for a prompt's full pages) and `RoutedPrefixes` (a
request router's bounded record of what it sent to each replica)."""

from __future__ import annotations

from dyngen_core.engine.pages import ROOT_HASH, PagePool, chain_hash, prefix_hashes
from dyngen_core.serve.replicas.prefixes import RoutedPrefixes


def test_prefix_hashes_are_the_pools_names_for_full_pages_only() -> None:
    tokens = list(range(10))
    hashes = prefix_hashes(tokens, 4)
    assert hashes == [chain_hash(ROOT_HASH, tokens[:4]),
                      chain_hash(chain_hash(ROOT_HASH, tokens[:4]), tokens[4:8])]
    assert prefix_hashes(tokens[:3], 4) == []
    assert prefix_hashes(tokens[:8], 4) == hashes
    pool = PagePool(4, page_size=4)
    pages = [pool.allocate(), pool.allocate()]
    pool.register_full(pages[0], ROOT_HASH, tokens[:4])
    pool.register_full(pages[1], hashes[0], tokens[4:8])
    assert [pool.page_hash(p) for p in pages] == hashes


def test_a_match_counts_leading_pages_only() -> None:
    record = RoutedPrefixes(pages_per_replica=8)
    a, b = prefix_hashes(list(range(12)), 4), prefix_hashes([0, 1, 2, 3, 9, 9, 9, 9], 4)
    record.record("r1", a)
    assert record.matched_pages("r1", a) == 3
    assert record.matched_pages("r1", b) == 1  # the shared first page only
    assert record.matched_pages("r2", a) == 0
    assert record.recorded_pages("r1") == 3


def test_the_record_is_bounded_and_evicts_the_oldest_prompt_tail_first() -> None:
    record = RoutedPrefixes(pages_per_replica=4)
    old = prefix_hashes(list(range(12)), 4)
    new = prefix_hashes(list(range(100, 108)), 4)
    record.record("r", old)
    record.record("r", new)
    assert record.recorded_pages("r") == 4
    assert record.matched_pages("r", new) == 2
    assert record.matched_pages("r", old) == 2  # its last page went first
    record.record("r", old)  # routing it again makes it the most recent
    assert record.matched_pages("r", old) == 3
    assert record.matched_pages("r", new) == 1


def test_gone_replicas_are_forgotten() -> None:
    record = RoutedPrefixes(pages_per_replica=4)
    hashes = prefix_hashes(list(range(8)), 4)
    for replica in ("r1", "r2", "r3"):
        record.record(replica, hashes)
    record.keep_only(["r1", "r2"])
    record.forget("r1")
    assert [record.matched_pages(r, hashes) for r in ("r1", "r2", "r3")] == [0, 2, 0]
