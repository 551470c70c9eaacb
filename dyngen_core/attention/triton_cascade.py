"""Shared-prefix ("cascade") decode attention for the Triton backend: tables and launches.

For a decode-only batch with a `CascadePlan` (`shared_prefix.plan_shared_prefixes`), one layer
runs three kernels instead of one or two:

1. `triton_kernels.paged_attention_kernel` with ``REMAINDER``: every sequence against its own
   keys, from its group's prefix end (0 for sequences in no group) to its context length;
2. `triton_cascade_kernels.shared_prefix_kernel`: every group's query rows against the group's
   shared pages, read once per block of up to ``rows // G_PAD`` members;
3. `triton_cascade_kernels.merge_cascade_kernel`: both partials of every query row merged by
   log-sum-exp into the output.

The plan becomes one small int32 tensor (`CascadeTables`) per forward, built on the host and
copied once; every layer reuses it. This path runs only in eager forwards: its grids depend on
the plan, so it is never captured in a CUDA graph.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from dyngen_core.attention.shared_prefix import CascadePlan
from dyngen_core.attention.triton_cascade_kernels import merge_cascade_kernel, shared_prefix_kernel

if TYPE_CHECKING:
    from dyngen_core.attention.base import ForwardBatch
    from dyngen_core.attention.triton_paged import PageOperands


@dataclass(frozen=True)
class CascadeTables:
    """A cascade plan on the device: int32 views of one tensor, plus host sizes.

    seq_member [B]: each sequence's index in ``member_seq``, -1 for sequences in no group.
    kv_start [B]: where each sequence's own keys begin (its group's prefix tokens, else 0).
    member_seq [M], group_end [groups], group_prefix [groups], block_group / block_first
        [row blocks]: as `shared_prefix_kernel` reads them.
    num_members, num_blocks: M and the row blocks (the prefix kernel's first grid axis).
    max_prefix: the longest group prefix in tokens; max_remainder: the most own keys of a
        sequence (both choose split counts).
    """

    seq_member: torch.Tensor
    kv_start: torch.Tensor
    member_seq: torch.Tensor
    group_end: torch.Tensor
    group_prefix: torch.Tensor
    block_group: torch.Tensor
    block_first: torch.Tensor
    num_members: int
    num_blocks: int
    max_prefix: int
    max_remainder: int


def cascade_tables(plan: CascadePlan, context_lens: list[int], members_per_block: int,
                   device: torch.device) -> CascadeTables:
    """The device tables of ``plan`` for a batch with ``context_lens`` (one per sequence), in
    row blocks of at most ``members_per_block`` members; one host-to-device copy."""
    num_seqs = len(context_lens)
    kv_start = plan.kv_starts(num_seqs)
    seq_member = [-1] * num_seqs
    member_seq: list[int] = []
    group_end: list[int] = []
    group_prefix: list[int] = []
    block_group: list[int] = []
    block_first: list[int] = []
    for index, group in enumerate(plan.groups):
        begin = len(member_seq)
        for seq in group.members:
            seq_member[seq] = len(member_seq)
            member_seq.append(seq)
        group_end.append(len(member_seq))
        group_prefix.append(group.prefix_pages * plan.page_size)
        starts = range(begin, len(member_seq), members_per_block)
        block_group.extend([index] * len(starts))
        block_first.extend(starts)
    parts = [seq_member, kv_start, member_seq, group_end, group_prefix, block_group, block_first]
    flat = torch.tensor([value for part in parts for value in part], dtype=torch.int32)
    if device.type == "cuda":
        flat = flat.pin_memory()
    flat = flat.to(device, non_blocking=True)
    views: list[torch.Tensor] = []
    offset = 0
    for part in parts:
        views.append(flat[offset:offset + len(part)])
        offset += len(part)
    return CascadeTables(
        seq_member=views[0], kv_start=views[1], member_seq=views[2], group_end=views[3],
        group_prefix=views[4], block_group=views[5], block_first=views[6],
        num_members=len(member_seq), num_blocks=len(block_group),
        max_prefix=max(group_prefix),
        max_remainder=max(ctx - start for ctx, start in zip(context_lens, kv_start, strict=True)),
    )


@dataclass(frozen=True)
class PrefixLaunch:
    """How `attend_prefixes` launches the shared-prefix kernel.

    group, group_pad: query heads per KV head, and that rounded up to a power of two.
    rows: query rows per program (members x group_pad); block_n: keys per inner step.
    head_pad: head_dim padded for the kernel; splits: parts the prefixes are split into.
    warps: warps per program.
    """

    group: int
    group_pad: int
    rows: int
    block_n: int
    head_pad: int
    splits: int
    warps: int


def attend_prefixes(q: torch.Tensor, ops: PageOperands, page_args: tuple[object, ...],
                    batch: ForwardBatch, tables: CascadeTables, scale_log2: float,
                    launch: PrefixLaunch) -> tuple[torch.Tensor, torch.Tensor]:
    """Every group's query rows against its shared pages; returns float32 partials
    [M, H, splits, head_pad] and their log2-sum-exp [M, H, splits].

    page_args: the page tensors, scales, their strides and the rotation, in the kernels' order
    (`triton_paged.page_arguments`)."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = ops.keys.shape[2]
    parts = torch.empty(tables.num_members, num_heads, launch.splits, launch.head_pad,
                        dtype=torch.float32, device=q.device)
    lse = torch.empty(tables.num_members, num_heads, launch.splits, dtype=torch.float32,
                      device=q.device)
    shared_prefix_kernel[(tables.num_blocks, num_kv_heads, launch.splits)](
        q, q.stride(0), q.stride(1), *page_args,
        batch.page_table, batch.page_table.stride(0), batch.context_lens, batch.query_start,
        tables.member_seq, tables.group_end, tables.group_prefix, tables.block_group,
        tables.block_first,
        parts, lse,
        scale_log2,
        G=launch.group, G_PAD=launch.group_pad, BLOCK_M=launch.rows, BLOCK_N=launch.block_n,
        HEAD_DIM=head_dim, HEAD_PAD=launch.head_pad, PAGE_SIZE=batch.page_size,
        K_BITS=ops.key_bits, V_BITS=ops.value_bits, NUM_SPLITS=launch.splits,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=launch.warps,
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


def split_count(keys: int, programs: int, target_programs: int, max_splits: int,
                min_keys_per_split: int) -> int:
    """Parts to split ``keys`` into so ``programs`` (programs per split) come nearest to
    ``target_programs`` (rounded, not raised: a second wave of a few programs costs a whole
    wave), at most ``max_splits`` and no part under ``min_keys_per_split`` keys (a part that
    short costs more in partials than it gains in parallelism)."""
    wanted = round(target_programs / max(1, programs))
    by_length = max(1, -(-keys // max(1, min_keys_per_split)))
    return max(1, min(max_splits, wanted, by_length))


def multiprocessors(device: torch.device) -> int:
    """Streaming multiprocessors of ``device``; 4 for the Triton interpreter on the CPU (a few
    splits still exercise the merges)."""
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).multi_processor_count)
    return 4


def _pow2_at_least_2(n: int) -> int:
    return max(2, 1 << (max(1, n) - 1).bit_length())


__all__ = ["CascadeTables", "PrefixLaunch", "attend_prefixes", "cascade_tables",
           "merge_partials", "multiprocessors", "split_count"]
