"""The online softmax over paged keys: the Triton building blocks every attention kernel of this
backend shares (the paged decode kernel, the q8/q4 decode kernel, the cascade kernels).

- Query prologue and epilogue (`load_scaled_queries`, `initial_state`, `normalized_rows`,
  `log2_sum_exp`): scores live in the log2 domain (the softmax scale times log2(e) is applied
  to the queries), rows that saw no key keep a zero sum.
- The rotation of quantized pages (`rotated_queries`, `rotated_back`): the pages hold keys and
  values rotated by ``R = H diag(s) / sqrt(32)`` on each group of 32 dims (`quant.format`), so a
  kernel rotates the query once (``q . k = (q R^T) . k'``) and its output once
  (``sum p v = (sum p v') R``) instead of every cached row. Every entry of ``R`` is
  ``+-1/sqrt(32)``: a 16-bit query tile times the sign matrix is a tensor-core dot with exact
  operands and float32 sums, scaled after; float32 queries and the float32 output keep the exact
  float32 product.
- Key tiles (`attend_tile`): one online-softmax step over keys of float or quantized pages read
  in place (4- and 8-bit codes as int32 words unpacked in registers, 6-bit codes as bytes),
  slot 0 of every page read from the exact head rows, keys the recent window covers masked out.
- Key loops over a range: `attend_key_range` loads each tile's page ids inside the loop (any
  range, any tile and page size); `attend_key_windows` loads the ids of ``PAGE_WINDOW`` pages as
  one vector before the loop over their tiles and picks each tile's id with a masked sum
  (`window_ids`, `window_keys`, `tile_page`), so no load of the tile loop feeds an address and
  Triton's pipeliner keeps tile copies in flight instead of waiting for each (sm_90 TTGIR:
  ``async_wait {num = 0}`` otherwise). It needs every tile inside one page: BLOCK_N divides
  PAGE_SIZE and the range starts at a multiple of BLOCK_N. `attend_keys` takes either form.
- Exact rows of quantized caches (`exact_row_of_page`, `window_holds`, `attend_exact_rows`,
  `attend_page_heads`), read by the rule of `attention.sdpa`'s window reader.

Quantized pages: codes [num_pages, page_size, num_kv_heads, packed] (value ``d`` starts at bit
``d * bits`` of its row, little-endian) and float16 scales [num_pages, page_size, num_kv_heads,
head_dim / 32], in the rotated space.
"""

from __future__ import annotations

from dyngen_core.kv.quant.format import GROUP_SIZE
from dyngen_core.ops.triton_support import tl, triton

_INV_SQRT_GROUP: tl.constexpr = tl.constexpr(GROUP_SIZE ** -0.5)


@triton.jit
def load_scaled_queries(q_ptr, q_offsets, row_valid, dims, rot_ptr, scale_log2,
                        K_BITS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
                        HEAD_PAD: tl.constexpr):
    """Query rows [BLOCK_M, HEAD_PAD] starting at element offsets ``q_offsets`` [BLOCK_M], times
    the softmax scale in the log2 domain, rotated into the pages' space when keys are quantized,
    in the queries' dtype (what the dots take). Invalid rows and padded columns read as 0."""
    q = tl.load(q_ptr + q_offsets[:, None] + dims[None, :],
                mask=row_valid[:, None] & (dims < HEAD_DIM)[None, :], other=0.0)
    if K_BITS > 0:
        q = rotated_queries(q, rot_ptr, scale_log2, BLOCK_M, HEAD_PAD)
    else:
        q = q.to(tl.float32) * scale_log2
    return q.to(q_ptr.dtype.element_ty)


@triton.jit
def initial_state(BLOCK_M: tl.constexpr, HEAD_PAD: tl.constexpr):
    """The online softmax's starting (running max, running sum, output accumulator)."""
    return (tl.full([BLOCK_M], -1.0e30, tl.float32), tl.zeros([BLOCK_M], tl.float32),
            tl.zeros([BLOCK_M, HEAD_PAD], tl.float32))


@triton.jit
def normalized_rows(acc, l_i, rot_ptr, V_BITS: tl.constexpr, BLOCK_M: tl.constexpr,
                    HEAD_PAD: tl.constexpr):
    """``acc / l`` (rows that saw no key stay 0), rotated back when values are quantized."""
    acc = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    if V_BITS > 0:
        acc = rotated_back(acc, rot_ptr, BLOCK_M, HEAD_PAD)
    return acc


