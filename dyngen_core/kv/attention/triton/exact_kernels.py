"""Triton helpers of the exact rows of quantized caches (page heads, recent windows), used by
`triton_kernels.paged_attention_kernel` and `triton_quant_kernels.quant_decode_kernel`; the
reading rule is `attention.sdpa_recent`'s."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def exact_row_of_page(rows, row_ptr, page, kv_head, is_head, dims, stride_er, stride_eh,
                       HEAD_DIM: tl.constexpr):
    """``rows`` [BLOCK_N, HEAD_PAD] with the keys at slot 0 of a page replaced by the page's
    unquantized head row (stored rotated, like the codes)."""
    offsets = (page * stride_er + kv_head * stride_eh)[:, None] + dims[None, :]
    exact = tl.load(row_ptr + offsets, mask=is_head[:, None] & (dims < HEAD_DIM)[None, :],
                    other=0.0)
    return tl.where(is_head[:, None], exact.to(rows.dtype), rows)


@triton.jit
def window_holds(keys, near, ring_pos_ptr, ring_base, step_start, WINDOW: tl.constexpr):
    """Whether an exact row of each key is at hand: written in this step (``>= step_start``),
    or still in the sequence's recent window (its row records that very position). Keys not
    ``near`` the queries are not looked up. ``ring_base`` < 0: the sequence has no window."""
    tag = tl.load(ring_pos_ptr + ring_base + keys % WINDOW, mask=near & (ring_base >= 0),
                  other=-1)
    return (keys >= step_start) | (tag == keys)


@triton.jit
def attend_exact_rows(q, m_i, l_i, acc, lo, hi, position, kv_head, dims,
                      fresh_k_ptr, fresh_v_ptr, ring_k_ptr, ring_v_ptr, ring_pos_ptr,
                      stride_er, stride_eh, ring_base, step_start, q_start,
                      BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, WINDOW: tl.constexpr,
                      DOT_PRECISION: tl.constexpr):
    """Continue the online softmax over the exact rows of positions [lo, hi): this step's own
    rows (``fresh_*``: [T, kv_heads, head_dim], position ``step_start + i`` at row
    ``q_start + i``) and earlier positions still in the recent window (``ring_*``: rows
    ``ring_base + position % WINDOW``). A row reads the positions in
    (``position - WINDOW``, ``position``] that `window_holds`."""
    col_valid = (dims < HEAD_DIM)[None, :]
    for e0 in range(lo, hi, BLOCK_N):
        keys = e0 + tl.arange(0, BLOCK_N)
        valid = keys < hi
        fresh = keys >= step_start
        held = valid & window_holds(keys, valid & ~fresh, ring_pos_ptr, ring_base, step_start,
                                     WINDOW)
        fresh_off = ((q_start + keys - step_start).to(tl.int64) * stride_er
                     + kv_head * stride_eh)[:, None] + dims[None, :]
        ring_off = ((ring_base + keys % WINDOW).to(tl.int64) * stride_er
                    + kv_head * stride_eh)[:, None] + dims[None, :]
        from_fresh = (valid & fresh)[:, None] & col_valid
        from_ring = (held & ~fresh)[:, None] & col_valid
        k = tl.where(from_fresh, tl.load(fresh_k_ptr + fresh_off, mask=from_fresh, other=0.0),
                     tl.load(ring_k_ptr + ring_off, mask=from_ring, other=0.0))
        scores = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=DOT_PRECISION)
        visible = (held[None, :] & (keys[None, :] <= position[:, None])
                   & (keys[None, :] > position[:, None] - WINDOW))
        scores = tl.where(visible, scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        p = tl.exp2(scores - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.where(from_fresh, tl.load(fresh_v_ptr + fresh_off, mask=from_fresh, other=0.0),
                     tl.load(ring_v_ptr + ring_off, mask=from_ring, other=0.0))
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype),
                                            input_precision=DOT_PRECISION)
        m_i = m_new
    return m_i, l_i, acc


@triton.jit
def attend_page_heads(q, m_i, l_i, acc, table_row, num_pages, position, kv_head, dims,
                      head_k_ptr, head_v_ptr, stride_er, stride_eh, ring_pos_ptr, ring_base,
                      step_start, near_lo, PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
                      HEAD_DIM: tl.constexpr, WINDOW: tl.constexpr,
                      DOT_PRECISION: tl.constexpr):
    """Continue the online softmax over the exact head rows (slot 0) of the first
    ``num_pages`` pages of the page-table row ``table_row``, for rows at ``position``
    [BLOCK_M]. WINDOW > 0: heads the window covers (as in `attend_exact_rows`, from
    ``near_lo`` on) are left to the window's rows."""
    col_valid = (dims < HEAD_DIM)[None, :]
    for p0 in range(0, num_pages, BLOCK_N):
        index = p0 + tl.arange(0, BLOCK_N)
        valid = index < num_pages
        page = tl.load(table_row + index, mask=valid, other=0).to(tl.int64)
        keys = index * PAGE_SIZE
        offsets = (page * stride_er + kv_head * stride_eh)[:, None] + dims[None, :]
        k = tl.load(head_k_ptr + offsets, mask=valid[:, None] & col_valid, other=0.0)
        scores = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=DOT_PRECISION)
        visible = valid[None, :] & (keys[None, :] <= position[:, None])
        if WINDOW > 0:
            near = valid & (keys >= near_lo)
            held = near & window_holds(keys, near, ring_pos_ptr, ring_base, step_start, WINDOW)
            visible = visible & ~((keys[None, :] > position[:, None] - WINDOW) & held[None, :])
        scores = tl.where(visible, scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        p = tl.exp2(scores - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(head_v_ptr + offsets, mask=valid[:, None] & col_valid, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype),
                                            input_precision=DOT_PRECISION)
        m_i = m_new
    return m_i, l_i, acc
