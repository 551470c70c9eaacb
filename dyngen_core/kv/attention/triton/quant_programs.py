"""The programs of `triton_quant_kernels.quant_decode_kernel`: the page programs that share each
sequence's keys before its recent window, and the tail parts that attend the rest.

A page row of ``HEAD_DIM`` codes is ``WORDS`` int32 words of ``PER_WORD`` codes each (8 for 4
bits, 4 for 8 bits; `storage.qformat`); a block of keys is read as ``PER_WORD`` field tiles of
the same loaded words (`triton_quant_unpack`) and attended by `attend_word_blocks`. The
kernel's module docstring describes the unpacking and its options.

Tail (the rule of `attention.sdpa_recent`): the page programs mask slot 0 of every page and stop
at ``bulk_hi``, the recent window's first block. What is left is (a) the last one or two blocks
[bulk_hi, ctx) under the window rule, (b) every page's exact head row, (c) the window's exact
rows and the step's fresh rows. `tail_program` attends them in ``TAIL_PARTS`` programs: 1 runs
(a), (b), (c) one after the other (each waits on its own loads: a few memory round trips
each), 2 runs (a) and (b)+(c) side by side, 3 or more run (b) and (c) in one program each and
share (a)'s blocks among the other ``TAIL_PARTS - 2``. Every part starts from an empty
softmax state and writes its own partial (log2-sum-exp -inf when it saw no key), merged with the
page programs' like one more split. The parts read a window of up to 16 positions in 16-row
tiles (the single tail keeps 64-key tiles, as before parts): Triton stages the exact-row loop's
four tiles (fresh and window keys and values) in shared memory, which took the one-launch q4
kernel to 88 KB; with parts it needs 41 KB (64 x 4, sm_90), and with 168 registers a thread
three programs share a multiprocessor.
"""

from __future__ import annotations

import triton
import triton.language as tl

from dyngen_core.kv.attention.triton.exact_kernels import (
    attend_exact_rows,
    attend_page_heads,
    window_holds,
)
from dyngen_core.kv.attention.triton.page_window import tile_page, window_ids, window_keys
from dyngen_core.kv.attention.triton.quant_unpack import (
    dequantized_fields,
    dequantized_rows,
    join_columns,
    load_scales,
    load_tile,
    swapped_quarters,
    unpaired_columns,
)


