"""The shared-prefix tables of CUDA-graph steps: one fixed region, refilled every step.

`StaticCascadeLayout` must give every plan over at most ``capacity`` sequences the same tables
an eager forward builds for it, with padding rows (a bucket larger than the batch) in no group,
with nothing left over from the previous step's plan where the kernels read, and with launch
sizes that depend on the bucket alone. `GraphCascade`, what the decode graphs see of it, stages
a step's tables only when the step has groups. Checked on the CPU (no Triton, no CUDA).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dyngen_core.engine.cascade import (
    CascadePlan,
    CascadePolicy,
    PrefixGroup,
    SharedPrefixTracker,
    plan_shared_prefixes,
)
from dyngen_core.engine.plan import SequenceSlice, StepPlan
from dyngen_core.kv.attention.base import GraphTables
from dyngen_core.kv.attention.triton.cascade_path import (
    CascadeTables,
    GraphCascade,
    StaticCascadeLayout,
    cascade_tables,
)

PAGE = 16
READ = ["member_seq", "group_end", "group_prefix", "block_group", "block_first"]


def _read_by_kernels(tables: CascadeTables) -> dict[str, list[int]]:
    """What the kernels can read of the tables: everything per sequence, and the per-member,
    per-group and per-block entries the device-side counts reach."""
    blocks = int(tables.num_blocks[0])
    groups = int(tables.block_group[:blocks].max()) + 1 if blocks else 0
    members = int(tables.group_end[groups - 1]) if groups else 0
    return {
        "seq_member": tables.seq_member.tolist(), "kv_start": tables.kv_start.tolist(),
        "member_seq": tables.member_seq[:members].tolist(),
        "group_end": tables.group_end[:groups].tolist(),
        "group_prefix": tables.group_prefix[:groups].tolist(),
        "block_group": tables.block_group[:blocks].tolist(),
        "block_first": tables.block_first[:blocks].tolist(),
    }


def _staged(layout: StaticCascadeLayout, region: np.ndarray, plan: CascadePlan, num_seqs: int,
            bucket: int) -> CascadeTables:
    layout.write(plan, num_seqs, region)
    return layout.tables(torch.from_numpy(region), bucket)


def test_graph_tables_equal_eager_tables_with_padding_rows() -> None:
    plan = CascadePlan((PrefixGroup((0, 2, 3), 2), PrefixGroup((4, 6), 1)), page_size=PAGE)
    contexts = [40, 7, 32, 50, 17, 30, 20]
    layout = StaticCascadeLayout(capacity=12, members_per_block=2)
    region = np.full(layout.size, 777, dtype=np.int32)  # stale values everywhere
    graph = _staged(layout, region, plan, len(contexts), bucket=9)
    eager = cascade_tables(plan, contexts, members_per_block=2, device=torch.device("cpu"))
    staged = _read_by_kernels(graph)
    expected = _read_by_kernels(eager)
    # Rows 7 and 8 pad the bucket: in no group, reading all their keys themselves.
    assert staged["seq_member"] == [*expected["seq_member"], -1, -1]
    assert staged["kv_start"] == [*expected["kv_start"], 0, 0]
    assert {k: staged[k] for k in READ} == {k: expected[k] for k in READ}
    # Launch sizes come from the bucket only (a captured graph serves every plan).
    assert (graph.grid_blocks, graph.member_rows) == (5, 9)
    assert graph.max_prefix is None and graph.max_remainder is None


def test_refill_after_a_group_disappears_leaves_nothing_readable_behind() -> None:
    layout = StaticCascadeLayout(capacity=8, members_per_block=4)
    region = np.zeros(layout.size, dtype=np.int32)
    two = CascadePlan((PrefixGroup((0, 1, 2), 3), PrefixGroup((3, 5), 1)), page_size=PAGE)
    before = _read_by_kernels(_staged(layout, region, two, 6, bucket=8))
    assert before["block_group"] == [0, 1] and before["kv_start"][3] == PAGE
    one = CascadePlan((PrefixGroup((1, 2), 3),), page_size=PAGE)
    after = _read_by_kernels(_staged(layout, region, one, 5, bucket=8))
    assert after == _read_by_kernels(
        _with_padding(cascade_tables(one, [60] * 5, 4, torch.device("cpu")), 8))
    assert after["seq_member"] == [-1, 0, 1, -1, -1, -1, -1, -1]  # 0, 3 and 5 left their groups
    assert after["kv_start"] == [0, 3 * PAGE, 3 * PAGE, 0, 0, 0, 0, 0]


def _with_padding(tables: CascadeTables, bucket: int) -> CascadeTables:
    pad = bucket - tables.seq_member.shape[0]
    return CascadeTables(
        torch.cat([tables.seq_member, torch.full((pad,), -1, dtype=torch.int32)]),
        torch.cat([tables.kv_start, torch.zeros(pad, dtype=torch.int32)]),
        tables.member_seq, tables.group_end, tables.group_prefix, tables.block_group,
        tables.block_first, tables.num_blocks, tables.grid_blocks, tables.member_rows,
        tables.max_prefix, tables.max_remainder)


def test_capacity_holds_the_most_groups_and_blocks() -> None:
    """Every sequence in a two-member group (the most groups), one member per block (the most
    blocks): all of it fits, and the kernels' counts read it back."""
    capacity = 9
    layout = StaticCascadeLayout(capacity=capacity, members_per_block=1)
    groups = tuple(PrefixGroup((2 * i, 2 * i + 1), i + 1) for i in range(capacity // 2))
    region = np.zeros(layout.size, dtype=np.int32)
    tables = _read_by_kernels(_staged(layout, region, CascadePlan(groups, PAGE), capacity,
                                      bucket=capacity))
    assert tables["group_prefix"] == [PAGE * (i + 1) for i in range(capacity // 2)]
    assert tables["block_first"] == list(range(2 * (capacity // 2)))
    assert tables["seq_member"][-1] == -1


def test_layout_rejects_batches_beyond_capacity() -> None:
    layout = StaticCascadeLayout(capacity=4, members_per_block=2)
    plan = CascadePlan((PrefixGroup((0, 1), 1),), page_size=PAGE)
    with pytest.raises(ValueError, match="capacity"):
        layout.write(plan, 5, np.zeros(layout.size, dtype=np.int32))
    with pytest.raises(ValueError, match="bucket"):
        layout.tables(torch.zeros(layout.size, dtype=torch.int32), 5)
    with pytest.raises(ValueError, match=">= 1"):
        StaticCascadeLayout(capacity=0, members_per_block=2)


@st.composite
def _plans(draw: st.DrawFn) -> tuple[CascadePlan, int, int]:
    """A plan over up to 20 sequences (disjoint groups of 2+, at least one), its batch size and
    a members-per-block."""
    num_seqs = draw(st.integers(2, 20))
    order = draw(st.permutations(range(num_seqs)))
    groups: list[PrefixGroup] = []
    taken = 0
    while num_seqs - taken >= 2 and (not groups or draw(st.booleans())):
        size = draw(st.integers(2, num_seqs - taken))
        groups.append(PrefixGroup(tuple(sorted(order[taken:taken + size])),
                                  draw(st.integers(1, 5))))
        taken += size
    groups.sort(key=lambda group: group.members[0])
    return CascadePlan(tuple(groups), PAGE), num_seqs, draw(st.integers(1, 5))


@settings(max_examples=100, deadline=None)
@given(_plans(), st.integers(0, 4))
def test_any_plan_fills_what_eager_tables_hold(case: tuple[CascadePlan, int, int],
                                               padding: int) -> None:
    plan, num_seqs, per_block = case
    layout = StaticCascadeLayout(capacity=num_seqs + padding, members_per_block=per_block)
    region = np.full(layout.size, 777, dtype=np.int32)
    staged = _read_by_kernels(_staged(layout, region, plan, num_seqs, num_seqs + padding))
    expected = _read_by_kernels(_with_padding(
        cascade_tables(plan, [6 * PAGE] * num_seqs, per_block, torch.device("cpu")),
        num_seqs + padding))
    assert staged == expected


def test_refilling_the_written_plan_is_free_but_never_stale() -> None:
    """The plan the region holds is not written again; any other plan, batch size or region
    is."""
    layout = StaticCascadeLayout(capacity=6, members_per_block=2)
    one = CascadePlan((PrefixGroup((0, 1, 2), 2),), page_size=PAGE)
    two = CascadePlan((PrefixGroup((0, 1), 1), PrefixGroup((3, 4), 3)), page_size=PAGE)
    region = np.zeros(layout.size, dtype=np.int32)
    layout.write(one, 5, region)
    held = region.copy()
    region[:] = 555  # only the layout writes the region: a repeat of its last write is skipped
    layout.write(one, 5, region)
    assert (region == 555).all()
    region[:] = held
    for plan, seqs in ((two, 5), (one, 5), (one, 4)):
        layout.write(plan, seqs, region)
        assert _read_by_kernels(layout.tables(torch.from_numpy(region), 6)) == _read_by_kernels(
            _with_padding(cascade_tables(plan, [6 * PAGE] * seqs, 2, torch.device("cpu")), 6))
    other = np.zeros(layout.size, dtype=np.int32)
    layout.write(one, 4, other)
    assert _read_by_kernels(layout.tables(torch.from_numpy(other), 6)) == _read_by_kernels(
        layout.tables(torch.from_numpy(region), 6))
    with pytest.raises(ValueError, match="int32 of"):
        layout.write(one, 4, np.zeros(layout.size, dtype=np.int64))


def _decodes(tables: list[list[int]], contexts: list[int]) -> StepPlan:
    return StepPlan([SequenceSlice(job, [1], ctx - 1, table, True)
                     for job, (table, ctx) in enumerate(zip(tables, contexts, strict=True))])


def test_graph_cascade_stages_only_steps_with_groups() -> None:
    """Through the graphs' protocol: a step without sharing stages nothing, a step with groups
    writes what the eager tables of `plan_shared_prefixes`' plan hold, and the next step that
    changed no shared page reuses the plan (its writer writes nothing)."""
    policy = CascadePolicy(min_saved_keys=0)
    cascade = GraphCascade(StaticCascadeLayout(capacity=6, members_per_block=2),
                           SharedPrefixTracker(PAGE, policy))
    staged: GraphTables = cascade
    region = np.full(cascade.size, 777, dtype=np.int32)
    lonely = _decodes([[1, 2], [3, 4], [5]], [20, 30, 9])
    assert staged.stage(lonely) is None
    assert staged.stage(StepPlan([])) is None
    tables = [[1, 2, 9], [1, 2, 10], [1, 2, 11, 12], [3, 4], [5]]
    contexts = [40, 37, 50, 30, 9]
    writer = staged.stage(_decodes(tables, contexts))
    assert writer is not None
    writer(region)
    plan = plan_shared_prefixes(tables, contexts, [1] * 5, PAGE, policy)
    assert plan is not None and plan.groups == (PrefixGroup((0, 1, 2), 2),)
    expected = _with_padding(cascade_tables(plan, contexts, 2, torch.device("cpu")), 6)
    views = staged.views(torch.from_numpy(region), 6)
    assert isinstance(views, CascadeTables)
    assert _read_by_kernels(views) == _read_by_kernels(expected)
    replans = cascade.tracker.replans
    region[:] = 555  # the next step changed no shared page: its writer finds the plan written
    again = staged.stage(_decodes(tables, [41, 38, 51, 31, 10]))
    assert again is not None and cascade.tracker.replans == replans
    again(region)
    assert (region == 555).all()
