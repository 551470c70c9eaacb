"""The cascade's own-keys pass with the merge inside it: two launches a layer instead of three.

The three-launch cascade (`triton_cascade`) writes float32 partials from the remainder pass
and from the shared-prefix pass, then merges them in a third kernel. Here the shared-prefix
pass runs first; then `remainder_merge_kernel` attends each sequence's own keys (from its
group's prefix end, or all of them for sequences in no group) and folds the prefix partials of
its group member into its running softmax state before it writes the output. One split per
sequence (the usual case: own keys are a question and a page's tail) writes no partials at all.

Several splits (a small batch: the split count follows the batch size alone, as in a graph)
write their partials, and the last split program of each (sequence, KV head) to count in
merges every split and the prefix partials, as the plain decode's in-kernel merge does
(`triton_decode_merge`: the barrier, the acquire-release count and ``.cg`` loads are the same
protocol), with counters of their own (`SplitCounters`, zero between launches).

Float pages only (`triton_cascade_path.cascade_reads`): the key loop is `attend_key_range`
with quantized paths and exact rows off.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

from dyngen_core.kv.attention.triton.key_loop import (
    attend_key_range,
    initial_state,
    load_scaled_queries,
    log2_sum_exp,
    tile_page,
    window_ids,
    window_keys,
)
from dyngen_core.kv.attention.triton.merge import fold_partials

if TYPE_CHECKING:
    from dyngen_core.kv.attention.base import ForwardBatch
    from dyngen_core.kv.attention.triton.cascade_tables import CascadeTables
    from dyngen_core.kv.attention.triton.operands import HeadShape, PageOperands


@triton.jit
def own_keys_windowed(q, m_i, l_i, acc, table_row, kv_lo, kv_hi, k_base, v_base, stride_kp,
                      stride_ks, stride_vp, stride_vs, dims, WINDOW: tl.constexpr,
                      BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr,
                      PAGE_SIZE: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """`attend_key_range` for keys [kv_lo, kv_hi) that every row sees, ``kv_lo`` a multiple
    of BLOCK_N counted from a page start and BLOCK_N dividing PAGE_SIZE (so no tile straddles
    a page): one page id per tile, picked out of a vector of ``WINDOW`` ids loaded before the
    window's tiles (no load in the tile loop feeds an address, so the pipeliner keeps tile
    copies in flight: `triton_cascade_kernels.prefix_tiles_kernel`, its WINDOW). ``q`` is
    scaled (`load_scaled_queries`)."""
    slots = tl.arange(0, BLOCK_N)
    for first_page in range(kv_lo // PAGE_SIZE, tl.cdiv(kv_hi, PAGE_SIZE), WINDOW):
        ids = window_ids(table_row, first_page, kv_hi, PAGE_SIZE, WINDOW)
        lo, hi = window_keys(first_page, kv_lo, kv_hi, PAGE_SIZE, WINDOW)
        for n0 in range(lo, hi, BLOCK_N):
            page = tile_page(ids, first_page, n0, PAGE_SIZE, WINDOW)
            rows = n0 % PAGE_SIZE + slots
            key_valid = n0 + slots < hi
            mask = key_valid[:, None] & (dims < HEAD_DIM)[None, :]
            k = tl.load(k_base + page * stride_kp + (rows * stride_ks)[:, None] + dims[None, :],
                        mask=mask, other=0.0)
            scores = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=DOT_PRECISION)
            scores = tl.where(key_valid[None, :], scores, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(scores, 1))
            p = tl.exp2(scores - m_new[:, None])
            alpha = tl.exp2(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(v_base + page * stride_vp + (rows * stride_vs)[:, None] + dims[None, :],
                        mask=mask, other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype),
                                                input_precision=DOT_PRECISION)
            m_i = m_new
    return m_i, l_i, acc


# As `paged_attention_kernel`: the page table width follows the batch outside CUDA graphs;
# the prefix split count follows the lengths in eager forwards.
@triton.jit(do_not_specialize=["stride_pt", "pre_splits"])
def remainder_merge_kernel(
    q_ptr, stride_qt, stride_qh,
    k_ptr, v_ptr, stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh,
    page_table_ptr, stride_pt, context_lens_ptr, query_start_ptr, kv_start_ptr,
    seq_member_ptr, pre_out_ptr, pre_lse_ptr, pre_splits,
    rem_out_ptr, rem_lse_ptr, counter_ptr,
    out_ptr, stride_ot, stride_oh,
    scale_log2,
    G: tl.constexpr, G_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr, PAGE_SIZE: tl.constexpr,
    SPLIT: tl.constexpr, SPLIT_BLOCK: tl.constexpr, DOT_PRECISION: tl.constexpr,
    WINDOW: tl.constexpr = 0,
):
    """Grid (decode sequences, KV heads, splits): one decode token's ``G`` query heads of one
    KV head against its own keys [kv_start[seq], context), merged with its group's prefix.

    seq_member [B]: the sequence's row in the prefix partials [members, H, pre_splits,
        HEAD_PAD] (``pre_out``) and their log2-sum-exp (``pre_lse``), -1 in no group.
    SPLIT (several splits): each split writes its partial to ``rem_out`` [B, H, splits,
        HEAD_PAD] / ``rem_lse`` and counts in at ``counter_ptr[seq * kv_heads + kv_head]``
        (zero between launches); the last one merges. Without SPLIT the grid has one split and
        the program writes the output directly (``rem_*`` and counters are never read).
    WINDOW > 0: the own keys through `own_keys_windowed` (BLOCK_N must divide PAGE_SIZE;
        own keys start at a page: a group's prefix is whole pages)."""
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    num_splits = tl.num_programs(2)
    num_heads = tl.num_programs(1) * G
    q_start = tl.load(query_start_ptr + seq).to(tl.int64)
    ctx = tl.load(context_lens_ptr + seq)
    rows = tl.arange(0, BLOCK_M)
    head_in_group = rows % G_PAD
    row_valid = (rows < G_PAD) & (head_in_group < G)
    head = kv_head * G + head_in_group
    dims = tl.arange(0, HEAD_PAD)
    q = load_scaled_queries(q_ptr, q_start * stride_qt + head * stride_qh, row_valid, dims,
                            q_ptr, scale_log2, 0, HEAD_DIM, BLOCK_M, HEAD_PAD)
    kv_begin = tl.load(kv_start_ptr + seq)
    chunk = tl.cdiv(tl.cdiv(ctx - kv_begin, num_splits), BLOCK_N) * BLOCK_N
    kv_lo = kv_begin + split * chunk
    kv_hi = tl.minimum(kv_lo + chunk, ctx)
    table_row = page_table_ptr + seq.to(tl.int64) * stride_pt
    position = ctx - 1 + rows * 0
    m_i, l_i, acc = initial_state(BLOCK_M, HEAD_PAD)
    if WINDOW > 0:
        m_i, l_i, acc = own_keys_windowed(
            q, m_i, l_i, acc, table_row, kv_lo, kv_hi, k_ptr + kv_head * stride_kh,
            v_ptr + kv_head * stride_vh, stride_kp, stride_ks, stride_vp, stride_vs, dims,
            WINDOW, BLOCK_N, HEAD_DIM, HEAD_PAD, PAGE_SIZE, DOT_PRECISION)
    else:
        m_i, l_i, acc = attend_key_range(
            q, m_i, l_i, acc, table_row, kv_lo, kv_hi, position, kv_head, dims,
            k_ptr, v_ptr, stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh,
            k_ptr, v_ptr, 0, 0, 0, 0, 0, 0,
            k_ptr, v_ptr, 0, 0, table_row, -1, 0, 0,
            BLOCK_M, BLOCK_N, HEAD_DIM, HEAD_PAD, PAGE_SIZE, 0, 0, False, 0, DOT_PRECISION)
    merge = True
    if SPLIT:
        part_row = (seq.to(tl.int64) * num_heads + head) * num_splits
        acc = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(rem_out_ptr + (part_row + split)[:, None] * HEAD_PAD + dims[None, :], acc,
                 mask=row_valid[:, None])
        tl.store(rem_lse_ptr + part_row + split, log2_sum_exp(m_i, l_i), mask=row_valid)
        tl.debug_barrier()  # every thread's partial stores come before the release below
        counter = counter_ptr + seq * tl.num_programs(1) + kv_head
        arrived = tl.atomic_add(counter, 1, sem="acq_rel")
        merge = arrived == num_splits - 1
        if merge:
            m_i, l_i, acc = initial_state(BLOCK_M, HEAD_PAD)
            m_i, l_i, acc = fold_partials(m_i, l_i, acc, rem_out_ptr, rem_lse_ptr, part_row,
                                          num_splits, row_valid, dims, SPLIT_BLOCK, HEAD_PAD)
            tl.store(counter, 0)
    if merge:
        member = tl.load(seq_member_ptr + seq)
        pre_row = (tl.maximum(member, 0).to(tl.int64) * num_heads + head) * pre_splits
        m_i, l_i, acc = fold_partials(m_i, l_i, acc, pre_out_ptr, pre_lse_ptr, pre_row,
                                      tl.where(member >= 0, pre_splits, 0), row_valid, dims,
                                      SPLIT_BLOCK, HEAD_PAD)
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        o_ptrs = out_ptr + (q_start * stride_ot + head * stride_oh)[:, None] + dims[None, :]
        tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty),
                 mask=row_valid[:, None] & (dims < HEAD_DIM)[None, :])