@triton.jit
def log2_sum_exp(m_i, l_i):
    """Per row, log2 of the softmax denominator (scores already in the log2 domain); -inf for
    rows that saw no key, so merging gives them weight 0."""
    return tl.where(l_i > 0, m_i + tl.log2(tl.where(l_i > 0, l_i, 1.0)), float("-inf"))


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
    its software pipelining); callers run WINDOW > 0 over the last blocks only, since the
    window's per-block work and registers cost the whole loop.

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


@triton.jit
def window_ids(table_row, first_page, hi, PAGE_SIZE: tl.constexpr, WINDOW: tl.constexpr):
    """The page ids (int64 [WINDOW]) of pages ``first_page + i`` of the page-table row at
    ``table_row``; 0 past the last page that keys below ``hi`` use."""
    window = tl.arange(0, WINDOW)
    last_page = tl.cdiv(hi, PAGE_SIZE)
    return tl.load(table_row + first_page + window, mask=first_page + window < last_page,
                   other=0).to(tl.int64)


@triton.jit
def window_keys(first_page, lo, hi, PAGE_SIZE: tl.constexpr, WINDOW: tl.constexpr):
    """The keys of [lo, hi) that the window's pages hold: (start, end)."""
    return (tl.maximum(lo, first_page * PAGE_SIZE),
            tl.minimum(hi, (first_page + WINDOW) * PAGE_SIZE))


@triton.jit
def tile_page(ids, first_page, n0, PAGE_SIZE: tl.constexpr, WINDOW: tl.constexpr):
    """The page id of the tile starting at key ``n0``, picked out of the window's ``ids``
    (arithmetic on loop values: no load)."""
    window = tl.arange(0, WINDOW)
    return tl.sum(tl.where(window == n0 // PAGE_SIZE - first_page, ids, 0), 0)


@triton.jit
def rotate_rows(x, rot, BLOCK_M: tl.constexpr, HEAD_PAD: tl.constexpr):
    """x [BLOCK_M, HEAD_PAD] times ``rot`` [32, 32] (x's dtype) in each group of 32 columns, in
    float32: the exact float32 product for float32 x, a tensor-core dot for 16-bit x (exact
    for the +-1 sign matrix: exact products summed in float32)."""
    groups = tl.reshape(x, (BLOCK_M * (HEAD_PAD // 32), 32))
    if x.dtype == tl.float32:
        out = tl.dot(groups, rot, input_precision="ieee")
    else:
        out = tl.dot(groups, rot)
    return tl.reshape(out, (BLOCK_M, HEAD_PAD))


@triton.jit
def rotated_queries(q, rot_ptr, scale, BLOCK_M: tl.constexpr, HEAD_PAD: tl.constexpr):
    """Query rows q [BLOCK_M, HEAD_PAD] (as loaded) rotated into the pages' space (times
    ``R^T``, ``rot_ptr``: R row-major float32 [32, 32]) and times ``scale``, in float32.
    16-bit queries take the sign dot (module docstring), float32 ones the exact product."""
    r32 = tl.arange(0, 32)
    rot_t = tl.load(rot_ptr + r32[None, :] * 32 + r32[:, None])  # R^T
    if q.dtype == tl.float32:
        out = rotate_rows(q, rot_t, BLOCK_M, HEAD_PAD) * scale
    else:
        signs = tl.where(rot_t > 0, 1.0, -1.0).to(q.dtype)
        out = rotate_rows(q, signs, BLOCK_M, HEAD_PAD) * (scale * _INV_SQRT_GROUP)
    return out


@triton.jit
def rotated_back(acc, rot_ptr, BLOCK_M: tl.constexpr, HEAD_PAD: tl.constexpr):
    """Float32 output rows acc [BLOCK_M, HEAD_PAD] rotated back out of the pages' space (times
    ``R``), as the exact float32 product (module docstring)."""
    r32 = tl.arange(0, 32)
    rot = tl.load(rot_ptr + r32[:, None] * 32 + r32[None, :])
    return rotate_rows(acc, rot, BLOCK_M, HEAD_PAD)


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
