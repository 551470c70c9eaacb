"""The cascade's shared-prefix pass with its page ids loaded ahead: the tile loads pipeline.

`triton_cascade_kernels.prefix_tiles_kernel` loads each tile's page id inside its key loop, so
the tile's address depends on a load of the same loop. Triton's software pipeliner (3.6, sm_90)
then keeps two tile buffers and waits for every copy in flight at the top of each step
(``async_wait {num = 0}`` in its TTGIR): the next tile's copy starts after the current
tile's first dot and must land before the next step starts, so each step pays most of a
memory round trip. `prefix_window_kernel` loads the page ids of a window of ``WINDOW`` pages
as one vector before the loop over the window's tiles and picks each tile's id out of it with
a masked sum (no load), so the tile addresses depend on loop values alone and the pipeliner
keeps ``num_stages - 1`` tiles in flight (``async_wait {num > 0}``).

Everything else is `prefix_tiles_kernel`'s: same grid, tables, splits and partials, float
pages whose page size the tile divides (`triton_cascade.tiles_fit`).
"""

from __future__ import annotations

import triton
import triton.language as tl

from dyngen_core.attention.triton_cascade_kernels import _page_tile
from dyngen_core.attention.triton_kernels import initial_state, log2_sum_exp


@triton.jit
def _window_keys(q, m_i, l_i, acc, ids, first_page, lo, hi, k_base, v_base, stride_ks,
                 stride_vs, stride_kp, stride_vp, scale_log2, dims, slots,
                 WINDOW: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
                 HEAD_PAD: tl.constexpr, PAGE_SIZE: tl.constexpr,
                 DOT_PRECISION: tl.constexpr):
    """Online softmax over keys [lo, hi) (whole tiles), all in the pages ``ids`` [WINDOW]
    (int64) numbered from ``first_page``."""
    window = tl.arange(0, WINDOW)
    for n0 in range(lo, hi, BLOCK_N):
        page = tl.sum(tl.where(window == n0 // PAGE_SIZE - first_page, ids, 0), 0)
        slot = n0 % PAGE_SIZE
        k = _page_tile(k_base + page * stride_kp, slot, slots, stride_ks, dims, HEAD_DIM,
                       HEAD_PAD)
        scores = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=DOT_PRECISION)
        m_new = tl.maximum(m_i, tl.max(scores, 1) * scale_log2)
        p = tl.exp2(scores * scale_log2 - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = _page_tile(v_base + page * stride_vp, slot, slots, stride_vs, dims, HEAD_DIM,
                       HEAD_PAD)
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype),
                                            input_precision=DOT_PRECISION)
        m_i = m_new
    return m_i, l_i, acc


# As `paged_attention_kernel`: the page table width follows the batch outside CUDA graphs.
@triton.jit(do_not_specialize=["stride_pt"])
def prefix_window_kernel(
    q_ptr, stride_qt, stride_qh,
    k_ptr, v_ptr, stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh,
    page_table_ptr, stride_pt, query_start_ptr,
    member_seq_ptr, group_end_ptr, group_prefix_ptr, block_group_ptr, block_first_ptr,
    num_blocks_ptr,
    part_out_ptr, part_lse_ptr,
    scale_log2,
    G: tl.constexpr, G_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr, PAGE_SIZE: tl.constexpr,
    WINDOW: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """`prefix_tiles_kernel` (same arguments and partials) with the page ids of ``WINDOW``
    pages (a power of two) loaded as one vector ahead of each window's tiles."""
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    num_splits = tl.num_programs(2)
    num_heads = tl.num_programs(1) * G
    rows = tl.arange(0, BLOCK_M)
    dims = tl.arange(0, HEAD_PAD)
    slots = tl.arange(0, BLOCK_N)
    window = tl.arange(0, WINDOW)
    head_in_group = rows % G_PAD
    head = kv_head * G + head_in_group
    k_base = k_ptr + kv_head * stride_kh
    v_base = v_ptr + kv_head * stride_vh
    num_blocks = tl.load(num_blocks_ptr)
    for block in range(tl.program_id(0), num_blocks, tl.num_programs(0)):
        group = tl.load(block_group_ptr + block)
        first = tl.load(block_first_ptr + block)
        end = tl.load(group_end_ptr + group)
        prefix = tl.load(group_prefix_ptr + group)
        member = first + rows // G_PAD
        row_valid = (member < end) & (head_in_group < G)
        seq = tl.load(member_seq_ptr + member, mask=row_valid, other=0)
        token = tl.load(query_start_ptr + seq, mask=row_valid, other=0)
        q_rows = token.to(tl.int64) * stride_qt + head * stride_qh
        q = tl.load(q_ptr + q_rows[:, None] + dims[None, :],
                    mask=row_valid[:, None] & (dims < HEAD_DIM)[None, :], other=0.0)
        chunk = tl.cdiv(tl.cdiv(prefix, num_splits), BLOCK_N) * BLOCK_N
        kv_lo = split * chunk
        kv_hi = tl.minimum(kv_lo + chunk, prefix)
        leader = tl.load(member_seq_ptr + first)
        table_row = page_table_ptr + leader.to(tl.int64) * stride_pt
        last_page = tl.cdiv(kv_hi, PAGE_SIZE)
        m_i, l_i, acc = initial_state(BLOCK_M, HEAD_PAD)
        for first_page in range(kv_lo // PAGE_SIZE, last_page, WINDOW):
            ids = tl.load(table_row + first_page + window,
                          mask=first_page + window < last_page, other=0).to(tl.int64)
            m_i, l_i, acc = _window_keys(
                q, m_i, l_i, acc, ids, first_page, tl.maximum(kv_lo, first_page * PAGE_SIZE),
                tl.minimum(kv_hi, (first_page + WINDOW) * PAGE_SIZE), k_base, v_base,
                stride_ks, stride_vs, stride_kp, stride_vp, scale_log2, dims, slots,
                WINDOW, BLOCK_N, HEAD_DIM, HEAD_PAD, PAGE_SIZE, DOT_PRECISION)
        acc = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        part_row = (member.to(tl.int64) * num_heads + head) * num_splits + split
        tl.store(part_out_ptr + part_row[:, None] * HEAD_PAD + dims[None, :], acc,
                 mask=row_valid[:, None])
        tl.store(part_lse_ptr + part_row, log2_sum_exp(m_i, l_i), mask=row_valid)


__all__ = ["prefix_window_kernel"]