def attend_remainder_merged(q: torch.Tensor, ops: PageOperands, batch: ForwardBatch,
                            tables: CascadeTables, prefix: tuple[torch.Tensor, torch.Tensor],
                            scale_log2: float, heads: HeadShape, *, splits: int,
                            counters: torch.Tensor | None, block_n: int, warps: int,
                            split_block: int, window: int = 0) -> torch.Tensor:
    """Own keys of every decode sequence merged with its group's prefix partials (parts,
    lse) [M, H, S_pre, ...] from `triton_cascade.attend_prefixes`; returns the output
    [B, H, D] in q's dtype.

    splits: parts of each sequence's own keys (from the batch shape alone in a graph);
        several need ``counters`` (at least B x KV heads zeroed int32) and float32 partial
        buffers, allocated here.
    block_n, warps: keys per inner step and warps per program.
    split_block: partials loaded per round of the merges (a power of two).
    window: page ids per vector of `own_keys_windowed` (a power of two; 0: per-key page
        loads); used only where ``block_n`` divides the page size."""
    num_tokens, num_heads, head_dim = q.shape
    out = torch.empty_like(q)
    pre_parts, pre_lse = prefix
    if splits > 1:
        if counters is None:
            raise ValueError("a split remainder pass needs its split counters")
        rem_parts = torch.empty(num_tokens, num_heads, splits, heads.head_pad,
                                dtype=torch.float32, device=q.device)
        rem_lse = torch.empty(num_tokens, num_heads, splits, dtype=torch.float32,
                              device=q.device)
    else:
        rem_parts = rem_lse = counters = pre_lse  # never read
    keys, values = ops.keys, ops.values
    remainder_merge_kernel[(batch.num_seqs, heads.num_kv_heads, splits)](
        q, q.stride(0), q.stride(1), keys, values, *keys.stride()[:3], *values.stride()[:3],
        batch.page_table, batch.page_table.stride(0), batch.context_lens, batch.query_start,
        tables.kv_start, tables.seq_member, pre_parts, pre_lse, pre_lse.shape[2],
        rem_parts, rem_lse, counters,
        out, out.stride(0), out.stride(1),
        scale_log2,
        G=heads.group, G_PAD=heads.group_pad, BLOCK_M=max(16, heads.group_pad),
        BLOCK_N=block_n, HEAD_DIM=head_dim, HEAD_PAD=heads.head_pad,
        PAGE_SIZE=batch.page_size, SPLIT=splits > 1, SPLIT_BLOCK=split_block,
        WINDOW=window if batch.page_size % block_n == 0 else 0,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=warps,
    )
    return out


__all__ = ["attend_remainder_merged", "own_keys_windowed",
           "remainder_merge_kernel"]
