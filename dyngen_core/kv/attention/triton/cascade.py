"""Shared-prefix ("cascade") decode attention for the Triton backend: tables and launches.

For a decode-only batch with a `CascadePlan` (`shared_prefix.plan_shared_prefixes`), one layer
runs three kernels instead of one or two:

1. `triton_kernels.paged_attention_kernel` with ``REMAINDER``: every sequence against its own
   keys, from its group's prefix end (0 for sequences in no group) to its context length;
2. `triton_cascade_kernels.prefix_tiles_kernel` (float pages whose page size the key tile
   divides, optionally loading page ids a window ahead: its WINDOW); else
   the general `shared_prefix_kernel`): every group's query rows against the group's shared
   pages, read once per block of up to ``rows // G_PAD`` members;
3. `triton_cascade_kernels.merge_cascade_kernel`: both partials of every query row merged by
   log-sum-exp into the output.

With ``CascadeOptions.fused_merge`` (`triton_cascade_path`) the prefix pass runs first and the
own-keys pass merges (`triton_cascade_fused`): two launches, no merge kernel.

The plan becomes small int32 tables (`triton_cascade_tables.CascadeTables`) that every layer
reuses: built per eager forward, or staged into a CUDA graph's static buffers each step. In a
graph the launches' grids and split counts depend on the bucket size alone (`PrefixLaunch`,
``CascadeTables.grid_blocks``), and the kernels read the plan's sizes from the tables.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from dyngen_core.kv.attention.triton.cascade_kernels import (
    merge_cascade_kernel,
    prefix_tiles_kernel,
    shared_prefix_kernel,
)
from dyngen_core.kv.attention.triton.decode import multiprocessors

if TYPE_CHECKING:
    from dyngen_core.kv.attention.base import ForwardBatch
    from dyngen_core.kv.attention.triton.cascade_tables import CascadeTables
    from dyngen_core.kv.attention.triton.operands import PageOperands


@dataclass(frozen=True)
class PrefixLaunch:
    """How `attend_prefixes` launches the shared-prefix kernel.

    group, group_pad: query heads per KV head, and that rounded up to a power of two.
    rows: query rows per program (members x group_pad); block_n: keys per inner step.
    head_pad: head_dim padded for the kernel; splits: parts the prefixes are split into.
    warps: warps per program; stages: software-pipelining stages of the key loop (Triton's
        ``num_stages``).
    tiles: run `prefix_tiles_kernel` (float pages, ``block_n`` dividing the page size: see
        `tiles_fit`) instead of the general `shared_prefix_kernel`.
    window: with ``tiles``, pages whose ids `prefix_tiles_kernel` loads ahead of their tiles
        (its WINDOW: a power of two; 0 loads each tile's page id in the key loop).
    """

    group: int
    group_pad: int
    rows: int
    block_n: int
    head_pad: int
    splits: int
    warps: int
    stages: int = 3
    tiles: bool = True
    window: int = 0


def attend_prefixes(q: torch.Tensor, ops: PageOperands, page_args: tuple[object, ...],
                    batch: ForwardBatch, tables: CascadeTables, scale_log2: float,
                    launch: PrefixLaunch) -> tuple[torch.Tensor, torch.Tensor]:
    """Every group's query rows against its shared pages; returns float32 partials
    [M, H, splits, head_pad] and their log2-sum-exp [M, H, splits].

    page_args: the page tensors, scales, their strides and the rotation, in the kernels' order
    (`triton_page_operands.page_arguments`)."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = ops.keys.shape[2]
    parts = torch.empty(tables.member_rows, num_heads, launch.splits, launch.head_pad,
                        dtype=torch.float32, device=q.device)
    lse = torch.empty(tables.member_rows, num_heads, launch.splits, dtype=torch.float32,
                      device=q.device)
    if launch.tiles:
        keys, values = ops.keys, ops.values
        prefix_tiles_kernel[(tables.grid_blocks, num_kv_heads, launch.splits)](
            q, q.stride(0), q.stride(1), keys, values, *keys.stride()[:3], *values.stride()[:3],
            batch.page_table, batch.page_table.stride(0), batch.query_start,
            tables.member_seq, tables.group_end, tables.group_prefix, tables.block_group,
            tables.block_first, tables.num_blocks,
            parts, lse,
            scale_log2,
            G=launch.group, G_PAD=launch.group_pad, BLOCK_M=launch.rows,
            BLOCK_N=launch.block_n, HEAD_DIM=head_dim, HEAD_PAD=launch.head_pad,
            PAGE_SIZE=batch.page_size, WINDOW=launch.window,
            DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
            num_warps=launch.warps, num_stages=launch.stages,
        )
        return parts, lse
    shared_prefix_kernel[(tables.grid_blocks, num_kv_heads, launch.splits)](
        q, q.stride(0), q.stride(1), *page_args,
        batch.page_table, batch.page_table.stride(0), batch.context_lens, batch.query_start,
        tables.member_seq, tables.group_end, tables.group_prefix, tables.block_group,
        tables.block_first, tables.num_blocks,
        parts, lse,
        scale_log2,
        G=launch.group, G_PAD=launch.group_pad, BLOCK_M=launch.rows, BLOCK_N=launch.block_n,
        HEAD_DIM=head_dim, HEAD_PAD=launch.head_pad, PAGE_SIZE=batch.page_size,
        K_BITS=ops.key_bits, V_BITS=ops.value_bits, NUM_SPLITS=launch.splits,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=launch.warps, num_stages=launch.stages,
    )
    return parts, lse


def merge_partials(out: torch.Tensor, remainder: tuple[torch.Tensor, torch.Tensor],
                   prefix: tuple[torch.Tensor, torch.Tensor], tables: CascadeTables) -> None:
    """Write into ``out`` [B, H, D] every row's merge of its remainder partials (parts, lse)
    [B, H, S_rem, ...] and, for group members, its prefix partials [M, H, S_pre, ...]."""
    num_tokens, num_heads, head_dim = out.shape
    rem_parts, rem_lse = remainder
    pre_parts, pre_lse = prefix
    rem_splits, pre_splits = rem_lse.shape[2], pre_lse.shape[2]
    merge_cascade_kernel[(num_tokens, num_heads)](
        rem_parts, rem_lse, pre_parts, pre_lse, tables.seq_member,
        out, out.stride(0), out.stride(1), num_heads,
        REM_SPLITS=rem_splits, REM_PAD=_pow2_at_least_2(rem_splits),
        PRE_SPLITS=pre_splits, PRE_PAD=_pow2_at_least_2(pre_splits),
        HEAD_DIM=head_dim, HEAD_PAD=rem_parts.shape[3], num_warps=4,
    )


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


def _pow2_at_least_2(n: int) -> int:
    return max(2, 1 << (max(1, n) - 1).bit_length())


__all__ = ["PrefixLaunch", "attend_prefixes", "merge_partials", "multiprocessors",
           "split_count", "tile_keys", "tiles_fit"]
