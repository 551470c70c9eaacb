"""PagePool and the defrag planner: pure integers and hashes."""

from __future__ import annotations

import pytest

from dyngen_core.engine import pages as pool_module
from dyngen_core.engine.defrag import plan_defrag
from dyngen_core.engine.pages import (
    MIN_PARTIAL_MATCH,
    ROOT_HASH,
    PagePool,
    PagePoolExhaustedError,
    chain_hash,
)

PS = 32


def full(seed: int) -> list[int]:
    return [seed * 1000 + i for i in range(PS)]


def registered(pool: PagePool, parent: bytes, tokens: list[int]) -> int:
    page = pool.allocate()
    assert pool.register_full(page, parent, tokens) == page
    return page


def test_allocate_prefers_free_pages_in_id_order_then_evicts_lru() -> None:
    pool = PagePool(3, PS)
    a = registered(pool, ROOT_HASH, full(1))
    b = registered(pool, ROOT_HASH, full(2))
    c = pool.allocate()
    assert (a, b, c) == (0, 1, 2)
    pool.release(c)  # no record: plain free
    pool.release(b)
    pool.release(a)  # a is now the most recently used cached page
    assert (pool.num_free, pool.num_cached, pool.num_referenced) == (1, 2, 0)
    assert pool.allocate() == c
    assert pool.allocate() == b  # least recently used cached page evicted first
    assert pool.lookup(ROOT_HASH, full(2)) is None  # its hash went with it
    assert pool.lookup(ROOT_HASH, full(1)) == a
    assert pool.allocate() == a
    with pytest.raises(PagePoolExhaustedError, match="free_count"):
        pool.allocate()


def test_ref_release_counts_and_cache_hit_leaves_lru() -> None:
    pool = PagePool(4, PS)
    page = registered(pool, ROOT_HASH, full(1))
    pool.ref(page)
    pool.release(page)
    assert pool.ref_count(page) == 1 and pool.num_cached == 0
    pool.release(page)
    assert pool.num_cached == 1 and pool.free_count() == 4
    pool.ref(page)  # a prompt-cache hit takes it out of the LRU
    assert pool.num_cached == 0 and pool.ref_count(page) == 1
    pool.release(page)
    with pytest.raises(ValueError, match="released too often"):
        pool.release(page)
    with pytest.raises(ValueError, match="free"):
        pool.ref(3)  # never filled: nothing to share


def test_hash_chains_whole_prefix() -> None:
    h1 = chain_hash(ROOT_HASH, full(1))
    assert chain_hash(h1, full(2)) != chain_hash(chain_hash(ROOT_HASH, full(3)), full(2))
    assert chain_hash(h1, full(2)) == chain_hash(chain_hash(ROOT_HASH, full(1)), full(2))
    pool = PagePool(4, PS)
    first = registered(pool, ROOT_HASH, full(1))
    second = registered(pool, h1, full(2))
    assert pool.lookup(h1, full(2)) == second
    assert pool.lookup(ROOT_HASH, full(2)) is None  # same tokens, different prefix
    assert pool.page_hash(first) == h1


def test_hit_is_verified_on_tokens_so_collisions_cannot_corrupt(monkeypatch) -> None:
    pool = PagePool(4, PS)
    monkeypatch.setattr(pool_module, "chain_hash", lambda parent, ids: b"same")
    page = registered(pool, ROOT_HASH, full(1))
    assert pool.lookup(ROOT_HASH, full(2)) is None  # hash matches, tokens do not
    other = pool.allocate()
    assert pool.register_full(other, ROOT_HASH, full(2)) is None  # collision: not registered
    assert pool.page_hash(other) is None and pool.lookup(ROOT_HASH, full(1)) == page
    pool.check_invariant([[page], [other]])


def test_register_reports_identical_page_for_dedup() -> None:
    pool = PagePool(4, PS)
    first = registered(pool, ROOT_HASH, full(1))
    second = pool.allocate()
    assert pool.register_full(second, ROOT_HASH, full(1)) == first
    assert pool.page_hash(second) is None
    assert pool.lookup(ROOT_HASH, full(1)) == first
    assert pool.lookup(ROOT_HASH, full(1), include_referenced=False) is None
    pool.release(second)
    assert pool.num_free == 3  # the unregistered duplicate holds nothing worth caching


def test_partial_match_over_full_and_partial_records() -> None:
    pool = PagePool(4, PS)
    page = registered(pool, ROOT_HASH, full(1))
    query = full(1)[:20] + [7] * 5
    assert pool.find_partial(ROOT_HASH, query) == (page, 20)
    assert pool.find_partial(b"other", query) == (None, 0)
    assert pool.find_partial(ROOT_HASH, query, include_referenced=False) == (None, 0)
    tail = pool.allocate()
    pool.record_partial(tail, ROOT_HASH, [5] * 24)
    pool.release(tail)  # a partial record keeps the page cached
    assert pool.num_cached == 1
    assert pool.find_partial(ROOT_HASH, [5] * 30) == (tail, 24)
    assert pool.find_partial(ROOT_HASH, [5] * (MIN_PARTIAL_MATCH - 1)) == (None, 0)
    short = pool.allocate()
    pool.record_partial(short, ROOT_HASH, [6] * (MIN_PARTIAL_MATCH - 1))
    pool.release(short)
    assert pool.record_len(short) == 0 and pool.num_free >= 1  # too short to keep


