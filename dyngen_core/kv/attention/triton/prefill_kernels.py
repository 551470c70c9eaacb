"""The tiled causal prefill kernel over unquantized (fp16/bf16/fp32) pages.

One program attends a tile of ``HEADS_PER_TILE`` query heads of one KV group x ``BLOCK_Q``
consecutive query tokens of one sequence (rows head-major: row r is head r // BLOCK_Q, token
r % BLOCK_Q), so the heads of a group share every key and value tile they load and a short
chunk (a 30-token question) still fills the tile. Keys are read in place through the page
table, one page lookup per key block (``BLOCK_N`` divides the page size). The keys every row
of the tile sees run in a loop without any masking; only the last block or two, on the
causal diagonal, are masked; keys past the tile's last position are never visited.
Softmax in the log2 domain: the scale times log2(e) is applied to the fp32 scores (one FMA
with the max subtraction), and P is cast to the pages' dtype for the PV product.

The host side (tiles, block tables, launch) is `triton_prefill`.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _key_block(k_ptr, v_ptr, table_row, n0, kv_head, offs_n, dims, kv_end,
               stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh,
               MASKED: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr,
               PAGE_SIZE: tl.constexpr):
    """Key and value rows [BLOCK_N, HEAD_PAD] of keys n0.. (one page). MASKED: keys from
    ``kv_end`` on read as 0 (the tile's last blocks); padded head columns always do."""
    page = tl.load(table_row + n0 // PAGE_SIZE).to(tl.int64)
    slot = n0 % PAGE_SIZE + offs_n
    k_rows = (page * stride_kp + kv_head * stride_kh + slot * stride_ks)[:, None] + dims[None, :]
    v_rows = (page * stride_vp + kv_head * stride_vh + slot * stride_vs)[:, None] + dims[None, :]
    if MASKED:
        mask = (n0 + offs_n < kv_end)[:, None] & (dims < HEAD_DIM)[None, :]
        k = tl.load(k_ptr + k_rows, mask=mask, other=0.0)
        v = tl.load(v_ptr + v_rows, mask=mask, other=0.0)
    elif HEAD_PAD != HEAD_DIM:
        mask = (dims < HEAD_DIM)[None, :]
        k = tl.load(k_ptr + k_rows, mask=mask, other=0.0)
        v = tl.load(v_ptr + v_rows, mask=mask, other=0.0)
    else:
        k = tl.load(k_ptr + k_rows)
        v = tl.load(v_ptr + v_rows)
    return k, v


@triton.jit
def _attend_keys(q, m_i, l_i, acc, table_row, kv_lo, kv_hi, kv_end, position, kv_head,
                 k_ptr, v_ptr, stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh,
                 qk_scale, MASKED: tl.constexpr, BLOCK_N: tl.constexpr,
                 HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr, PAGE_SIZE: tl.constexpr,
                 DOT_PRECISION: tl.constexpr):
    """Online softmax of the tile's rows over key blocks [kv_lo, kv_hi) (block-aligned
    starts). MASKED: each row sees keys up to its ``position`` (the causal diagonal); else
    every row sees every key (no mask work at all). Returns the new (m, l, acc)."""
    offs_n = tl.arange(0, BLOCK_N)
    dims = tl.arange(0, HEAD_PAD)
    for n0 in range(kv_lo, kv_hi, BLOCK_N):
        k, v = _key_block(k_ptr, v_ptr, table_row, n0, kv_head, offs_n, dims, kv_end,
                          stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh,
                          MASKED, HEAD_DIM, HEAD_PAD, PAGE_SIZE)
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
        if MASKED:
            visible = (n0 + offs_n)[None, :] <= position[:, None]
            qk = tl.where(visible, qk * qk_scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(qk, 1))
            qk = qk - m_new[:, None]
        else:
            m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
            qk = qk * qk_scale - m_new[:, None]
        p = tl.exp2(qk)
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION)
        m_i = m_new
    return m_i, l_i, acc


# The page table's width changes with the longest sequence of each batch: not specialized,
# or each new width would compile the kernel again inside a step.
@triton.jit(do_not_specialize=["stride_pt"])
def tiled_prefill_kernel(
    q_ptr, stride_qt, stride_qh,
    k_ptr, v_ptr, stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh,
    page_table_ptr, stride_pt, context_lens_ptr, query_start_ptr,
    block_seq_ptr, block_first_ptr,
    out_ptr, stride_ot, stride_oh,
    qk_scale, head_programs,
    G: tl.constexpr, SUBGROUPS: tl.constexpr, HEADS_PER_TILE: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
    HEAD_PAD: tl.constexpr, PAGE_SIZE: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """1-D grid of (query blocks x ``head_programs``) programs, ``head_programs`` = kv_heads x
    SUBGROUPS: program i is query block i // head_programs (sequence ``block_seq``, first
    query token ``block_first``; the host orders blocks heaviest first, so the long tiles
    start in the first wave) for KV head (i % head_programs) // SUBGROUPS and its group's
    heads from ((i % head_programs) % SUBGROUPS) x HEADS_PER_TILE on.

    q [T, H, D] and out (strides ``stride_qt``/``stride_qh``, last dim contiguous); pages
    [pages, PAGE_SIZE, kv_heads, D]; page_table [B, width] (row stride ``stride_pt``);
    context_lens [B] (keys once this step is written, the chunk's own included);
    query_start [B + 1]. qk_scale: softmax scale x log2(e). Query token t of a sequence
    with q_len queries and ctx keys sits at position ctx - q_len + t and sees keys 0..that.
    G: query heads per KV head. DOT_PRECISION: "ieee" for float32 (exact), else "tf32"."""
    BLOCK_M: tl.constexpr = BLOCK_Q * HEADS_PER_TILE
    pid = tl.program_id(0)
    block = pid // head_programs
    kv_head = (pid % head_programs) // SUBGROUPS
    subgroup = (pid % head_programs) % SUBGROUPS
    seq = tl.load(block_seq_ptr + block)
    first = tl.load(block_first_ptr + block)
    q_start = tl.load(query_start_ptr + seq)
    q_len = tl.load(query_start_ptr + seq + 1) - q_start
    step_start = tl.load(context_lens_ptr + seq) - q_len

    rows = tl.arange(0, BLOCK_M)
    token = first + rows % BLOCK_Q
    head_in_group = subgroup * HEADS_PER_TILE + rows // BLOCK_Q
    row_valid = (token < q_len) & (head_in_group < G)
    head = kv_head * G + head_in_group
    position = step_start + token
    dims = tl.arange(0, HEAD_PAD)
    io_mask = row_valid[:, None] & (dims < HEAD_DIM)[None, :]
    q_rows = (q_start + token).to(tl.int64) * stride_qt + head * stride_qh
    q = tl.load(q_ptr + q_rows[:, None] + dims[None, :], mask=io_mask, other=0.0)

    # Keys below the tile's first position are seen by every row; its diagonal ends at its
    # last token's position.
    kv_end = step_start + tl.minimum(first + BLOCK_Q, q_len)
    full_hi = (step_start + first + 1) // BLOCK_N * BLOCK_N
    table_row = page_table_ptr + seq.to(tl.int64) * stride_pt
    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_PAD], tl.float32)
    m_i, l_i, acc = _attend_keys(
        q, m_i, l_i, acc, table_row, 0, full_hi, kv_end, position, kv_head,
        k_ptr, v_ptr, stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh,
        qk_scale, False, BLOCK_N, HEAD_DIM, HEAD_PAD, PAGE_SIZE, DOT_PRECISION)
    m_i, l_i, acc = _attend_keys(
        q, m_i, l_i, acc, table_row, full_hi, kv_end, kv_end, position, kv_head,
        k_ptr, v_ptr, stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh,
        qk_scale, True, BLOCK_N, HEAD_DIM, HEAD_PAD, PAGE_SIZE, DOT_PRECISION)
    acc = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    out_rows = (q_start + token).to(tl.int64) * stride_ot + head * stride_oh
    tl.store(out_ptr + out_rows[:, None] + dims[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=io_mask)
