"""The group tables of shared-prefix ("cascade") attention: built on the host, read on the device.

A `CascadePlan` (`engine.cascade`) becomes int32 tables the cascade kernels read
(`cascade_kernels`): per sequence its member index and where its own keys begin, per member its
sequence, per group its end and prefix length, per row block its group and first member, and
the number of row blocks in use.

Two ways to hold them:

- `cascade_tables`: an eager forward's tables, sized to the plan, one host-to-device copy;
- `StaticCascadeLayout`: a fixed region of a CUDA graph's static int32 buffer, sized for the
  largest batch (capacity), written on the host each step (`write`) and copied with the rest of
  the step's metadata. A graph's launches depend on its bucket size alone, never on the plan:
  the prefix kernel's programs take every n-th row block up to the device-side count.

`GraphCascade` is what the decode graphs see of it (`base.GraphTables`): each step planned
through a `SharedPrefixTracker`, then written into the layout.

This module needs no Triton (CPU tests and CI build and check the tables).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from itertools import chain
from operator import attrgetter

import numpy as np
import torch

from dyngen_core.engine.cascade import CascadePlan, SharedPrefixTracker
from dyngen_core.engine.plan import StepPlan

_members, _prefix_pages = attrgetter("members"), attrgetter("prefix_pages")


@dataclass(frozen=True)
class CascadeTables:
    """A cascade plan on the device (int32 views), plus what the host knows of its sizes.

    seq_member [B]: each sequence's index in ``member_seq``, -1 for sequences in no group.
    kv_start [B]: where each sequence's own keys begin (its group's prefix tokens, else 0).
    member_seq [M], group_end [groups], group_prefix [groups], block_group / block_first
        [row blocks], num_blocks [1]: as `cascade_kernels.shared_prefix_kernel` reads them.
    grid_blocks: programs along the prefix kernel's first axis (each loops over row blocks).
    member_rows: rows of the prefix partials (at least the members).
    max_prefix, max_remainder: the longest group prefix and the most own keys of a sequence,
        in tokens, to choose split counts; None in graph tables (the host must not know them,
        so a captured launch serves every plan).
    """

    seq_member: torch.Tensor
    kv_start: torch.Tensor
    member_seq: torch.Tensor
    group_end: torch.Tensor
    group_prefix: torch.Tensor
    block_group: torch.Tensor
    block_first: torch.Tensor
    num_blocks: torch.Tensor
    grid_blocks: int
    member_rows: int
    max_prefix: int | None
    max_remainder: int | None


@dataclass(frozen=True)
class TableLists:
    """The tables of a plan as host lists (field meanings as in `CascadeTables`)."""

    seq_member: list[int]
    kv_start: list[int]
    member_seq: list[int]
    group_end: list[int]
    group_prefix: list[int]
    block_group: list[int]
    block_first: list[int]

    def parts(self) -> list[list[int]]:
        """The lists in the order `StaticCascadeLayout` and `cascade_tables` lay them out."""
        return [self.seq_member, self.kv_start, self.member_seq, self.group_end,
                self.group_prefix, self.block_group, self.block_first,
                [len(self.block_group)]]


def table_lists(plan: CascadePlan, num_seqs: int, members_per_block: int) -> TableLists:
    """The tables of ``plan`` for a batch of ``num_seqs`` sequences, members in row blocks of at
    most ``members_per_block`` (a block never mixes groups)."""
    seq_member = [-1] * num_seqs
    kv_start = [0] * num_seqs
    member_seq: list[int] = []
    group_end: list[int] = []
    group_prefix: list[int] = []
    block_group: list[int] = []
    block_first: list[int] = []
    for index, group in enumerate(plan.groups):
        begin = len(member_seq)
        prefix = group.prefix_pages * plan.page_size
        for seq in group.members:
            seq_member[seq] = len(member_seq)
            kv_start[seq] = prefix
            member_seq.append(seq)
        group_end.append(len(member_seq))
        group_prefix.append(prefix)
        starts = range(begin, len(member_seq), members_per_block)
        block_group.extend([index] * len(starts))
        block_first.extend(starts)
    return TableLists(seq_member, kv_start, member_seq, group_end, group_prefix, block_group,
                      block_first)


def cascade_tables(plan: CascadePlan, context_lens: list[int], members_per_block: int,
                   device: torch.device) -> CascadeTables:
    """An eager forward's device tables of ``plan`` for a batch with ``context_lens`` (one per
    sequence), in row blocks of at most ``members_per_block`` members; one host-to-device copy,
    one prefix program per row block."""
    lists = table_lists(plan, len(context_lens), members_per_block)
    parts = lists.parts()
    flat = torch.tensor([value for part in parts for value in part], dtype=torch.int32)
    if device.type == "cuda":
        flat = flat.pin_memory()
    views = _split(flat.to(device, non_blocking=True), [len(part) for part in parts])
    return _tables(
        views, grid_blocks=len(lists.block_group), member_rows=len(lists.member_seq),
        max_prefix=max(lists.group_prefix),
        max_remainder=max(ctx - start
                          for ctx, start in zip(context_lens, lists.kv_start, strict=True)),
    )


class StaticCascadeLayout:
    """Where the tables of any plan over at most ``capacity`` sequences sit in one fixed int32
    region (CUDA graphs: a region of the static inputs, written and copied every step).

    capacity: the most sequences of a batch (the largest graph bucket).
    members_per_block: members per row block of the prefix kernel.

    Sizes: members <= capacity; groups <= capacity // 2 (a group has at least two members);
    row blocks <= members (a block holds at least one).
    """

    def __init__(self, capacity: int, members_per_block: int) -> None:
        if capacity < 1 or members_per_block < 1:
            raise ValueError(f"capacity and members_per_block must be >= 1; got {capacity} "
                             f"and {members_per_block}")
        self.capacity = capacity
        self.members_per_block = members_per_block
        groups = max(1, capacity // 2)
        self._lengths = [capacity, capacity, capacity, groups, groups, capacity, capacity, 1]
        self.size = sum(self._lengths)
        self._last: tuple[CascadePlan, int, np.ndarray] | None = None  # what write last wrote

    def write(self, plan: CascadePlan, num_seqs: int, region: np.ndarray) -> None:
        """Write the tables of ``plan`` (over a batch of ``num_seqs``) into ``region`` (int32,
        ``size`` entries). Rows from ``num_seqs`` to ``capacity`` (a bucket's padding) are in
        no group; entries past a plan's members, groups and blocks are left as they were
        (never read: ``num_blocks`` and ``group_end`` bound every read).

        Writing the plan object the layout last wrote, with the same ``num_seqs``, into the
        same memory writes nothing (a planner reuses its plan object while nothing changed):
        only this layout may write the region."""
        if num_seqs > self.capacity:
            raise ValueError(f"{num_seqs} sequences exceed the cascade tables' capacity "
                             f"{self.capacity}; build the graphs for a larger batch")
        if region.shape != (self.size,) or region.dtype != np.int32:
            raise ValueError(f"the cascade region must be int32 of {self.size} entries; got "
                             f"{region.dtype} of shape {region.shape}")
        last = self._last
        address = region.__array_interface__["data"][0]
        if (last is not None and last[0] is plan and last[1] == num_seqs
                and last[2].__array_interface__["data"][0] == address):
            return
        self._write(plan, num_seqs, region)
        # Holding the region keeps its memory from being freed and handed to another array.
        self._last = (plan, num_seqs, region)

    def _write(self, plan: CascadePlan, num_seqs: int, region: np.ndarray) -> None:
        """`write` in a few array operations (numpy loops, not Python ones)."""
        capacity = self.capacity
        sizes = np.fromiter(map(len, map(_members, plan.groups)), dtype=np.int64,
                            count=len(plan.groups))
        members = np.fromiter(chain.from_iterable(map(_members, plan.groups)), dtype=np.int64,
                              count=int(sizes.sum()))
        prefixes = np.fromiter(map(_prefix_pages, plan.groups), dtype=np.int64,
                               count=len(plan.groups)) * plan.page_size
        ends = np.cumsum(sizes)
        blocks = -(-sizes // self.members_per_block)
        block_group = np.repeat(np.arange(len(sizes)), blocks)
        # A block's first member: its group's first, plus members_per_block per earlier block
        # of the group.
        first_block = np.cumsum(blocks) - blocks
        within = np.arange(int(blocks.sum())) - np.repeat(first_block, blocks)
        block_first = np.repeat(ends - sizes, blocks) + within * self.members_per_block
        seq_member = region[:capacity]
        kv_start = region[capacity:2 * capacity]
        seq_member[:] = -1  # rows in no group, padding rows included,
        kv_start[:] = 0  # read all their keys themselves
        seq_member[members] = np.arange(len(members))
        kv_start[members] = np.repeat(prefixes, sizes)
        offset = 2 * capacity
        parts = (members, ends, prefixes, block_group, block_first,
                 np.array([len(block_group)]))
        for part, length in zip(parts, self._lengths[2:], strict=True):
            region[offset:offset + len(part)] = part
            offset += length

    def tables(self, region: torch.Tensor, bucket: int) -> CascadeTables:
        """The tables of a graph of ``bucket`` sequences, as views of the device ``region``:
        ``ceil(bucket / members_per_block)`` prefix programs (one group of the whole batch
        fills them exactly; more groups loop), prefix partials for ``bucket`` members."""
        if not 1 <= bucket <= self.capacity:
            raise ValueError(f"bucket {bucket} outside 1..{self.capacity}")
        views = _split(region[:self.size], self._lengths)
        views[0], views[1] = views[0][:bucket], views[1][:bucket]
        return _tables(
            views, grid_blocks=-(-bucket // self.members_per_block), member_rows=bucket,
            max_prefix=None, max_remainder=None,
        )


class GraphCascade:
    """The shared-prefix tables of one set of decode graphs (`base.GraphTables`).

    layout: where the tables sit in the graphs' static region.
    tracker: plans the graphs' successive steps (a step that changed no shared page gets the
        previous plan object back, and `StaticCascadeLayout.write` then writes nothing).
    """

    def __init__(self, layout: StaticCascadeLayout, tracker: SharedPrefixTracker) -> None:
        self.layout = layout
        self.tracker = tracker
        self.size = layout.size

    def plan(self, plan: StepPlan) -> CascadePlan | None:
        """The shared-prefix groups of the decode step ``plan``; None: no cascade pays."""
        return self.tracker.plan(plan.slices) if plan.slices else None

    def stage(self, plan: StepPlan) -> Callable[[np.ndarray], None] | None:
        """What writes the step's tables into a host region (`StaticCascadeLayout.write`);
        None when the step has no groups (the plain graph serves it)."""
        cascade = self.plan(plan)
        if cascade is None:
            return None
        return partial(self.layout.write, cascade, len(plan.slices))

    def views(self, region: torch.Tensor, bucket: int) -> CascadeTables:
        """The tables a graph of ``bucket`` sequences reads, as views of the device region."""
        return self.layout.tables(region, bucket)


def _tables(views: list[torch.Tensor], *, grid_blocks: int, member_rows: int,
            max_prefix: int | None, max_remainder: int | None) -> CascadeTables:
    seq_member, kv_start, member_seq, group_end, group_prefix, block_group, block_first, count = (
        views)
    return CascadeTables(seq_member, kv_start, member_seq, group_end, group_prefix, block_group,
                         block_first, count, grid_blocks, member_rows, max_prefix, max_remainder)


def _split(flat: torch.Tensor, lengths: list[int]) -> list[torch.Tensor]:
    views: list[torch.Tensor] = []
    offset = 0
    for length in lengths:
        views.append(flat[offset:offset + length])
        offset += length
    return views


__all__ = ["CascadeTables", "GraphCascade", "StaticCascadeLayout", "TableLists",
           "cascade_tables", "table_lists"]
