"""The key loop of the paged decode kernel: page rows (float or quantized), one key tile's
online-softmax step, and the loop over a key range in two forms.

`attend_key_range` loads each tile's page ids from the page table inside its loop: the tile's
row addresses depend on a load of the same loop. Triton's software pipeliner (3.6, sm_90) then
waits for every copy in flight at the top of each step (``async_wait {num = 0}`` in the
TTGIR; `benchmarks/triton_resources.py --dump`), so each step pays most of a memory round
trip: a batch-1 decode at 16k context read its 67 MB at 2.2 TB/s on an H200.
`attend_key_windows` loads the page ids of ``PAGE_WINDOW`` pages as one vector before the loop
over that window's tiles and picks each tile's page id out of it with a masked sum (no load),
so tile addresses depend on loop values alone and the pipeliner keeps tiles in flight, as the
cascade's passes do (`prefix_tiles_kernel` with a WINDOW,
`triton_cascade_fused.own_keys_windowed`). It
needs every tile inside one page: BLOCK_N divides PAGE_SIZE and the range starts at a multiple
of BLOCK_N (`attend_keys` takes either form; `triton_decode_options.DecodeOptions`).
"""

from __future__ import annotations

import triton
import triton.language as tl

from dyngen_core.kv.attention.triton.exact_kernels import exact_row_of_page, window_holds
from dyngen_core.kv.attention.triton.page_window import tile_page, window_ids, window_keys