@triton.jit
def attend_word_blocks(qs, m_i, l_i, accs, table_row, lo, hi, kv_head,
                       k_ptr, v_ptr, stride_kp, stride_ks, stride_kh, stride_vp, stride_vs,
                       stride_vh, ks_ptr, vs_ptr, stride_ksp, stride_kss, stride_ksh,
                       stride_vsp, stride_vss, stride_vsh,
                       ring_pos_ptr, ring_base, step_start, near_lo, position,
                       BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr,
                       DIM_PAD: tl.constexpr, K_BITS: tl.constexpr, V_BITS: tl.constexpr,
                       WINDOW: tl.constexpr, DOT_PRECISION: tl.constexpr,
                       K_JOIN: tl.constexpr, V_JOIN: tl.constexpr,
                       FAST_UNPACK: tl.constexpr, SCALE_LOAD: tl.constexpr,
                       PAGE_WINDOW: tl.constexpr, LOOP_FLAGS: tl.constexpr = 0):
    """Online softmax of the query tiles ``qs`` over keys [lo, hi) (block-aligned ``lo``;
    BLOCK_N divides PAGE_SIZE, so a block lies in one page) of one decode query at
    ``position``, carrying (m_i, l_i, accs); one block is `_word_block`. PAGE_WINDOW 0: each
    block loads its page id at the top of its step (a load feeding the step's addresses, so
    Triton's pipeliner waits for every copy in flight each step: ``async_wait {num = 0}``).
    PAGE_WINDOW > 0 (a power of two): the ids of PAGE_WINDOW pages are loaded as one vector
    before the loop over those pages' blocks, and each block picks its id out of it with a
    masked sum, so no load of the loop feeds an address and the code words of later blocks
    stay in flight (as `triton_cascade_kernels.prefix_tiles_kernel` with a WINDOW)."""
    if PAGE_WINDOW > 0:
        for first_page in range(lo // PAGE_SIZE, tl.cdiv(hi, PAGE_SIZE), PAGE_WINDOW):
            ids = window_ids(table_row, first_page, hi, PAGE_SIZE, PAGE_WINDOW)
            start, end = window_keys(first_page, lo, hi, PAGE_SIZE, PAGE_WINDOW)
            for n0 in range(start, end, BLOCK_N):
                page = tile_page(ids, first_page, n0, PAGE_SIZE, PAGE_WINDOW)
                m_i, l_i, accs = _word_block(
                    qs, m_i, l_i, accs, page, n0, hi, kv_head, k_ptr, v_ptr, stride_kp,
                    stride_ks, stride_kh, stride_vp, stride_vs, stride_vh, ks_ptr, vs_ptr,
                    stride_ksp, stride_kss, stride_ksh, stride_vsp, stride_vss, stride_vsh,
                    ring_pos_ptr, ring_base, step_start, near_lo, position,
                    BLOCK_N, PAGE_SIZE, HEAD_DIM, DIM_PAD, K_BITS, V_BITS, WINDOW,
                    DOT_PRECISION, K_JOIN, V_JOIN, FAST_UNPACK, SCALE_LOAD, LOOP_FLAGS)
    else:
        for n0 in range(lo, hi, BLOCK_N):
            page = tl.load(table_row + n0 // PAGE_SIZE).to(tl.int64)
            m_i, l_i, accs = _word_block(
                qs, m_i, l_i, accs, page, n0, hi, kv_head, k_ptr, v_ptr, stride_kp,
                stride_ks, stride_kh, stride_vp, stride_vs, stride_vh, ks_ptr, vs_ptr,
                stride_ksp, stride_kss, stride_ksh, stride_vsp, stride_vss, stride_vsh,
                ring_pos_ptr, ring_base, step_start, near_lo, position,
                BLOCK_N, PAGE_SIZE, HEAD_DIM, DIM_PAD, K_BITS, V_BITS, WINDOW,
                DOT_PRECISION, K_JOIN, V_JOIN, FAST_UNPACK, SCALE_LOAD, LOOP_FLAGS)
    return m_i, l_i, accs


@triton.jit
def _word_block(qs, m_i, l_i, accs, page, n0, hi, kv_head,
                k_ptr, v_ptr, stride_kp, stride_ks, stride_kh, stride_vp, stride_vs,
                stride_vh, ks_ptr, vs_ptr, stride_ksp, stride_kss, stride_ksh,
                stride_vsp, stride_vss, stride_vsh,
                ring_pos_ptr, ring_base, step_start, near_lo, position,
                BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr,
                DIM_PAD: tl.constexpr, K_BITS: tl.constexpr, V_BITS: tl.constexpr,
                WINDOW: tl.constexpr, DOT_PRECISION: tl.constexpr,
                K_JOIN: tl.constexpr, V_JOIN: tl.constexpr,
                FAST_UNPACK: tl.constexpr, SCALE_LOAD: tl.constexpr,
                LOOP_FLAGS: tl.constexpr):
    """One block of `attend_word_blocks`: keys [n0, n0 + BLOCK_N) (those below ``hi``) in
    page ``page`` (int64). Slot 0 of every page is skipped (its exact head row is attended
    elsewhere). WINDOW > 0: keys the window covers (`window_holds`, keys from ``near_lo``
    on) are skipped too. K_JOIN: ``qs`` is the whole query tile (one element) and the keys
    enter one dot over whole rows (`dequantized_rows`), else one per field. V_JOIN:
    ``accs`` is one [BLOCK_M, DIM_PAD] tile and the values enter one dot over whole rows,
    else one tile and dot per field. FAST_UNPACK: codes unpacked two fields at a time in
    inline PTX where the dots run in float16 (`triton_quant_unpack`). SCALE_LOAD: how scales
    are loaded (`load_scales`'s MODE). LOOP_FLAGS bits: 1, ``l_i`` a [BLOCK_M, BLOCK_N] tile
    of running sums, reduced once after the loop; 2 (with V_JOIN), the joined value columns
    in the unpack's pair order (`triton_quant_unpack.paired_fields`); 8 (with V_JOIN), the
    joined value tile's column quarters 2 and 3 swapped (`swapped_quarters`); 4 is the
    tail's (`tail_program`). `_word_range` undoes them after the loop."""
    DT: tl.constexpr = qs[0].dtype
    LAZY: tl.constexpr = LOOP_FLAGS % 2 == 1
    PAIRED: tl.constexpr = (LOOP_FLAGS // 2) % 2 == 1
    SWAPPED: tl.constexpr = (LOOP_FLAGS // 8) % 2 == 1
    K_PER: tl.constexpr = 32 // K_BITS
    V_PER: tl.constexpr = 32 // V_BITS
    K_WPAD: tl.constexpr = DIM_PAD // K_PER
    V_WPAD: tl.constexpr = DIM_PAD // V_PER
    K_PADDED: tl.constexpr = HEAD_DIM // K_PER < K_WPAD
    V_PADDED: tl.constexpr = HEAD_DIM // V_PER < V_WPAD
    kw = tl.arange(0, K_WPAD)
    vw = tl.arange(0, V_WPAD)
    kw_ok = kw < HEAD_DIM // K_PER
    vw_ok = vw < HEAD_DIM // V_PER
    slots = n0 % PAGE_SIZE + tl.arange(0, BLOCK_N)
    keys = n0 + tl.arange(0, BLOCK_N)
    key_valid = keys < hi
    kwords = load_tile(k_ptr + kv_head * stride_kh + page * stride_kp, slots, stride_ks,
                       key_valid, kw, kw_ok, not K_JOIN, K_PADDED)
    kscale = load_scales(ks_ptr, kv_head * stride_ksh + page * stride_ksp, slots, stride_kss,
                         key_valid, kw // (32 // K_PER), kw_ok, not K_JOIN, K_PADDED,
                         SCALE_LOAD, 32 // K_PER, HEAD_DIM).to(DT)
    if K_JOIN:
        keys_t = tl.trans(dequantized_rows(kwords, kscale, BLOCK_N, K_WPAD, K_BITS, DT,
                                           FAST_UNPACK))
        scores = tl.dot(qs[0], keys_t, input_precision=DOT_PRECISION)
    else:
        kfields = dequantized_fields(kwords, kscale, K_BITS, DT, FAST_UNPACK)
        scores = tl.zeros([qs[0].shape[0], BLOCK_N], tl.float32)
        for i in tl.static_range(K_PER):
            scores = tl.dot(qs[i], kfields[i], scores, input_precision=DOT_PRECISION)
    visible = key_valid & (slots != 0)
    if WINDOW > 0:
        near = key_valid & (keys >= near_lo)
        held = near & window_holds(keys, near, ring_pos_ptr, ring_base, step_start, WINDOW)
        visible = visible & ~(held & (keys > position - WINDOW))
    scores = tl.where(visible[None, :], scores, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(scores, 1))
    p = tl.exp2(scores - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    if LAZY:  # no per-block sum across the warps that split the keys (shared memory + bar)
        l_i = l_i * alpha[:, None] + p
    else:
        l_i = l_i * alpha + tl.sum(p, 1)
    p = p.to(DT)
    vwords = load_tile(v_ptr + kv_head * stride_vh + page * stride_vp, slots, stride_vs,
                       key_valid, vw, vw_ok, False, V_PADDED)
    vscale = load_scales(vs_ptr, kv_head * stride_vsh + page * stride_vsp, slots, stride_vss,
                         key_valid, vw // (32 // V_PER), vw_ok, False, V_PADDED,
                         SCALE_LOAD, 32 // V_PER, HEAD_DIM).to(DT)
    if V_JOIN:
        vrows = dequantized_rows(vwords, vscale, BLOCK_N, V_WPAD, V_BITS, DT, FAST_UNPACK,
                                 PAIRED)
        if SWAPPED:
            vrows = swapped_quarters(vrows, BLOCK_N, DIM_PAD)
        accs = (tl.dot(p, vrows, accs[0] * alpha[:, None], input_precision=DOT_PRECISION),)
    else:
        vfields = dequantized_fields(vwords, vscale, V_BITS, DT, FAST_UNPACK)
        new_accs = ()
        for i in tl.static_range(V_PER):
            acc_i = tl.dot(p, vfields[i], accs[i] * alpha[:, None],
                           input_precision=DOT_PRECISION)
            new_accs = new_accs + (acc_i,)  # type: ignore[assignment]
        accs = new_accs
    return m_new, l_i, accs


@triton.jit
def _zero_accs(BLOCK_M: tl.constexpr, DIM_PAD: tl.constexpr, PER_WORD: tl.constexpr,
               V_JOIN: tl.constexpr):
    """The value accumulators `attend_word_blocks` starts from, all zero."""
    if V_JOIN:
        accs = (tl.zeros([BLOCK_M, DIM_PAD], tl.float32),)
    else:
        accs = ()  # type: ignore[assignment]
        for _ in tl.static_range(PER_WORD):
            accs = accs + (tl.zeros([BLOCK_M, DIM_PAD // PER_WORD], tl.float32),)  # type: ignore
    return accs


@triton.jit
def _joined_accs(accs, BLOCK_M: tl.constexpr, DIM_PAD: tl.constexpr, PER_WORD: tl.constexpr,
                 V_JOIN: tl.constexpr):
    """The accumulators of `attend_word_blocks` as one [BLOCK_M, DIM_PAD] tile in dim order."""
    if V_JOIN:
        acc = accs[0]
    else:
        acc = join_columns(accs, BLOCK_M, DIM_PAD // PER_WORD, PER_WORD)
    return acc


@triton.jit
def page_program(qs, table_row, split, bulk_hi, kv_head,
                 k_ptr, v_ptr, stride_kp, stride_ks, stride_kh, stride_vp, stride_vs,
                 stride_vh, ks_ptr, vs_ptr, stride_ksp, stride_kss, stride_ksh, stride_vsp,
                 stride_vss, stride_vsh,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr,
                 HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr, K_BITS: tl.constexpr,
                 V_BITS: tl.constexpr, NUM_SPLITS: tl.constexpr,
                 DOT_PRECISION: tl.constexpr, K_JOIN: tl.constexpr,
                 V_JOIN: tl.constexpr, FAST_UNPACK: tl.constexpr,
                 SCALE_LOAD: tl.constexpr, PAGE_WINDOW: tl.constexpr,
                 LOOP_FLAGS: tl.constexpr = 0):
    """Page program ``split``: (m, l, acc) of its share of the keys before ``bulk_hi`` (no
    exact rows), page ids loaded ahead in windows of PAGE_WINDOW pages (0: per block)."""
    chunk = tl.cdiv(tl.cdiv(bulk_hi, NUM_SPLITS), BLOCK_N) * BLOCK_N
    lo = split * chunk
    return _word_range(
        qs, table_row, lo, tl.minimum(lo + chunk, bulk_hi), kv_head,
        k_ptr, v_ptr, stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh,
        ks_ptr, vs_ptr, stride_ksp, stride_kss, stride_ksh, stride_vsp, stride_vss, stride_vsh,
        table_row, -1, 0, 0, 0,
        BLOCK_M, BLOCK_N, PAGE_SIZE, HEAD_DIM, DIM_PAD, K_BITS, V_BITS, 0, DOT_PRECISION,
        K_JOIN, V_JOIN, FAST_UNPACK, SCALE_LOAD, PAGE_WINDOW, LOOP_FLAGS)


@triton.jit
def _word_range(qs, table_row, lo, hi, kv_head,
                k_ptr, v_ptr, stride_kp, stride_ks, stride_kh, stride_vp, stride_vs,
                stride_vh, ks_ptr, vs_ptr, stride_ksp, stride_kss, stride_ksh, stride_vsp,
                stride_vss, stride_vsh, ring_pos_ptr, ring_base, step_start, near_lo,
                position,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr,
                HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr, K_BITS: tl.constexpr,
                V_BITS: tl.constexpr, WINDOW: tl.constexpr, DOT_PRECISION: tl.constexpr,
                K_JOIN: tl.constexpr, V_JOIN: tl.constexpr, FAST_UNPACK: tl.constexpr,
                SCALE_LOAD: tl.constexpr, PAGE_WINDOW: tl.constexpr,
                LOOP_FLAGS: tl.constexpr = 0):
    """`attend_word_blocks` over keys [lo, hi) from an empty state: (m, l, acc) with the
    accumulators joined into one [BLOCK_M, DIM_PAD] tile in dim order (LOOP_FLAGS: the
    running sums reduced, the paired value columns put back in order)."""
    V_PER: tl.constexpr = 32 // V_BITS
    LAZY: tl.constexpr = LOOP_FLAGS % 2 == 1
    PAIRED: tl.constexpr = (LOOP_FLAGS // 2) % 2 == 1 and V_JOIN
    SWAPPED: tl.constexpr = (LOOP_FLAGS // 8) % 2 == 1 and V_JOIN
    if LAZY:
        l_0 = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    else:
        l_0 = tl.zeros([BLOCK_M], tl.float32)
    m_i, l_i, accs = attend_word_blocks(
        qs, tl.full([BLOCK_M], -1.0e30, tl.float32), l_0,
        _zero_accs(BLOCK_M, DIM_PAD, V_PER, V_JOIN), table_row, lo, hi, kv_head,
        k_ptr, v_ptr, stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh,
        ks_ptr, vs_ptr, stride_ksp, stride_kss, stride_ksh, stride_vsp, stride_vss, stride_vsh,
        ring_pos_ptr, ring_base, step_start, near_lo, position,
        BLOCK_N, PAGE_SIZE, HEAD_DIM, DIM_PAD, K_BITS, V_BITS, WINDOW, DOT_PRECISION, K_JOIN,
        V_JOIN, FAST_UNPACK, SCALE_LOAD, PAGE_WINDOW, LOOP_FLAGS)
    if LAZY:
        l_i = tl.sum(l_i, 1)
    acc = _joined_accs(accs, BLOCK_M, DIM_PAD, V_PER, V_JOIN)
    if SWAPPED:
        acc = swapped_quarters(acc, BLOCK_M, DIM_PAD)
    if PAIRED:
        acc = unpaired_columns(acc, BLOCK_M, DIM_PAD // V_PER, V_PER)
    return m_i, l_i, acc


@triton.jit
def tail_program(part, q, qs, table_row, bulk_hi, ctx, token, kv_head, dims,
                 k_ptr, v_ptr, stride_kp, stride_ks, stride_kh, stride_vp, stride_vs,
                 stride_vh, ks_ptr, vs_ptr, stride_ksp, stride_kss, stride_ksh, stride_vsp,
                 stride_vss, stride_vsh, head_k_ptr, head_v_ptr, ring_k_ptr, ring_v_ptr,
                 ring_pos_ptr, fresh_k_ptr, fresh_v_ptr, stride_er, stride_eh, ring_base,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr,
                 HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr, K_BITS: tl.constexpr,
                 V_BITS: tl.constexpr, WINDOW: tl.constexpr, DOT_PRECISION: tl.constexpr,
                 K_JOIN: tl.constexpr, V_JOIN: tl.constexpr, FAST_UNPACK: tl.constexpr,
                 SCALE_LOAD: tl.constexpr, TAIL_PARTS: tl.constexpr,
                 LOOP_FLAGS: tl.constexpr = 0):
    """Tail part ``part`` of TAIL_PARTS (module docstring) for the decode query at
    ``ctx - 1``: (m, l, acc) of its keys, ``q`` the query tile (exact rows), ``qs`` its
    columns as the blocks take them."""
    BLOCK_PARTS: tl.constexpr = TAIL_PARTS - 2 if TAIL_PARTS > 2 else 1
    # A window of up to 16 positions is one 16-row tile, not a key block's 64 rows (the
    # single tail keeps the key block, as before parts existed).
    ROWS_N: tl.constexpr = 16 if WINDOW <= 16 else BLOCK_N
    # LOOP_FLAGS bit 4: the single tail takes the parts' 16-row tiles too (smaller shared
    # memory for the one-launch kernel).
    SINGLE_ROWS_N: tl.constexpr = ROWS_N if (LOOP_FLAGS // 4) % 2 == 1 else BLOCK_N
    position = ctx - 1
    near_lo = ctx - WINDOW
    positions = position + tl.zeros([BLOCK_M], tl.int32)
    chunk = tl.cdiv(tl.cdiv(ctx - bulk_hi, BLOCK_PARTS), BLOCK_N) * BLOCK_N
    lo = bulk_hi + part * chunk
    blocks_hi = tl.minimum(lo + chunk, ctx)
    if TAIL_PARTS == 1:
        m_i, l_i, acc = _word_range(
            qs, table_row, bulk_hi, ctx, kv_head, k_ptr, v_ptr, stride_kp, stride_ks,
            stride_kh, stride_vp, stride_vs, stride_vh, ks_ptr, vs_ptr, stride_ksp, stride_kss,
            stride_ksh, stride_vsp, stride_vss, stride_vsh, ring_pos_ptr, ring_base, position,
            near_lo, position, BLOCK_M, BLOCK_N, PAGE_SIZE, HEAD_DIM, DIM_PAD, K_BITS, V_BITS,
            WINDOW, DOT_PRECISION, K_JOIN, V_JOIN, FAST_UNPACK, SCALE_LOAD, 0, LOOP_FLAGS)
        m_i, l_i, acc = attend_page_heads(
            q, m_i, l_i, acc, table_row, tl.cdiv(ctx, PAGE_SIZE), positions, kv_head, dims,
            head_k_ptr, head_v_ptr, stride_er, stride_eh, ring_pos_ptr, ring_base, position,
            near_lo, PAGE_SIZE, BLOCK_N, HEAD_DIM, WINDOW, DOT_PRECISION)
        if WINDOW > 0:
            m_i, l_i, acc = attend_exact_rows(
                q, m_i, l_i, acc, tl.maximum(near_lo, 0), ctx, positions, kv_head, dims,
                fresh_k_ptr, fresh_v_ptr, ring_k_ptr, ring_v_ptr, ring_pos_ptr, stride_er,
                stride_eh, ring_base, position, token, SINGLE_ROWS_N, HEAD_DIM, WINDOW,
                DOT_PRECISION)
    else:
        m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, DIM_PAD], tl.float32)
        if part < BLOCK_PARTS:
            m_i, l_i, acc = _word_range(
                qs, table_row, lo, blocks_hi, kv_head, k_ptr, v_ptr, stride_kp, stride_ks,
                stride_kh, stride_vp, stride_vs, stride_vh, ks_ptr, vs_ptr, stride_ksp,
                stride_kss, stride_ksh, stride_vsp, stride_vss, stride_vsh, ring_pos_ptr,
                ring_base, position, near_lo, position, BLOCK_M, BLOCK_N, PAGE_SIZE, HEAD_DIM,
                DIM_PAD, K_BITS, V_BITS, WINDOW, DOT_PRECISION, K_JOIN, V_JOIN, FAST_UNPACK,
                SCALE_LOAD, 0, LOOP_FLAGS)
        elif part == BLOCK_PARTS:
            m_i, l_i, acc = attend_page_heads(
                q, m_i, l_i, acc, table_row, tl.cdiv(ctx, PAGE_SIZE), positions, kv_head,
                dims, head_k_ptr, head_v_ptr, stride_er, stride_eh, ring_pos_ptr, ring_base,
                position, near_lo, PAGE_SIZE, BLOCK_N, HEAD_DIM, WINDOW, DOT_PRECISION)
            if TAIL_PARTS == 2 and WINDOW > 0:  # two parts: (b) then (c)
                m_i, l_i, acc = attend_exact_rows(
                    q, m_i, l_i, acc, tl.maximum(near_lo, 0), ctx, positions, kv_head, dims,
                    fresh_k_ptr, fresh_v_ptr, ring_k_ptr, ring_v_ptr, ring_pos_ptr,
                    stride_er, stride_eh, ring_base, position, token, ROWS_N, HEAD_DIM,
                    WINDOW, DOT_PRECISION)
        elif WINDOW > 0:
            m_i, l_i, acc = attend_exact_rows(
                q, m_i, l_i, acc, tl.maximum(near_lo, 0), ctx, positions, kv_head, dims,
                fresh_k_ptr, fresh_v_ptr, ring_k_ptr, ring_v_ptr, ring_pos_ptr, stride_er,
                stride_eh, ring_base, position, token, ROWS_N, HEAD_DIM, WINDOW,
                DOT_PRECISION)
    return m_i, l_i, acc
