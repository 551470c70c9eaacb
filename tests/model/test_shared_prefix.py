"""The shared-prefix (cascade) planner: which decodes form groups, over how many pages, and when
no cascade is planned at all; plus the device tables the Triton backend builds from a plan."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dyngen_core.engine.cascade import (
    CascadePlan,
    CascadePolicy,
    PrefixGroup,
    plan_shared_prefixes,
)

PS = 256
ANY = CascadePolicy(min_saved_keys=0)


def _plan(tables: list[list[int]], contexts: list[int], query_lens: list[int] | None = None,
          policy: CascadePolicy = ANY) -> CascadePlan | None:
    return plan_shared_prefixes(tables, contexts, query_lens or [1] * len(tables), PS, policy)


def test_no_sharing_plans_nothing() -> None:
    tables = [[1, 2], [3, 4, 5], [6], [7, 8]]
    assert _plan(tables, [300, 700, 5, 512]) is None
    assert _plan([], []) is None


def test_shared_document_is_one_group() -> None:
    """64 questions on one 8,000-token document: 31 full shared pages, then pages of their own."""
    document = list(range(100, 131))
    tables = [document + [1000 + i] for i in range(64)]
    contexts = [8000 + 30 + i for i in range(64)]
    # The benchmark's workload (benchmarks/shared_document.py): the default policy takes it.
    plan = plan_shared_prefixes(tables, contexts, [1] * 64, PS)
    assert plan is not None
    assert plan_shared_prefixes(tables, contexts, [1] * 64, PS, ANY) == plan
    assert plan.groups == (PrefixGroup(tuple(range(64)), 31),)
    assert plan.saved_keys == 63 * 31 * PS
    assert plan.kv_starts(65) == [31 * PS] * 64 + [0]


def test_default_policy_skips_small_savings() -> None:
    """Two decodes sharing 100 pages save 25,600 keys: below the default 32,768, no cascade;
    three sharing them save 51,200: a cascade."""
    shared = list(range(1, 101))
    tables = [shared + [500 + i] for i in range(3)]
    contexts = [100 * PS + 5] * 3
    assert plan_shared_prefixes(tables[:2], contexts[:2], [1] * 2, PS) is None
    plan = plan_shared_prefixes(tables, contexts, [1] * 3, PS)
    assert plan is not None and plan.saved_keys == 2 * 100 * PS


def test_prefix_stops_at_pages_every_member_sees_whole() -> None:
    """Page 3 is shared but is member 1's current page (ctx 2 pages + 5): only 2 pages count.
    A member whose context ends exactly at a page boundary sees that page whole."""
    tables = [[1, 2, 3, 9], [1, 2, 3], [1, 2, 3, 8]]
    plan = _plan(tables, [3 * PS + 4, 2 * PS + 5, 3 * PS])
    assert plan is not None and plan.groups == (PrefixGroup((0, 1, 2), 2),)
    exact = _plan([[1, 2, 3], [1, 2, 3, 7]], [3 * PS, 3 * PS + 1])
    assert exact is not None and exact.groups == (PrefixGroup((0, 1), 3),)


def test_only_decodes_join_groups() -> None:
    tables = [[1, 2, 3], [1, 2, 4], [1, 2, 5]]
    plan = _plan(tables, [600, 600, 600], query_lens=[1, 40, 1])
    assert plan is not None and plan.groups == (PrefixGroup((0, 2), 2),)
    assert _plan(tables[:2], [600, 600], query_lens=[1, 3]) is None


def test_splits_at_the_weakest_link_when_it_saves_more() -> None:
    """All four share one page (a system prompt); two pairs share ten more each."""
    a = [1] + list(range(10, 20))
    b = [1] + list(range(20, 30))
    tables = [a + [90], b + [91], a + [92], b + [93]]
    plan = _plan(tables, [11 * PS + 3] * 4)
    assert plan is not None
    assert set(plan.groups) == {PrefixGroup((0, 2), 11), PrefixGroup((1, 3), 11)}


def test_keeps_one_group_when_it_saves_more() -> None:
    """Five share four pages; two of them share a fifth: one group of five saves 16 pages,
    splitting would save 5 + 8 = 13."""
    base = [1, 2, 3, 4]
    tables = [base + [5, 60], base + [5, 61], base + [62], base + [63], base + [64]]
    plan = _plan(tables, [5 * PS + 9, 5 * PS + 9, 4 * PS + 9, 4 * PS + 9, 4 * PS + 9])
    assert plan is not None and plan.groups == (PrefixGroup((0, 1, 2, 3, 4), 4),)


def test_thresholds() -> None:
    tables = [[1, 2], [1, 3]]
    assert _plan(tables, [PS + 1] * 2) is not None
    assert _plan(tables, [PS + 1] * 2, policy=CascadePolicy(min_saved_keys=PS + 1)) is None
    assert _plan(tables, [PS + 1] * 2, policy=CascadePolicy(min_saved_keys=PS)) is not None
    three = _plan(tables + [[1, 4]], [PS + 1] * 3, policy=CascadePolicy(3, 1, 0))
    assert three is not None and three.groups[0].members == (0, 1, 2)
    assert _plan(tables, [PS + 1] * 2, policy=CascadePolicy(3, 1, 0)) is None
    assert _plan(tables, [PS + 1] * 2, policy=CascadePolicy(2, 2, 0)) is None
    # The default policy wants about 131k saved key reads: a pair sharing one page is too few.
    assert plan_shared_prefixes(tables, [PS + 1] * 2, [1, 1], PS) is None


def test_bad_input_is_refused() -> None:
    with pytest.raises(ValueError, match="one of each per sequence"):
        plan_shared_prefixes([[1]], [1, 2], [1], PS)
    with pytest.raises(ValueError, match="min_members"):
        CascadePolicy(min_members=1)
    with pytest.raises(ValueError, match="min_prefix_pages"):
        CascadePolicy(min_prefix_pages=0)


@st.composite
def _batches(draw: st.DrawFn) -> tuple[list[list[int]], list[int], list[int]]:
    """Page tables drawn from a few shared stems (prefix dedup's shape), contexts that may end
    inside, at or past the shared pages, and some prefill slices."""
    stems = draw(st.lists(st.lists(st.integers(1, 6), min_size=1, max_size=6), min_size=1,
                          max_size=4))
    tables, contexts, query_lens = [], [], []
    fresh = 1000
    for _ in range(draw(st.integers(1, 12))):
        stem = list(draw(st.sampled_from(stems)))
        keep = draw(st.integers(0, len(stem)))
        extra = draw(st.integers(0 if keep else 1, 3))
        table = stem[:keep] + list(range(fresh, fresh + extra))
        fresh += extra
        tables.append(table)
        contexts.append(draw(st.integers((len(table) - 1) * PS + 1, len(table) * PS)))
        query_lens.append(draw(st.sampled_from([1, 1, 1, 2])))
    return tables, contexts, query_lens


@settings(max_examples=200, deadline=None)
@given(_batches())
def test_planned_groups_are_always_valid(batch: tuple[list[list[int]], list[int], list[int]]
                                         ) -> None:
    tables, contexts, query_lens = batch
    plan = plan_shared_prefixes(tables, contexts, query_lens, PS, ANY)
    if plan is None:
        # Nothing planned means no two decodes share a whole visible first page.
        firsts = [t[0] for t, c, q in zip(tables, contexts, query_lens) if q == 1 and c >= PS]
        assert len(firsts) == len(set(firsts))
        return
    seen: set[int] = set()
    for group in plan.groups:
        assert len(group.members) >= 2 and group.prefix_pages >= 1
        assert not seen & set(group.members), "a sequence is in two groups"
        seen |= set(group.members)
        prefix = tables[group.members[0]][:group.prefix_pages]
        for member in group.members:
            assert query_lens[member] == 1
            assert tables[member][:group.prefix_pages] == prefix
            assert group.prefix_pages * PS <= contexts[member]
    # At least as good as grouping each first page over all it shares (the simplest plan).
    assert plan.saved_keys >= _first_page_grouping(tables, contexts, query_lens)


def _first_page_grouping(tables: list[list[int]], contexts: list[int],
                         query_lens: list[int]) -> int:
    buckets: dict[int, list[list[int]]] = {}
    for table, ctx, qlen in zip(tables, contexts, query_lens):
        if qlen == 1 and ctx >= PS:
            buckets.setdefault(table[0], []).append(table[:ctx // PS])
    saved = 0
    for seen in buckets.values():
        if len(seen) > 1:
            common = 0
            while all(len(t) > common and t[common] == seen[0][common] for t in seen):
                common += 1
            saved += (len(seen) - 1) * common * PS
    return saved


def test_device_tables_of_a_plan() -> None:
    import torch

    from dyngen_core.kv.attention.triton.cascade_path import cascade_tables

    plan = CascadePlan((PrefixGroup((0, 2, 3), 2), PrefixGroup((4, 5), 1)), page_size=16)
    contexts = [40, 7, 32, 50, 17, 30]
    tables = cascade_tables(plan, contexts, members_per_block=2, device=torch.device("cpu"))
    assert tables.seq_member.tolist() == [0, -1, 1, 2, 3, 4]
    assert tables.kv_start.tolist() == [32, 0, 32, 32, 16, 16]
    assert tables.member_seq.tolist() == [0, 2, 3, 4, 5]
    assert tables.group_end.tolist() == [3, 5]
    assert tables.group_prefix.tolist() == [32, 16]
    assert tables.block_group.tolist() == [0, 0, 1]
    assert tables.block_first.tolist() == [0, 2, 3]
    assert tables.num_blocks.tolist() == [3]
    assert (tables.member_rows, tables.grid_blocks) == (5, 3)
    assert (tables.max_prefix, tables.max_remainder) == (32, 18)