@triton.jit
def attend_tile(q, m_i, l_i, acc, keys, key_valid, page, position, kv_head, dims,
                k_ptr, v_ptr, stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh,
                ks_ptr, vs_ptr, stride_ksp, stride_kss, stride_ksh, stride_vsp, stride_vss,
                stride_vsh, head_k_ptr, head_v_ptr, stride_er, stride_eh,
                ring_pos_ptr, ring_base, step_start, near_lo,
                BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr,
                PAGE_SIZE: tl.constexpr, K_BITS: tl.constexpr, V_BITS: tl.constexpr,
                HEADS: tl.constexpr, WINDOW: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """One step of the online softmax of `attend_key_range`: the keys ``keys`` [BLOCK_N]
    (``key_valid``: inside the range) at pages ``page`` [BLOCK_N] (int64, the page id of
    each key); arguments and result as `attend_key_range`'s."""
    slot = (keys % PAGE_SIZE).to(tl.int64)
    kmask = key_valid[:, None]
    k_off = (page * stride_kp + slot * stride_ks + kv_head * stride_kh)[:, None]
    ks_off = (page * stride_ksp + slot * stride_kss + kv_head * stride_ksh)[:, None]
    k = _load_rows(k_ptr, ks_ptr, k_off, ks_off, kmask, dims, K_BITS, HEAD_DIM, HEAD_PAD,
                   BLOCK_N)
    is_head = (slot == 0) & key_valid
    if HEADS:
        k = exact_row_of_page(k, head_k_ptr, page, kv_head, is_head, dims, stride_er,
                              stride_eh, HEAD_DIM)
    scores = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=DOT_PRECISION)
    visible = (keys[None, :] <= position[:, None]) & key_valid[None, :]
    if WINDOW > 0:
        near = key_valid & (keys >= near_lo)
        held = near & window_holds(keys, near, ring_pos_ptr, ring_base, step_start, WINDOW)
        covered = (keys[None, :] > position[:, None] - WINDOW) & held[None, :]
        visible = visible & ~covered
    scores = tl.where(visible, scores, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(scores, 1))
    p = tl.exp2(scores - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    v_off = (page * stride_vp + slot * stride_vs + kv_head * stride_vh)[:, None]
    vs_off = (page * stride_vsp + slot * stride_vss + kv_head * stride_vsh)[:, None]
    v = _load_rows(v_ptr, vs_ptr, v_off, vs_off, kmask, dims, V_BITS, HEAD_DIM, HEAD_PAD,
                   BLOCK_N)
    if HEADS:
        v = exact_row_of_page(v, head_v_ptr, page, kv_head, is_head, dims, stride_er,
                              stride_eh, HEAD_DIM)
    acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype),
                                        input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def attend_key_range(q, m_i, l_i, acc, table_row, kv_lo, kv_hi, position, kv_head, dims,
                     k_ptr, v_ptr, stride_kp, stride_ks, stride_kh, stride_vp, stride_vs,
                     stride_vh, ks_ptr, vs_ptr, stride_ksp, stride_kss, stride_ksh, stride_vsp,
                     stride_vss, stride_vsh,
                     head_k_ptr, head_v_ptr, stride_er, stride_eh,
                     ring_pos_ptr, ring_base, step_start, near_lo,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
                     HEAD_PAD: tl.constexpr, PAGE_SIZE: tl.constexpr, K_BITS: tl.constexpr,
                     V_BITS: tl.constexpr, HEADS: tl.constexpr, WINDOW: tl.constexpr,
                     DOT_PRECISION: tl.constexpr):
    """Online softmax of the rows ``q`` (from `load_scaled_queries`) over keys [kv_lo, kv_hi)
    of the page-table row ``table_row``, each row seeing keys up to its ``position``, carrying
    on from the state (m_i, l_i, acc) (`initial_state` for a fresh start). Each tile loads
    its keys' page ids itself (any range, any tile and page size).

    HEADS: slot 0 of every page is read from the unquantized head rows (``head_k_ptr``,
    ``head_v_ptr``: [pages + 1, kv_heads, head_dim], strides ``stride_er``, ``stride_eh``).
    WINDOW > 0: keys a row reads exactly (``position - WINDOW < key``, held per
    `window_holds`; keys below ``near_lo`` never are) are masked out here and left to
    `attend_exact_rows`. Only element-wise work and masked loads in the loop (a branch costs
    its software pipelining); callers run WINDOW > 0 over the last blocks only, as the
    window's per-block work and registers slowed the whole q4 loop by half on the H200.

    Returns (running max m, running sum l, unnormalized output acc [BLOCK_M, HEAD_PAD]), all
    float32, log2 domain; rows that saw no key keep l = 0."""
    for n0 in range(kv_lo, kv_hi, BLOCK_N):
        keys = n0 + tl.arange(0, BLOCK_N)
        key_valid = keys < kv_hi
        page = tl.load(table_row + keys // PAGE_SIZE, mask=key_valid, other=0).to(tl.int64)
        m_i, l_i, acc = attend_tile(
            q, m_i, l_i, acc, keys, key_valid, page, position, kv_head, dims,
            k_ptr, v_ptr, stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh,
            ks_ptr, vs_ptr, stride_ksp, stride_kss, stride_ksh, stride_vsp, stride_vss,
            stride_vsh, head_k_ptr, head_v_ptr, stride_er, stride_eh, ring_pos_ptr, ring_base,
            step_start, near_lo, BLOCK_N, HEAD_DIM, HEAD_PAD, PAGE_SIZE, K_BITS, V_BITS, HEADS,
            WINDOW, DOT_PRECISION)
    return m_i, l_i, acc


@triton.jit
def attend_key_windows(q, m_i, l_i, acc, table_row, kv_lo, kv_hi, position, kv_head, dims,
                       k_ptr, v_ptr, stride_kp, stride_ks, stride_kh, stride_vp, stride_vs,
                       stride_vh, ks_ptr, vs_ptr, stride_ksp, stride_kss, stride_ksh,
                       stride_vsp, stride_vss, stride_vsh,
                       head_k_ptr, head_v_ptr, stride_er, stride_eh,
                       ring_pos_ptr, ring_base, step_start, near_lo,
                       BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr,
                       PAGE_SIZE: tl.constexpr, K_BITS: tl.constexpr, V_BITS: tl.constexpr,
                       HEADS: tl.constexpr, WINDOW: tl.constexpr, DOT_PRECISION: tl.constexpr,
                       PAGE_WINDOW: tl.constexpr):
    """`attend_key_range` with the page ids of ``PAGE_WINDOW`` pages (a power of two) loaded
    as one vector ahead of each window's tiles, so the tile loads pipeline. ``kv_lo`` is a
    multiple of BLOCK_N and BLOCK_N divides PAGE_SIZE: every tile lies in one page."""
    for first_page in range(kv_lo // PAGE_SIZE, tl.cdiv(kv_hi, PAGE_SIZE), PAGE_WINDOW):
        ids = window_ids(table_row, first_page, kv_hi, PAGE_SIZE, PAGE_WINDOW)
        lo, hi = window_keys(first_page, kv_lo, kv_hi, PAGE_SIZE, PAGE_WINDOW)
        for n0 in range(lo, hi, BLOCK_N):
            keys = n0 + tl.arange(0, BLOCK_N)
            page = tl.zeros([BLOCK_N], tl.int64) + tile_page(ids, first_page, n0, PAGE_SIZE,
                                                             PAGE_WINDOW)
            m_i, l_i, acc = attend_tile(
                q, m_i, l_i, acc, keys, keys < hi, page, position, kv_head, dims,
                k_ptr, v_ptr, stride_kp, stride_ks, stride_kh, stride_vp, stride_vs,
                stride_vh, ks_ptr, vs_ptr, stride_ksp, stride_kss, stride_ksh, stride_vsp,
                stride_vss, stride_vsh, head_k_ptr, head_v_ptr, stride_er, stride_eh,
                ring_pos_ptr, ring_base, step_start, near_lo, BLOCK_N, HEAD_DIM, HEAD_PAD,
                PAGE_SIZE, K_BITS, V_BITS, HEADS, WINDOW, DOT_PRECISION)
    return m_i, l_i, acc


@triton.jit
def attend_keys(q, m_i, l_i, acc, table_row, kv_lo, kv_hi, position, kv_head, dims,
                k_ptr, v_ptr, stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh,
                ks_ptr, vs_ptr, stride_ksp, stride_kss, stride_ksh, stride_vsp, stride_vss,
                stride_vsh, head_k_ptr, head_v_ptr, stride_er, stride_eh,
                ring_pos_ptr, ring_base, step_start, near_lo,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
                HEAD_PAD: tl.constexpr, PAGE_SIZE: tl.constexpr, K_BITS: tl.constexpr,
                V_BITS: tl.constexpr, HEADS: tl.constexpr, WINDOW: tl.constexpr,
                DOT_PRECISION: tl.constexpr, PAGE_WINDOW: tl.constexpr):
    """`attend_key_windows` when PAGE_WINDOW > 0 (its alignment required), else
    `attend_key_range`; arguments and result as theirs."""
    if PAGE_WINDOW > 0:
        m_i, l_i, acc = attend_key_windows(
            q, m_i, l_i, acc, table_row, kv_lo, kv_hi, position, kv_head, dims,
            k_ptr, v_ptr, stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh,
            ks_ptr, vs_ptr, stride_ksp, stride_kss, stride_ksh, stride_vsp, stride_vss,
            stride_vsh, head_k_ptr, head_v_ptr, stride_er, stride_eh, ring_pos_ptr, ring_base,
            step_start, near_lo, BLOCK_N, HEAD_DIM, HEAD_PAD, PAGE_SIZE, K_BITS, V_BITS, HEADS,
            WINDOW, DOT_PRECISION, PAGE_WINDOW)
    else:
        m_i, l_i, acc = attend_key_range(
            q, m_i, l_i, acc, table_row, kv_lo, kv_hi, position, kv_head, dims,
            k_ptr, v_ptr, stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh,
            ks_ptr, vs_ptr, stride_ksp, stride_kss, stride_ksh, stride_vsp, stride_vss,
            stride_vsh, head_k_ptr, head_v_ptr, stride_er, stride_eh, ring_pos_ptr, ring_base,
            step_start, near_lo, BLOCK_M, BLOCK_N, HEAD_DIM, HEAD_PAD, PAGE_SIZE, K_BITS,
            V_BITS, HEADS, WINDOW, DOT_PRECISION)
    return m_i, l_i, acc


@triton.jit
def _load_rows(base_ptr, scale_ptr, row_off, scale_off, mask, dims,
               BITS: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr,
               BLOCK_N: tl.constexpr):
    """Rows [BLOCK_N, HEAD_PAD] of a page tensor: as stored for float pages, dequantized to
    float32 otherwise; columns past HEAD_DIM read as 0. row_off / scale_off [BLOCK_N, 1]:
    element offsets of each row in the page tensor (int32 words for 4- and 8-bit codes, bytes
    for 6-bit) / in the scales tensor."""
    if BITS == 0:
        col_mask = mask & (dims < HEAD_DIM)[None, :]
        rows = tl.load(base_ptr + row_off + dims[None, :], mask=col_mask, other=0.0)
    else:
        if BITS == 6:
            code = _load_codes6(base_ptr, row_off, mask & (dims < HEAD_DIM)[None, :], dims,
                                HEAD_DIM)
        else:
            code = _load_word_codes(base_ptr, row_off, mask, BITS, HEAD_DIM, HEAD_PAD, BLOCK_N)
        groups = tl.arange(0, HEAD_PAD // 32)
        scale = tl.load(scale_ptr + scale_off + groups[None, :],
                        mask=mask & (groups < HEAD_DIM // 32)[None, :], other=0.0)
        scale = tl.reshape(tl.broadcast_to(scale.to(tl.float32)[:, :, None],
                                           (BLOCK_N, HEAD_PAD // 32, 32)), (BLOCK_N, HEAD_PAD))
        rows = code.to(tl.float32) * scale
    return rows


@triton.jit
def _load_word_codes(word_ptr, row_off, mask, BITS: tl.constexpr, HEAD_DIM: tl.constexpr,
                     HEAD_PAD: tl.constexpr, BLOCK_N: tl.constexpr):
    """Signed 4- or 8-bit codes [BLOCK_N, HEAD_PAD] read as whole int32 words (wide loads),
    unpacked in registers: value d sits at bit ``(d % per_word) * BITS`` of word d // per_word."""
    PER_WORD: tl.constexpr = 32 // BITS
    words_idx = tl.arange(0, HEAD_PAD // PER_WORD)
    word_mask = mask & (words_idx < HEAD_DIM // PER_WORD)[None, :]
    words = tl.load(word_ptr + row_off + words_idx[None, :], mask=word_mask, other=0)
    shifts = tl.arange(0, PER_WORD) * BITS
    unsigned = (words[:, :, None] >> shifts[None, None, :]) & ((1 << BITS) - 1)
    unsigned = tl.reshape(unsigned, (BLOCK_N, HEAD_PAD))
    if BITS == 8:
        code = tl.where(unsigned >= 128, unsigned - 256, unsigned)
    else:
        code = unsigned - 8
    return code


@triton.jit
def _load_codes6(byte_ptr, row_off, mask, dims, HEAD_DIM: tl.constexpr):
    """Signed 6-bit codes: value d starts at bit 6d of its row, maybe straddling two bytes; the
    second byte is needed only for shifts 4 and 6, never in a row's last byte."""
    bit = dims * 6
    byte = (bit // 8)[None, :]
    shift = (bit % 8)[None, :]
    lo = tl.load(byte_ptr + row_off + byte, mask=mask, other=0).to(tl.int32)
    needs_hi = (byte + 1) < (HEAD_DIM * 6 // 8)
    hi = tl.load(byte_ptr + row_off + byte + 1, mask=mask & needs_hi, other=0).to(tl.int32)
    return (((lo | (hi << 8)) >> shift) & 63) - 32
