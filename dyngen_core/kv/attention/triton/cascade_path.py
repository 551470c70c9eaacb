"""When and how `TritonPagedBackend` runs a decode step as shared-prefix ("cascade") attention.

`CascadePath` owns the cascade side of the backend: the policy (`shared_prefix.CascadePolicy`),
the step's plan and device tables, and the launch of one layer's cascade: by default the
shared-prefix kernel, then the own-keys pass that merges its partials (`triton_cascade_fused`);
with ``fused_merge=False`` the first version's three launches (the remainder pass through the
backend's paged kernel, the shared-prefix kernel, the merge). The backend keeps the plain paged
launch and hands it in as a callable, so this module never imports it.

Tables come from one of two places. An eager forward (host page tables at hand) plans its batch
and builds tables sized to the plan, with split counts chosen from the lengths. A CUDA graph's
batch carries them (``ForwardBatch.cascade``, views of the graph's static buffers, filled each
step through `graph_layout`'s `StaticCascadeLayout`): then every grid and split count follows
from the batch size alone, so one capture serves every plan of its bucket. Graph steps are
planned by `plan_step` through a `SharedPrefixTracker`, which plans again only when a step
changed a page some decodes share.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from dyngen_core.engine.cascade import CascadePlan, CascadePolicy, plan_shared_prefixes
from dyngen_core.engine.cascade_tracker import SharedPrefixTracker
from dyngen_core.engine.plan import StepPlan
from dyngen_core.kv.attention.base import ForwardBatch
from dyngen_core.kv.attention.triton.cascade import (
    PrefixLaunch,
    attend_prefixes,
    merge_partials,
    multiprocessors,
    split_count,
    tile_keys,
    tiles_fit,
)
from dyngen_core.kv.attention.triton.cascade_fused import attend_remainder_merged
from dyngen_core.kv.attention.triton.cascade_tables import (
    CascadeTables,
    StaticCascadeLayout,
    cascade_tables,
)
from dyngen_core.kv.attention.triton.merge import SplitCounters
from dyngen_core.kv.storage import KVStorage

if TYPE_CHECKING:
    from dyngen_core.kv.attention.triton.operands import HeadShape, PageOperands

LOG2_E = 1.4426950408889634
PREFIX_KERNELS = ("tiles", "window", "general")
UNKNOWN_KEYS = 1 << 30  # a graph's lengths: never the bound on its split count
# (out, (partials, lse), splits, kv_start): one REMAINDER launch of the backend's paged kernel.
RemainderLaunch = Callable[[torch.Tensor, tuple[torch.Tensor, torch.Tensor], int, torch.Tensor],
                           None]


@dataclass(frozen=True)
class CascadeOptions:
    """The backend's cascade settings (as `TritonPagedBackend` documents them).

    policy: when a plan pays (None: never cascade).
    rows, warps, programs_per_sm: the shared-prefix kernel's query rows and warps per program,
        and its programs aimed for per multiprocessor.
    block_n, max_splits, decode_programs_per_sm: the backend's keys per inner step, most splits
        and plain decode programs per multiprocessor (the remainder pass's split count).
    prefix_kernel: "tiles" runs the shared prefixes through `prefix_tiles_kernel` wherever it
        fits (float pages; its tile is ``prefix_block_n`` keys, halved until it divides the
        page size, at least 16), "window" through the same kernel with the page ids of
        ``prefix_window`` pages loaded ahead of their tiles (so the tile copies pipeline),
        "general" always through `shared_prefix_kernel` (the first version, kept for
        comparison).
    prefix_window: pages per id vector of the "window" kernel (a power of two).
    prefix_block_n: keys per inner step of the shared-prefix kernel (None: ``block_n``).
    stages: software-pipelining stages of the shared-prefix kernel's key loop.
    fused_merge: True runs two launches a layer: the shared-prefix pass, then the own-keys
        pass that folds the prefix partials into each row and writes the output
        (`triton_cascade_fused`); False the first three-launch version (own keys through the
        backend's paged kernel, then the prefix pass, then `merge_cascade_kernel`).
    remainder_max_splits: with ``fused_merge``, most splits of each sequence's own keys (the
        count still follows the batch size and ``decode_programs_per_sm``; None: ``max_splits``;
        1: never split, no partials or counters at all).
    remainder_warps: with ``fused_merge``, warps per own-keys program.
    remainder_block_n: with ``fused_merge``, keys per inner step of the own-keys pass (None:
        ``block_n``; fewer, larger steps are fewer dependent memory round trips over the
        few own keys of a member).
    remainder_window: with ``fused_merge``, 0 reads own keys with a page id per key (the
        paged kernel's loop); > 0 (a power of two) loads that many page ids ahead of their
        tiles, one id a tile, so the tile copies pipeline (`triton_cascade_fused`), where
        the tile divides the page size.
    merge_split_block: with ``fused_merge``, partials loaded per round of its merges.
    """

    policy: CascadePolicy | None
    rows: int
    warps: int
    programs_per_sm: int
    block_n: int
    max_splits: int
    decode_programs_per_sm: int
    prefix_kernel: str = "tiles"
    prefix_block_n: int | None = None
    stages: int = 3
    prefix_window: int = 16
    fused_merge: bool = True
    remainder_max_splits: int | None = None
    remainder_warps: int = 4
    remainder_block_n: int | None = None
    remainder_window: int = 0
    merge_split_block: int = 4


class CascadePath:
    """Plans, tables and launches of the cascade for one backend (see `CascadeOptions`)."""

    def __init__(self, options: CascadeOptions) -> None:
        if options.rows < 16 or options.rows & (options.rows - 1):
            raise ValueError(f"cascade_rows must be a power of two >= 16 (a tl.dot tile); "
                             f"got {options.rows}")
        if options.prefix_kernel not in PREFIX_KERNELS:
            raise ValueError(f"cascade prefix_kernel must be one of {PREFIX_KERNELS}; got "
                             f"{options.prefix_kernel!r}")
        if options.stages < 1:
            raise ValueError(f"cascade stages must be >= 1; got {options.stages}")
        for name, least in (("merge_split_block", 1), ("prefix_window", 1),
                            ("remainder_block_n", 16),  # keys: a tl.dot side
                            ("remainder_window", 1)):
            value = getattr(options, name) or least
            if value < least or value & (value - 1):
                raise ValueError(f"cascade {name} must be a power of two >= {least}; got "
                                 f"{value}")
        if options.remainder_max_splits is not None and options.remainder_max_splits < 1:
            raise ValueError(f"cascade remainder_max_splits must be >= 1 or None; got "
                             f"{options.remainder_max_splits}")
        self.options = options
        self._plan: tuple[ForwardBatch, CascadePlan | None] | None = None
        self._tables: tuple[ForwardBatch, int, CascadeTables] | None = None
        self._tracker: SharedPrefixTracker | None = None  # graph steps: reuses plans
        # The fused merge's counters (split own-keys passes): allocated by an eager call (a
        # graph's warm-up forwards) before any capture needs them.
        self.split_counters = SplitCounters()

    def plan(self, batch: ForwardBatch, storage: KVStorage) -> CascadePlan | None:
        """The batch's shared-prefix plan (once per batch), or None when it runs no cascade."""
        policy = self.options.policy
        if (policy is None or not cascade_reads(storage)
                or batch.page_tables_host is None or not batch.is_decode_only):
            return None
        cached = self._plan
        if cached is not None and cached[0] is batch:
            return cached[1]
        plan = plan_shared_prefixes(batch.page_tables_host, batch.context_lens_host,
                                    batch.query_lens_host, batch.page_size, policy)
        self._plan = (batch, plan)
        return plan

    def plan_step(self, plan: StepPlan, storage: KVStorage) -> CascadePlan | None:
        """The shared-prefix plan of the decode-only batch ``plan`` would build, from the plan
        alone (no batch, no tensors); None when it runs no cascade. Successive steps go
        through one `SharedPrefixTracker`: a step that changed no shared page reuses the
        previous step's plan (the same object when the batch order is unchanged)."""
        policy = self.options.policy
        if policy is None or not cascade_reads(storage) or not plan.slices:
            return None
        tracker = self._tracker
        if tracker is None or tracker.page_size != storage.page_size:
            tracker = self._tracker = SharedPrefixTracker(storage.page_size, policy)
        return tracker.plan(plan.slices)

    def graph_layout(self, storage: KVStorage, num_heads: int, num_kv_heads: int,
                     capacity: int) -> StaticCascadeLayout | None:
        """Where a CUDA graph's static buffers hold the tables of batches of up to ``capacity``
        sequences with this head layout; None when this backend never cascades over
        ``storage``."""
        if self.options.policy is None or not cascade_reads(storage):
            return None
        return StaticCascadeLayout(capacity, self.members_per_block(num_heads // num_kv_heads))

    def members_per_block(self, group: int) -> int:
        """Members in one shared-prefix program's rows for ``group`` query heads per KV head."""
        group_pad = 1 << (max(1, group) - 1).bit_length()
        return max(self.options.rows, group_pad) // group_pad

    def tables(self, batch: ForwardBatch, storage: KVStorage, heads: HeadShape,
               device: torch.device) -> CascadeTables | None:
        """The batch's device tables: a graph batch's own, else those of its plan (built once
        per batch); None: no cascade."""
        if batch.cascade is not None:
            return batch.cascade
        plan = self.plan(batch, storage)
        if plan is None:
            return None
        members_per_block = self.members_per_block(heads.group)
        cached = self._tables
        if cached is not None and cached[0] is batch and cached[1] == members_per_block:
            return cached[2]
        tables = cascade_tables(plan, batch.context_lens_host, members_per_block, device)
        self._tables = (batch, members_per_block, tables)
        return tables

    def attend(self, q: torch.Tensor, ops: PageOperands, page_args: tuple[object, ...],
               batch: ForwardBatch, tables: CascadeTables, scale: float, heads: HeadShape,
               launch_remainder: RemainderLaunch) -> torch.Tensor:
        """Own keys of every sequence, shared prefixes of every group, merged per query row."""
        options = self.options
        num_tokens, num_heads, _ = q.shape
        sms = multiprocessors(q.device)
        launch = self.prefix_launch(ops, batch, tables, heads, sms)
        if options.fused_merge:
            prefix = attend_prefixes(q, ops, page_args, batch, tables, scale * LOG2_E, launch)
            splits = self.remainder_splits(batch, tables, heads, sms)
            counters = (self.split_counters.for_launch(q.device,
                                                       batch.num_seqs * heads.num_kv_heads)
                        if splits > 1 else None)
            return attend_remainder_merged(
                q, ops, batch, tables, prefix, scale * LOG2_E, heads, splits=splits,
                counters=counters, block_n=options.remainder_block_n or options.block_n,
                warps=options.remainder_warps, split_block=options.merge_split_block,
                window=options.remainder_window)
        rem_splits = self.remainder_splits(batch, tables, heads, sms)
        remainder = (
            torch.empty(num_tokens, num_heads, rem_splits, heads.head_pad, dtype=torch.float32,
                        device=q.device),
            torch.empty(num_tokens, num_heads, rem_splits, dtype=torch.float32, device=q.device))
        out = torch.empty_like(q)
        launch_remainder(out, remainder, rem_splits, tables.kv_start)
        prefix = attend_prefixes(q, ops, page_args, batch, tables, scale * LOG2_E, launch)
        merge_partials(out, remainder, prefix, tables)
        return out

    def remainder_splits(self, batch: ForwardBatch, tables: CascadeTables, heads: HeadShape,
                         sms: int) -> int:
        """Parts of each sequence's own keys: from the batch shape alone in a graph (its
        tables leave the lengths unknown), as the plain decode's split count."""
        options = self.options
        most = options.max_splits
        if options.fused_merge and options.remainder_max_splits is not None:
            most = min(most, options.remainder_max_splits)
        return split_count(_or_unknown(tables.max_remainder),
                           batch.num_seqs * heads.num_kv_heads,
                           options.decode_programs_per_sm * sms, most, 4 * options.block_n)

    def prefix_launch(self, ops: PageOperands, batch: ForwardBatch, tables: CascadeTables,
                       heads: HeadShape, sms: int) -> PrefixLaunch:
        """The shared-prefix kernel's launch: which kernel, its tile and its split count (from
        the bucket alone in a graph)."""
        options = self.options
        block_n = options.prefix_block_n or options.block_n
        tiles = False
        if options.prefix_kernel in ("tiles", "window"):
            tile_n = tile_keys(batch.page_size, block_n)
            tiles = tiles_fit(ops, batch.page_size, tile_n)
            # The general kernel keeps the backend's tile: a prefix tile too small for any
            # page-dividing tile (below 16 keys) is also too small for its dot.
            block_n = tile_n if tiles else options.block_n
        splits = split_count(_or_unknown(tables.max_prefix),
                             tables.grid_blocks * heads.num_kv_heads,
                             options.programs_per_sm * sms, options.max_splits, 4 * block_n)
        return PrefixLaunch(group=heads.group, group_pad=heads.group_pad,
                            rows=max(options.rows, heads.group_pad), block_n=block_n,
                            head_pad=heads.head_pad, splits=splits, warps=options.warps,
                            stages=options.stages, tiles=tiles,
                            window=options.prefix_window
                            if tiles and options.prefix_kernel == "window" else 0)


def _or_unknown(keys: int | None) -> int:
    return UNKNOWN_KEYS if keys is None else keys


def cascade_reads(storage: KVStorage) -> bool:
    """Whether the cascade serves this storage: unquantized pages only. Its kernels read
    quantized pages too (same loaders and rotation as the plain kernel, and they agree with it
    on the q8/q6/q4 page formats), but quantized storages are gaining per-sequence state
    outside the pages (a recent-token window) that the plain path must handle first."""
    return storage.mode == "fp16"


__all__ = ["PREFIX_KERNELS", "CascadeOptions", "CascadePath", "RemainderLaunch",
           "cascade_reads"]
