"""Triton decode kernel for 4- and 8-bit quantized pages that unpacks codes without reshapes.

A page row of ``HEAD_DIM`` codes is ``WORDS`` int32 words of ``PER_WORD`` codes each (8 for 4
bits, 4 for 8 bits; `storage.qformat`): dim ``d`` is field ``d % PER_WORD`` of word
``d // PER_WORD``. Field ``i`` of every word of a block of keys is one tile [keys, W_PAD] whose
column ``w`` is dim ``w * PER_WORD + i``, so a block is ``PER_WORD`` tiles taken from the same
loaded words by a shift and a mask each: no reshape, no layout conversion per block. Dim ``d``'s
scale group is ``d // 32 = w // (32 / PER_WORD)``: one scale tile [keys, W_PAD] (a gather whose
repeated addresses hit the cache) serves every field. The query is split the same way once per
program (``q_i`` = its columns ``w * PER_WORD + i``, `split_columns`), scores are
``sum_i q_i . k_i``, values accumulate per field (``acc_i += p v_i``) and are joined back once.
Codes become floats with the exponent trick (a field OR-ed into the mantissa of a power of two,
minus that power and the code bias), in the dot dtype: no integer-to-float conversions.
The unpacking helpers live in `triton_quant_unpack`. Options (constexprs, all off by default:
`triton_quant.attend_word_decode` documents them): whole dequantized rows for one dot per block
(K_JOIN, V_JOIN), float16 dots for bfloat16 queries (HALF_DOT), inline-PTX unpacking
(FAST_UNPACK).

Exact rows (the rule of `attention.sdpa_recent`): the page-loop programs mask slot 0 of every
page and stop before the recent window's first block; one more program per (sequence, KV head),
the "tail", attends the rest (the last blocks with the window rule, every page's head row, and
the window's exact rows) and writes one more partial result, merged with the splits' by
`triton_kernels.combine_splits_kernel` (or, MERGE, in the kernel: `triton_decode_merge`). So
the page loop carries no exact-row work at all.
"""

from __future__ import annotations

import triton
import triton.language as tl