def test_truncate_turns_full_page_into_partial_record() -> None:
    pool = PagePool(4, PS)
    page = registered(pool, ROOT_HASH, full(1))
    pool.truncate(page, 20)
    assert pool.page_hash(page) is None and pool.lookup(ROOT_HASH, full(1)) is None
    assert pool.find_partial(ROOT_HASH, full(1)) == (page, 20)
    pool.ref(page)
    with pytest.raises(ValueError, match="exclusively"):
        pool.truncate(page, 10)


def test_keep_cached_off_drops_records_on_release() -> None:
    pool = PagePool(2, PS, keep_cached=False)
    page = registered(pool, ROOT_HASH, full(1))
    pool.release(page)
    assert pool.num_cached == 0 and pool.lookup(ROOT_HASH, full(1)) is None


def test_invariant_detects_each_violation() -> None:
    pool = PagePool(4, PS)
    a = registered(pool, ROOT_HASH, full(1))
    b = pool.allocate()
    pool.check_invariant([[a, b]])
    with pytest.raises(AssertionError, match="ref count 1 but 2"):
        pool.check_invariant([[a, b], [a]])
    with pytest.raises(AssertionError, match="ref count 1 but 0"):
        pool.check_invariant([[a]])
    pool._free.append(a)  # corrupt: a referenced page also on the free list
    with pytest.raises(AssertionError, match="referenced and free"):
        pool.check_invariant([[a, b]])
    pool._free.remove(a)
    pool.release(a)
    pool._refs[a] = 1  # corrupt: cached and referenced at once
    with pytest.raises(AssertionError, match="referenced and cached"):
        pool.check_invariant([[a, b]])


def test_remap_moves_every_state() -> None:
    pool = PagePool(5, PS)
    a = registered(pool, ROOT_HASH, full(1))
    b = pool.allocate()
    c = registered(pool, chain_hash(ROOT_HASH, full(1)), full(2))
    pool.release(c)
    pool.remap({a: 4, c: 0})
    assert pool.lookup(ROOT_HASH, full(1)) == 4
    assert pool.cached_pages() == [0]
    assert pool.ref_count(4) == 1 and pool.ref_count(b) == 1
    pool.check_invariant([[4, b]])
    with pytest.raises(ValueError, match="same id"):
        pool.remap({4: b})


def apply_copies(contents: dict[int, str], copies) -> dict[int, str]:
    out = dict(contents)
    for copy in copies:
        assert copy.num_slots == PS
        if copy.src in out:
            out[copy.dst] = out[copy.src]
        else:
            out.pop(copy.dst, None)
    return out


@pytest.mark.parametrize("tables, cached", [
    ([[7, 3, 9], [3, 1]], [5, 0]),          # chains into free pages
    ([[1, 0], [3, 2]], [4]),                 # pure cycles, through a temporary page
    ([[9, 8, 7, 6, 5]], [0, 1]),
])
def test_defrag_moves_contents_and_compacts(tables, cached) -> None:
    contents = {p: f"data{p}" for t in tables for p in t} | {p: f"data{p}" for p in cached}
    plan = plan_defrag(tables, cached, num_pages=10, page_size=PS, max_moves=10)
    assert plan is not None
    moved = apply_copies(contents, plan.copies)
    for old, text in contents.items():
        assert moved[plan.mapping.get(old, old)] == text
    new_tables = [[plan.mapping.get(p, p) for p in t] for t in tables]
    used = sorted({p for t in new_tables for p in t} | {plan.mapping.get(p, p) for p in cached})
    assert used == list(range(len(used)))
    assert new_tables[0] == list(range(len(tables[0])))


def test_defrag_skips_tidy_or_full_layouts() -> None:
    assert plan_defrag([[0, 1, 2], [3, 4]], [5], num_pages=10, page_size=PS) is None
    assert plan_defrag([[3, 2, 1, 0]], [], num_pages=4, page_size=PS) is None  # no free page
    assert plan_defrag([[1, 0]], [], num_pages=8, page_size=PS) is None  # too small to bother
    scattered = [[9, 7, 5, 3, 1]]
    assert plan_defrag(scattered, [], num_pages=16, page_size=PS, max_moves=3) is None  # too dear
    assert plan_defrag(scattered, [], num_pages=16, page_size=PS, max_moves=5) is not None
