"""When and how `TritonPagedBackend` runs a decode step as shared-prefix ("cascade") attention,
and the group tables its kernels read.

`CascadePath` owns the cascade side of the backend: the policy (`engine.cascade.CascadePolicy`),
each batch's plan and device tables, and one layer's two launches: the prefix pass
(`cascade_kernels.prefix_tiles_kernel` where its tile divides the page size over float pages,
else the general `shared_prefix_kernel`), then the own-keys pass that folds the prefix partials
into each row and writes the output (`own_keys_kernel`).

Group tables: a `CascadePlan` (`engine.cascade`) becomes int32 tables the cascade kernels read:
per sequence its member index and where its own keys begin, per member its sequence, per group
its end and prefix length, per row block its group and first member, and the number of row
blocks in use (`CascadeTables`). They come from one of two places:

- An eager forward (host page tables at hand) plans its batch and builds tables sized to the
  plan (`cascade_tables`, one host-to-device copy), with split counts chosen from the lengths.
- A CUDA graph's batch carries them (``ForwardBatch.graph_tables``): views of a fixed region of
  the graph's static int32 buffer, sized for the largest batch (`StaticCascadeLayout`), written
  on the host each step by the `GraphCascade` that `graph_tables` gives the graphs and copied
  with the rest of the step's metadata. Every grid and split count then follows from the batch
  size alone (the prefix kernel's programs take every n-th row block up to the device-side
  count), so one capture serves every plan of its bucket.

Building and checking the tables needs no Triton (CPU tests and CI do it).

The launch settings are the module constants below: production reads them at every launch and
the kernel benchmarks (`benchmarks/kernels/cascade.py`) patch them (BENCHMARKS.md, "3. Shared
document").
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from itertools import chain
from operator import attrgetter
from typing import cast

import numpy as np
import torch

from dyngen_core.engine.cascade import (
    CascadePlan,
    CascadePolicy,
    SharedPrefixTracker,
    plan_shared_prefixes,
)
from dyngen_core.engine.plan import StepPlan
from dyngen_core.kv.attention.base import ForwardBatch
from dyngen_core.kv.attention.triton.cascade_kernels import (
    own_keys_kernel,
    prefix_tiles_kernel,
    shared_prefix_kernel,
)
from dyngen_core.kv.attention.triton.decode import (
    LOG2_E,
    HeadShape,
    PageOperands,
    multiprocessors,
)
from dyngen_core.kv.attention.triton.merge import SplitCounters
from dyngen_core.kv.storage import KVStorage

_members, _prefix_pages = attrgetter("members"), attrgetter("prefix_pages")
UNKNOWN_KEYS = 1 << 30  # a graph's lengths: never the bound on its split count

# Prefix pass: query rows (members x heads of a KV group, a power of two >= 16) and warps per
# program, programs aimed for per multiprocessor when choosing its split count, keys per tile
# (None: the backend's block_n; halved until it divides the page size) and pipelining stages.
PREFIX_ROWS = 64
PREFIX_WARPS = 4
PREFIX_PROGRAMS_PER_SM = 2
PREFIX_BLOCK_N: int | None = None
PREFIX_STAGES = 3
# Own-keys pass: warps per program, keys per tile (None: the backend's block_n), most splits of
# a sequence's own keys (None: the backend's max_splits; 1 never splits, no partials or
# counters), page ids loaded ahead of their tiles (0: one per key, the paged kernel's loop; a
# power of two: that many, where the tile divides the page size) and partials loaded per round
# of its merges (a power of two).
OWN_WARPS = 4
OWN_BLOCK_N: int | None = None
OWN_MAX_SPLITS: int | None = None
OWN_WINDOW = 0
MERGE_SPLIT_BLOCK = 4


@dataclass(frozen=True)
class PrefixLaunch:
    """How `attend_prefixes` launches the prefix pass.

    group, group_pad: query heads per KV head, and that rounded up to a power of two.
    rows: query rows per program (members x group_pad); block_n: keys per inner step.
    head_pad: head_dim padded for the kernel; splits: parts the prefixes are split into.
    warps: warps per program; stages: software-pipelining stages of the key loop (Triton's
        ``num_stages``).
    tiles: run `prefix_tiles_kernel` (see `tiles_fit`) instead of `shared_prefix_kernel`.
    """

    group: int
    group_pad: int
    rows: int
    block_n: int
    head_pad: int
    splits: int
    warps: int
    stages: int
    tiles: bool


class CascadePath:
    """Plans, tables and launches of the cascade for one backend.

    policy: when a plan pays (None: never cascade).
    block_n, max_splits, decode_programs_per_sm: the backend's keys per inner step, most splits
        and plain decode programs per multiprocessor (the own-keys pass splits as the plain
        decode does).
    """

    def __init__(self, policy: CascadePolicy | None, *, block_n: int, max_splits: int,
                 decode_programs_per_sm: int) -> None:
        self.policy = policy
        self.block_n = block_n
        self.max_splits = max_splits
        self.decode_programs_per_sm = decode_programs_per_sm
        # The own-keys pass's counters (split passes): allocated by an eager call (a graph's
        # warm-up forwards) before any capture needs them.
        self.split_counters = SplitCounters()

    def plan(self, batch: ForwardBatch, storage: KVStorage) -> CascadePlan | None:
        """The batch's shared-prefix plan (once per batch), or None when it runs no cascade."""
        policy = self.policy
        if (policy is None or not cascade_reads(storage)
                or batch.page_tables_host is None or not batch.is_decode_only):
            return None
        if "cascade_plan" in batch.memo:
            return cast("CascadePlan | None", batch.memo["cascade_plan"])
        plan = plan_shared_prefixes(batch.page_tables_host, batch.context_lens_host,
                                    batch.query_lens_host, batch.page_size, policy)
        batch.memo["cascade_plan"] = plan
        return plan

    def graph_tables(self, storage: KVStorage, num_heads: int, num_kv_heads: int,
                     capacity: int) -> GraphCascade | None:
        """The tables of one set of CUDA graphs over batches of up to ``capacity`` sequences
        with this head layout (their own tracker plans their steps); None when this backend
        never cascades over ``storage``."""
        if self.policy is None or not cascade_reads(storage):
            return None
        layout = StaticCascadeLayout(capacity, self.members_per_block(num_heads // num_kv_heads))
        return GraphCascade(layout, SharedPrefixTracker(storage.page_size, self.policy))

    def members_per_block(self, group: int) -> int:
        """Members in one prefix program's rows for ``group`` query heads per KV head."""
        group_pad = 1 << (max(1, group) - 1).bit_length()
        return max(PREFIX_ROWS, group_pad) // group_pad

    def tables(self, batch: ForwardBatch, storage: KVStorage, heads: HeadShape,
               device: torch.device) -> CascadeTables | None:
        """The batch's device tables: a graph batch's own, else those of its plan (built once
        per batch); None: no cascade."""
        carried = batch.graph_tables
        if carried is not None:
            if not isinstance(carried, CascadeTables):
                raise TypeError(f"a graph batch for the Triton backend carries "
                                f"{type(carried).__name__} instead of CascadeTables: build its "
                                f"graphs with this backend's graph_tables")
            return carried
        plan = self.plan(batch, storage)
        if plan is None:
            return None
        members_per_block = self.members_per_block(heads.group)
        key = ("cascade_tables", members_per_block)
        cached = batch.memo.get(key)
        if isinstance(cached, CascadeTables):
            return cached
        tables = cascade_tables(plan, batch.context_lens_host, members_per_block, device)
        batch.memo[key] = tables
        return tables

    def attend(self, q: torch.Tensor, ops: PageOperands, page_args: tuple[object, ...],
               batch: ForwardBatch, tables: CascadeTables, scale: float,
               heads: HeadShape) -> torch.Tensor:
        """Shared prefixes of every group, then own keys of every sequence merged with them;
        returns the output [B, H, D] in q's dtype."""
        sms = multiprocessors(q.device)
        launch = self.prefix_launch(ops, batch, tables, heads, sms)
        prefix = attend_prefixes(q, ops, page_args, batch, tables, scale * LOG2_E, launch)
        splits = self.own_splits(batch, tables, heads, sms)
        counters = (self.split_counters.for_launch(q.device, batch.num_seqs * heads.num_kv_heads)
                    if splits > 1 else None)
        return attend_own_keys(q, ops, batch, tables, prefix, scale * LOG2_E, heads,
                               splits=splits, counters=counters,
                               block_n=OWN_BLOCK_N or self.block_n)

    def own_splits(self, batch: ForwardBatch, tables: CascadeTables, heads: HeadShape,
                   sms: int) -> int:
        """Parts of each sequence's own keys: from the batch shape alone in a graph (its
        tables leave the lengths unknown), as the plain decode's split count."""
        most = self.max_splits if OWN_MAX_SPLITS is None else min(self.max_splits,
                                                                  OWN_MAX_SPLITS)
        return split_count(_or_unknown(tables.max_remainder),
                           batch.num_seqs * heads.num_kv_heads,
                           self.decode_programs_per_sm * sms, most, 4 * self.block_n)

    def prefix_launch(self, ops: PageOperands, batch: ForwardBatch, tables: CascadeTables,
                      heads: HeadShape, sms: int) -> PrefixLaunch:
        """The prefix pass's launch: the tile kernel wherever it fits, else the general kernel
        at the backend's tile (a page-dividing tile under 16 keys is too small for its dot);
        the split count from the bucket alone in a graph."""
        tile_n = tile_keys(batch.page_size, PREFIX_BLOCK_N or self.block_n)
        tiles = tiles_fit(ops, batch.page_size, tile_n)
        block_n = tile_n if tiles else self.block_n
        splits = split_count(_or_unknown(tables.max_prefix),
                             tables.grid_blocks * heads.num_kv_heads,
                             PREFIX_PROGRAMS_PER_SM * sms, self.max_splits, 4 * block_n)
        return PrefixLaunch(group=heads.group, group_pad=heads.group_pad,
                            rows=max(PREFIX_ROWS, heads.group_pad), block_n=block_n,
                            head_pad=heads.head_pad, splits=splits, warps=PREFIX_WARPS,
                            stages=PREFIX_STAGES, tiles=tiles)


def attend_prefixes(q: torch.Tensor, ops: PageOperands, page_args: tuple[object, ...],
                    batch: ForwardBatch, tables: CascadeTables, scale_log2: float,
                    launch: PrefixLaunch) -> tuple[torch.Tensor, torch.Tensor]:
    """Every group's query rows against its shared pages; returns float32 partials
    [M, H, splits, head_pad] and their log2-sum-exp [M, H, splits].

    page_args: the page tensors, scales, their strides and the rotation, in the kernels' order
    (`decode.page_arguments`)."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = ops.keys.shape[2]
    parts = torch.empty(tables.member_rows, num_heads, launch.splits, launch.head_pad,
                        dtype=torch.float32, device=q.device)
    lse = torch.empty(tables.member_rows, num_heads, launch.splits, dtype=torch.float32,
                      device=q.device)
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    grid = (tables.grid_blocks, num_kv_heads, launch.splits)
    group_tables = (tables.member_seq, tables.group_end, tables.group_prefix,
                    tables.block_group, tables.block_first, tables.num_blocks)
    if launch.tiles:
        keys, values = ops.keys, ops.values
        prefix_tiles_kernel[grid](
            q, q.stride(0), q.stride(1), keys, values, *keys.stride()[:3], *values.stride()[:3],
            batch.page_table, batch.page_table.stride(0), batch.query_start, *group_tables,
            parts, lse, scale_log2,
            G=launch.group, G_PAD=launch.group_pad, BLOCK_M=launch.rows,
            BLOCK_N=launch.block_n, HEAD_DIM=head_dim, HEAD_PAD=launch.head_pad,
            PAGE_SIZE=batch.page_size, DOT_PRECISION=precision,
            num_warps=launch.warps, num_stages=launch.stages,
        )
        return parts, lse
    shared_prefix_kernel[grid](
        q, q.stride(0), q.stride(1), *page_args,
        batch.page_table, batch.page_table.stride(0), batch.context_lens, batch.query_start,
        *group_tables, parts, lse, scale_log2,
        G=launch.group, G_PAD=launch.group_pad, BLOCK_M=launch.rows, BLOCK_N=launch.block_n,
        HEAD_DIM=head_dim, HEAD_PAD=launch.head_pad, PAGE_SIZE=batch.page_size,
        K_BITS=ops.key_bits, V_BITS=ops.value_bits, NUM_SPLITS=launch.splits,
        DOT_PRECISION=precision, num_warps=launch.warps, num_stages=launch.stages,
    )
    return parts, lse


def attend_own_keys(q: torch.Tensor, ops: PageOperands, batch: ForwardBatch,
                    tables: CascadeTables, prefix: tuple[torch.Tensor, torch.Tensor],
                    scale_log2: float, heads: HeadShape, *, splits: int,
                    counters: torch.Tensor | None, block_n: int) -> torch.Tensor:
    """Own keys of every decode sequence merged with its group's prefix partials (parts,
    lse) [M, H, S_pre, ...] from `attend_prefixes`; returns the output [B, H, D] in q's dtype.

    splits: parts of each sequence's own keys (from the batch shape alone in a graph);
        several need ``counters`` (at least B x KV heads zeroed int32) and float32 partial
        buffers, allocated here.
    block_n: keys per inner step."""
    num_tokens, num_heads, head_dim = q.shape
    out = torch.empty_like(q)
    pre_parts, pre_lse = prefix
    if splits > 1:
        if counters is None:
            raise ValueError("a split own-keys pass needs its split counters")
        rem_parts = torch.empty(num_tokens, num_heads, splits, heads.head_pad,
                                dtype=torch.float32, device=q.device)
        rem_lse = torch.empty(num_tokens, num_heads, splits, dtype=torch.float32,
                              device=q.device)
    else:
        rem_parts = rem_lse = counters = pre_lse  # never read
    keys, values = ops.keys, ops.values
    own_keys_kernel[(batch.num_seqs, heads.num_kv_heads, splits)](
        q, q.stride(0), q.stride(1), keys, values, *keys.stride()[:3], *values.stride()[:3],
        batch.page_table, batch.page_table.stride(0), batch.context_lens, batch.query_start,
        tables.kv_start, tables.seq_member, pre_parts, pre_lse, pre_lse.shape[2],
        rem_parts, rem_lse, counters,
        out, out.stride(0), out.stride(1),
        scale_log2,
        G=heads.group, G_PAD=heads.group_pad, BLOCK_M=max(16, heads.group_pad),
        BLOCK_N=block_n, HEAD_DIM=head_dim, HEAD_PAD=heads.head_pad,
        PAGE_SIZE=batch.page_size, SPLIT=splits > 1, SPLIT_BLOCK=MERGE_SPLIT_BLOCK,
        WINDOW=OWN_WINDOW if batch.page_size % block_n == 0 else 0,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=OWN_WARPS,
    )
    return out


def tiles_fit(ops: PageOperands, page_size: int, block_n: int) -> bool:
    """Whether `prefix_tiles_kernel` serves these pages with ``block_n`` keys a tile: float
    pages, and tiles (a power of two, at least 16: a ``tl.dot`` side) that never straddle a
    page, so a prefix of whole pages is whole tiles."""
    return (ops.key_bits == 0 and ops.value_bits == 0 and block_n >= 16
            and block_n & (block_n - 1) == 0 and page_size % block_n == 0)


def tile_keys(page_size: int, wanted: int) -> int:
    """Keys per tile of `prefix_tiles_kernel`: ``wanted`` (a power of two), halved until it
    divides ``page_size``."""
    keys = max(1, wanted)
    while keys > 1 and page_size % keys:
        keys //= 2
    return keys


def split_count(keys: int, programs: int, target_programs: int, max_splits: int,
                min_keys_per_split: int) -> int:
    """Parts to split ``keys`` into so ``programs`` (programs per split) come nearest to
    ``target_programs`` (rounded, not raised: a second wave of a few programs costs a whole
    wave), at most ``max_splits`` and no part under ``min_keys_per_split`` keys (a part that
    short costs more in partials than it gains in parallelism)."""
    wanted = round(target_programs / max(1, programs))
    by_length = max(1, -(-keys // max(1, min_keys_per_split)))
    return max(1, min(max_splits, wanted, by_length))


def cascade_reads(storage: KVStorage) -> bool:
    """Whether the cascade serves this storage: unquantized pages only. Its general prefix
    kernel reads quantized pages too (same loaders and rotation as the plain kernel), but
    quantized storages keep per-sequence state outside the pages (a recent-token window) that
    the cascade does not read."""
    return storage.mode == "fp16"


def _or_unknown(keys: int | None) -> int:
    return UNKNOWN_KEYS if keys is None else keys


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


__all__ = ["CascadePath", "CascadeTables", "GraphCascade", "PrefixLaunch", "StaticCascadeLayout",
           "TableLists", "attend_own_keys", "attend_prefixes", "cascade_reads", "cascade_tables",
           "split_count", "table_lists", "tile_keys", "tiles_fit"]