from dyngen_core.attention.triton_decode_merge import count_in_and_merge
from dyngen_core.attention.triton_exact_kernels import (
    attend_exact_rows,
    attend_page_heads,
    window_holds,
)
from dyngen_core.attention.triton_kernels import _rotate_rows, log2_sum_exp
from dyngen_core.attention.triton_page_window import tile_page, window_ids, window_keys
from dyngen_core.attention.triton_quant_unpack import (
    dequantized_fields,
    dequantized_rows,
    join_columns,
    load_scales,
    load_tile,
    split_columns,
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
                       PAGE_WINDOW: tl.constexpr):
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
                    DOT_PRECISION, K_JOIN, V_JOIN, FAST_UNPACK, SCALE_LOAD)
    else:
        for n0 in range(lo, hi, BLOCK_N):
            page = tl.load(table_row + n0 // PAGE_SIZE).to(tl.int64)
            m_i, l_i, accs = _word_block(
                qs, m_i, l_i, accs, page, n0, hi, kv_head, k_ptr, v_ptr, stride_kp,
                stride_ks, stride_kh, stride_vp, stride_vs, stride_vh, ks_ptr, vs_ptr,
                stride_ksp, stride_kss, stride_ksh, stride_vsp, stride_vss, stride_vsh,
                ring_pos_ptr, ring_base, step_start, near_lo, position,
                BLOCK_N, PAGE_SIZE, HEAD_DIM, DIM_PAD, K_BITS, V_BITS, WINDOW,
                DOT_PRECISION, K_JOIN, V_JOIN, FAST_UNPACK, SCALE_LOAD)
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
                FAST_UNPACK: tl.constexpr, SCALE_LOAD: tl.constexpr):
    """One block of `attend_word_blocks`: keys [n0, n0 + BLOCK_N) (those below ``hi``) in
    page ``page`` (int64). Slot 0 of every page is skipped (its exact head row is attended
    elsewhere). WINDOW > 0: keys the window covers (`window_holds`, keys from ``near_lo``
    on) are skipped too. K_JOIN: ``qs`` is the whole query tile (one element) and the keys
    enter one dot over whole rows (`dequantized_rows`), else one per field. V_JOIN:
    ``accs`` is one [BLOCK_M, DIM_PAD] tile and the values enter one dot over whole rows,
    else one tile and dot per field. FAST_UNPACK: codes unpacked two fields at a time in
    inline PTX where the dots run in float16 (`triton_quant_unpack`). SCALE_LOAD: how scales
    are loaded (`load_scales`'s MODE)."""
    DT: tl.constexpr = qs[0].dtype
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
    l_i = l_i * alpha + tl.sum(p, 1)
    p = p.to(DT)
    vwords = load_tile(v_ptr + kv_head * stride_vh + page * stride_vp, slots, stride_vs,
                       key_valid, vw, vw_ok, False, V_PADDED)
    vscale = load_scales(vs_ptr, kv_head * stride_vsh + page * stride_vsp, slots, stride_vss,
                         key_valid, vw // (32 // V_PER), vw_ok, False, V_PADDED,
                         SCALE_LOAD, 32 // V_PER, HEAD_DIM).to(DT)
    if V_JOIN:
        vrows = dequantized_rows(vwords, vscale, BLOCK_N, V_WPAD, V_BITS, DT, FAST_UNPACK)
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


# As `paged_attention_kernel`: the page table width follows the batch outside CUDA graphs.
@triton.jit(do_not_specialize=["stride_pt"])
def quant_decode_kernel(
    q_ptr, stride_qt, stride_qh,
    k_ptr, v_ptr, stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh,
    ks_ptr, vs_ptr, stride_ksp, stride_kss, stride_ksh, stride_vsp, stride_vss, stride_vsh,
    rot_ptr,
    page_table_ptr, stride_pt, context_lens_ptr, query_start_ptr,
    head_k_ptr, head_v_ptr, ring_k_ptr, ring_v_ptr, ring_pos_ptr, seq_slots_ptr,
    fresh_k_ptr, fresh_v_ptr, stride_er, stride_eh,
    part_out_ptr, part_lse_ptr, out_ptr, stride_ot, stride_oh, counter_ptr,
    scale_log2,
    G: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
    DIM_PAD: tl.constexpr, PAGE_SIZE: tl.constexpr, K_BITS: tl.constexpr,
    V_BITS: tl.constexpr, NUM_SPLITS: tl.constexpr, WINDOW: tl.constexpr,
    DOT_PRECISION: tl.constexpr, PROGRAMS: tl.constexpr, K_JOIN: tl.constexpr = False,
    V_JOIN: tl.constexpr = False, HALF_DOT: tl.constexpr = False,
    FAST_UNPACK: tl.constexpr = False, WIDE_SCALES: tl.constexpr = False,
    PAGE_WINDOW: tl.constexpr = 0, SCALE_ROWS: tl.constexpr = False,
    MERGE: tl.constexpr = False, G_PAD: tl.constexpr = 1, SPLIT_BLOCK: tl.constexpr = 1,
):
    """Grid (sequences, KV heads, NUM_SPLITS + 1) over a decode-only batch (sequence i is
    query token ``query_start[i]``). Programs with split < NUM_SPLITS share the keys before
    the window's first block; program NUM_SPLITS is the tail (module docstring). Each writes
    its partial [T, H, NUM_SPLITS + 1, DIM_PAD] and log2-sum-exp [T, H, NUM_SPLITS + 1] in the
    float32 buffers. Exact-row operands as `triton_kernels.paged_attention_kernel`'s
    (``seq_slots`` unread when WINDOW is 0). PROGRAMS: 0 runs both kinds in one grid; 1 only
    the page programs (grid z NUM_SPLITS), 2 only the tail (grid z 1): two launches, so
    neither kind's code takes registers from the other. K_JOIN, V_JOIN: keys, values
    dequantized to whole rows for one dot per block (`attend_word_blocks`). HALF_DOT: the page
    blocks' dots run in float16 even for bfloat16 queries, so codes of 8 bits too become
    halves by the exponent trick and scales apply as HMUL2 (the exact rows keep the query's
    dtype; dequantized rows must stay below 65504 in magnitude, as float16 scales already
    require). FAST_UNPACK: unpack in inline PTX where the dots run in float16 (CUDA only).
    WIDE_SCALES: scales loaded as int32 pairs (head_dim a multiple of 64, else ignored);
    SCALE_ROWS (over WIDE_SCALES): as each key's row of contiguous scales, widened to the
    columns in registers (`triton_quant_unpack.load_scales`).
    PAGE_WINDOW: the page programs load page ids ahead, PAGE_WINDOW pages at a time (a power
    of two; 0: one id per block in the loop, `attend_word_blocks`); the tail's one or two
    blocks keep the per-block load.
    MERGE: the program of each (sequence, KV head) that counts in last at ``counter_ptr``
    (a zeroed int32 per pair, row-major; `triton_decode_merge.count_in_and_merge` resets it)
    merges all NUM_SPLITS + 1 partials (empty splits weigh 0), ``SPLIT_BLOCK`` per round
    over ``G_PAD`` (G's power of two) rows, into ``out`` [T, H, HEAD_DIM] (strides
    ``stride_ot``, ``stride_oh``, 1). Two launches: the page programs count in, the tail
    (launched after them on the stream) counts in last."""
    SCALE_LOAD: tl.constexpr = 2 if SCALE_ROWS else (WIDE_SCALES and HEAD_DIM % 64 == 0) * 1
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    if PROGRAMS == 2:
        split = tl.program_id(2) + NUM_SPLITS
    else:
        split = tl.program_id(2)
    token = tl.load(query_start_ptr + seq)
    ctx = tl.load(context_lens_ptr + seq)
    rows = tl.arange(0, BLOCK_M)
    row_valid = rows < G
    head = kv_head * G + rows
    dims = tl.arange(0, DIM_PAD)
    q = tl.load(q_ptr + token.to(tl.int64) * stride_qt + (head * stride_qh)[:, None]
                + dims[None, :], mask=row_valid[:, None] & (dims < HEAD_DIM)[None, :], other=0.0)
    r32 = tl.arange(0, 32)
    rot_t = tl.load(rot_ptr + r32[None, :] * 32 + r32[:, None])  # R^T
    q_rotated = (_rotate_rows(q.to(tl.float32), rot_t, BLOCK_M, DIM_PAD) * scale_log2)
    q = q_rotated.to(q_ptr.dtype.element_ty)
    if HALF_DOT and q_ptr.dtype.element_ty != tl.float32:
        q_dot = q_rotated.to(tl.float16)
    else:
        q_dot = q
    K_PER: tl.constexpr = 32 // K_BITS
    V_PER: tl.constexpr = 32 // V_BITS
    if K_JOIN:
        qs = (q_dot,)
    else:
        qs = split_columns(q_dot, BLOCK_M, DIM_PAD // K_PER, K_PER)
    near_lo = ctx - WINDOW
    if WINDOW > 0:
        seq_slot = tl.load(seq_slots_ptr + seq)
        ring_base = tl.where(seq_slot >= 0, seq_slot * WINDOW, -1)
        bulk_hi = (tl.maximum(near_lo, 0) // BLOCK_N) * BLOCK_N
    else:
        ring_base = ctx * 0 - 1
        bulk_hi = ctx
    table_row = page_table_ptr + seq.to(tl.int64) * stride_pt
    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    accs = _zero_accs(BLOCK_M, DIM_PAD, V_PER, V_JOIN)
    if PROGRAMS == 1:
        m_i, l_i, acc = _page_program(
            qs, m_i, l_i, accs, table_row, split, bulk_hi, kv_head,
            k_ptr, v_ptr, stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh,
            ks_ptr, vs_ptr, stride_ksp, stride_kss, stride_ksh, stride_vsp, stride_vss,
            stride_vsh, BLOCK_M, BLOCK_N, PAGE_SIZE, HEAD_DIM, DIM_PAD, K_BITS, V_BITS,
            NUM_SPLITS, DOT_PRECISION, K_JOIN, V_JOIN, FAST_UNPACK, SCALE_LOAD,
            PAGE_WINDOW)
    elif PROGRAMS == 2:
        m_i, l_i, acc = _tail_program(
            q, qs, m_i, l_i, accs, table_row, bulk_hi, ctx, token, kv_head, dims,
            k_ptr, v_ptr, stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh,
            ks_ptr, vs_ptr, stride_ksp, stride_kss, stride_ksh, stride_vsp, stride_vss,
            stride_vsh, head_k_ptr, head_v_ptr, ring_k_ptr, ring_v_ptr, ring_pos_ptr,
            fresh_k_ptr, fresh_v_ptr, stride_er, stride_eh, ring_base,
            BLOCK_M, BLOCK_N, PAGE_SIZE, HEAD_DIM, DIM_PAD, K_BITS, V_BITS, WINDOW,
            DOT_PRECISION, K_JOIN, V_JOIN, FAST_UNPACK, SCALE_LOAD)
    else:
        if split < NUM_SPLITS:
            m_i, l_i, acc = _page_program(
                qs, m_i, l_i, accs, table_row, split, bulk_hi, kv_head,
                k_ptr, v_ptr, stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh,
                ks_ptr, vs_ptr, stride_ksp, stride_kss, stride_ksh, stride_vsp, stride_vss,
                stride_vsh, BLOCK_M, BLOCK_N, PAGE_SIZE, HEAD_DIM, DIM_PAD, K_BITS, V_BITS,
                NUM_SPLITS, DOT_PRECISION, K_JOIN, V_JOIN, FAST_UNPACK, SCALE_LOAD,
            PAGE_WINDOW)
        else:
            m_i, l_i, acc = _tail_program(
                q, qs, m_i, l_i, accs, table_row, bulk_hi, ctx, token, kv_head, dims,
                k_ptr, v_ptr, stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh,
                ks_ptr, vs_ptr, stride_ksp, stride_kss, stride_ksh, stride_vsp, stride_vss,
                stride_vsh, head_k_ptr, head_v_ptr, ring_k_ptr, ring_v_ptr, ring_pos_ptr,
                fresh_k_ptr, fresh_v_ptr, stride_er, stride_eh, ring_base,
                BLOCK_M, BLOCK_N, PAGE_SIZE, HEAD_DIM, DIM_PAD, K_BITS, V_BITS, WINDOW,
                DOT_PRECISION, K_JOIN, V_JOIN, FAST_UNPACK, SCALE_LOAD)
    acc = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    acc = _rotate_rows(acc, tl.load(rot_ptr + r32[:, None] * 32 + r32[None, :]),
                       BLOCK_M, DIM_PAD)
    part_row = (token.to(tl.int64) * tl.num_programs(1) * G + head) * (NUM_SPLITS + 1) + split
    tl.store(part_out_ptr + part_row[:, None] * DIM_PAD + dims[None, :], acc,
             mask=row_valid[:, None])
    tl.store(part_lse_ptr + part_row, log2_sum_exp(m_i, l_i), mask=row_valid)
    if MERGE:
        counter = counter_ptr + seq * tl.num_programs(1) + kv_head
        if PROGRAMS == 1:  # the tail launch after this one counts in last and merges
            tl.atomic_add(counter, 1, sem="relaxed")
        else:
            count_in_and_merge(counter, part_out_ptr, part_lse_ptr, out_ptr,
                               token.to(tl.int64) * stride_ot, stride_oh,
                               (token.to(tl.int64) * tl.num_programs(1) + kv_head) * G,
                               kv_head * G, NUM_SPLITS + 1, NUM_SPLITS + 1, G, G_PAD,
                               SPLIT_BLOCK, HEAD_DIM, DIM_PAD)


@triton.jit
def _page_program(qs, m_i, l_i, accs, table_row, split, bulk_hi, kv_head,
                  k_ptr, v_ptr, stride_kp, stride_ks, stride_kh, stride_vp, stride_vs,
                  stride_vh, ks_ptr, vs_ptr, stride_ksp, stride_kss, stride_ksh, stride_vsp,
                  stride_vss, stride_vsh,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr,
                  HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr, K_BITS: tl.constexpr,
                  V_BITS: tl.constexpr, NUM_SPLITS: tl.constexpr,
                  DOT_PRECISION: tl.constexpr, K_JOIN: tl.constexpr,
                  V_JOIN: tl.constexpr, FAST_UNPACK: tl.constexpr,
                  SCALE_LOAD: tl.constexpr, PAGE_WINDOW: tl.constexpr):
    """Page program ``split``: its share of the keys before ``bulk_hi`` (no exact rows),
    page ids loaded ahead in windows of PAGE_WINDOW pages (0: per block)."""
    V_PER: tl.constexpr = 32 // V_BITS
    chunk = tl.cdiv(tl.cdiv(bulk_hi, NUM_SPLITS), BLOCK_N) * BLOCK_N
    lo = split * chunk
    m_i, l_i, accs = attend_word_blocks(
        qs, m_i, l_i, accs, table_row, lo, tl.minimum(lo + chunk, bulk_hi), kv_head,
        k_ptr, v_ptr, stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh,
        ks_ptr, vs_ptr, stride_ksp, stride_kss, stride_ksh, stride_vsp, stride_vss, stride_vsh,
        table_row, -1, 0, 0, 0,
        BLOCK_N, PAGE_SIZE, HEAD_DIM, DIM_PAD, K_BITS, V_BITS, 0, DOT_PRECISION, K_JOIN, V_JOIN,
        FAST_UNPACK, SCALE_LOAD, PAGE_WINDOW)
    return m_i, l_i, _joined_accs(accs, BLOCK_M, DIM_PAD, V_PER, V_JOIN)


@triton.jit
def _tail_program(q, qs, m_i, l_i, accs, table_row, bulk_hi, ctx, token, kv_head, dims,
                  k_ptr, v_ptr, stride_kp, stride_ks, stride_kh, stride_vp, stride_vs,
                  stride_vh, ks_ptr, vs_ptr, stride_ksp, stride_kss, stride_ksh, stride_vsp,
                  stride_vss, stride_vsh, head_k_ptr, head_v_ptr, ring_k_ptr, ring_v_ptr,
                  ring_pos_ptr, fresh_k_ptr, fresh_v_ptr, stride_er, stride_eh, ring_base,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr,
                  HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr, K_BITS: tl.constexpr,
                  V_BITS: tl.constexpr, WINDOW: tl.constexpr, DOT_PRECISION: tl.constexpr,
                  K_JOIN: tl.constexpr, V_JOIN: tl.constexpr, FAST_UNPACK: tl.constexpr,
                  SCALE_LOAD: tl.constexpr):
    """The tail program: keys from ``bulk_hi`` on with the window rule, every page's head
    row, and the window's exact rows, for the decode query at ``ctx - 1``."""
    V_PER: tl.constexpr = 32 // V_BITS
    position = ctx - 1
    near_lo = ctx - WINDOW
    m_i, l_i, accs = attend_word_blocks(
        qs, m_i, l_i, accs, table_row, bulk_hi, ctx, kv_head,
        k_ptr, v_ptr, stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh,
        ks_ptr, vs_ptr, stride_ksp, stride_kss, stride_ksh, stride_vsp, stride_vss, stride_vsh,
        ring_pos_ptr, ring_base, position, near_lo, position,
        BLOCK_N, PAGE_SIZE, HEAD_DIM, DIM_PAD, K_BITS, V_BITS, WINDOW, DOT_PRECISION, K_JOIN,
        V_JOIN, FAST_UNPACK, SCALE_LOAD, 0)
    acc = _joined_accs(accs, BLOCK_M, DIM_PAD, V_PER, V_JOIN)
    positions = position + tl.zeros([BLOCK_M], tl.int32)
    m_i, l_i, acc = attend_page_heads(
        q, m_i, l_i, acc, table_row, tl.cdiv(ctx, PAGE_SIZE), positions, kv_head, dims,
        head_k_ptr, head_v_ptr, stride_er, stride_eh, ring_pos_ptr, ring_base, position,
        near_lo, PAGE_SIZE, BLOCK_N, HEAD_DIM, WINDOW, DOT_PRECISION)
    if WINDOW > 0:
        m_i, l_i, acc = attend_exact_rows(
            q, m_i, l_i, acc, tl.maximum(near_lo, 0), ctx, positions, kv_head, dims,
            fresh_k_ptr, fresh_v_ptr, ring_k_ptr, ring_v_ptr, ring_pos_ptr, stride_er,
            stride_eh, ring_base, position, token, BLOCK_N, HEAD_DIM, WINDOW, DOT_PRECISION)
    return m_i, l_i, acc
