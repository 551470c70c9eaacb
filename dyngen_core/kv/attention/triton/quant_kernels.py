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
page and stop before the recent window's first block; ``TAIL_PARTS`` more programs per
(sequence, KV head), the "tail", attend the rest (the last blocks with the window rule, every
page's head row, and the window's exact rows: in one program one after the other, or side by
side in several, `triton_quant_programs.tail_program`), each writing one more partial result,
merged with the splits' by `triton_kernels.combine_splits_kernel` (or, MERGE, in the kernel:
`triton_decode_merge`). So the page loop carries no exact-row work at all. The programs live in
`triton_quant_programs`; this module holds the kernel (query, roles, partials, merge).
"""

from __future__ import annotations

import triton
import triton.language as tl

from dyngen_core.kv.attention.triton.decode_merge import count_in_and_merge
from dyngen_core.kv.attention.triton.kernels import log2_sum_exp
from dyngen_core.kv.attention.triton.quant_programs import page_program, tail_program
from dyngen_core.kv.attention.triton.quant_unpack import split_columns
from dyngen_core.kv.attention.triton.rotation import rotated_back, rotated_queries
from dyngen_core.kv.quant.write_kernel import write_token_heads


# As `paged_attention_kernel`: the page table width follows the batch outside CUDA graphs.
@triton.jit(do_not_specialize=["stride_pt"])
def quant_decode_kernel(
    q_ptr, stride_qt, stride_qh,
    k_ptr, v_ptr, stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh,
    ks_ptr, vs_ptr, stride_ksp, stride_kss, stride_ksh, stride_vsp, stride_vss, stride_vsh,
    rot_ptr,
    page_table_ptr, stride_pt, context_lens_ptr,
    head_k_ptr, head_v_ptr, ring_k_ptr, ring_v_ptr, ring_pos_ptr, seq_slots_ptr,
    fresh_k_ptr, fresh_v_ptr, stride_er, stride_eh,
    part_out_ptr, part_lse_ptr, out_ptr, stride_ot, stride_oh, counter_ptr,
    scale_log2,
    w_key_ptr, w_value_ptr, w_slots_ptr, w_offsets_ptr, w_signs_ptr,
    stride_wkt, stride_wkh, stride_wvt, stride_wvh,
    w_key_codes_ptr, w_key_scales_ptr, w_value_codes_ptr, w_value_scales_ptr, w_head_rows_ptr,
    w_exact_ptr, w_num_slots, w_num_pages, w_positions_ptr, w_seq_slots_ptr, w_ring_rows_ptr,
    w_ring_positions_ptr, w_slots_held, w_tokens,
    G: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
    DIM_PAD: tl.constexpr, PAGE_SIZE: tl.constexpr, K_BITS: tl.constexpr,
    V_BITS: tl.constexpr, NUM_SPLITS: tl.constexpr, WINDOW: tl.constexpr,
    DOT_PRECISION: tl.constexpr, PROGRAMS: tl.constexpr, K_JOIN: tl.constexpr = False,
    V_JOIN: tl.constexpr = False, HALF_DOT: tl.constexpr = False,
    FAST_UNPACK: tl.constexpr = False, WIDE_SCALES: tl.constexpr = False,
    PAGE_WINDOW: tl.constexpr = 0, SCALE_ROWS: tl.constexpr = False,
    MERGE: tl.constexpr = False, G_PAD: tl.constexpr = 1, SPLIT_BLOCK: tl.constexpr = 1,
    TAIL_PARTS: tl.constexpr = 1, LOOP_FLAGS: tl.constexpr = 0,
    WRITE_STEP: tl.constexpr = False, W_HEADS: tl.constexpr = 1,
    W_HAS_OFFSETS: tl.constexpr = False, W_ROWS: tl.constexpr = 1,
    W_INV_SQRT: tl.constexpr = 1.0,
):
    """Grid (sequences, KV heads, NUM_SPLITS + TAIL_PARTS) over a decode-only batch (one query
    token per sequence: sequence i's is token i). Programs with split < NUM_SPLITS share the keys
    before the window's first block; programs NUM_SPLITS + t are the tail's parts t (module
    docstring; TAIL_PARTS 1: one program attends all of the tail). Each writes its partial
    [T, H, NUM_SPLITS + TAIL_PARTS, DIM_PAD] and log2-sum-exp [T, H, NUM_SPLITS + TAIL_PARTS]
    in the float32 buffers. Exact-row operands as `triton_kernels.paged_attention_kernel`'s
    (``seq_slots`` unread when WINDOW is 0). PROGRAMS: 0 runs both kinds in one grid; 1 only
    the page programs (grid z NUM_SPLITS), 2 only the tail (grid z TAIL_PARTS): two launches,
    so neither kind's code takes registers from the other. K_JOIN, V_JOIN: keys, values
    dequantized to whole rows for one dot per block (`triton_quant_programs`'s
    `attend_word_blocks`). HALF_DOT: the page blocks' dots run in float16 even for bfloat16
    queries, so codes of 8 bits too become
    halves by the exponent trick and scales apply as HMUL2 (the exact rows keep the query's
    dtype; dequantized rows must stay below 65504 in magnitude, as float16 scales already
    require). FAST_UNPACK: unpack in inline PTX where the dots run in float16 (CUDA only).
    WIDE_SCALES: scales loaded as int32 pairs (head_dim a multiple of 64, else ignored);
    SCALE_ROWS (over WIDE_SCALES): as each key's row of contiguous scales, widened to the
    columns in registers (`triton_quant_unpack.load_scales`).
    PAGE_WINDOW: the page programs load page ids ahead, PAGE_WINDOW pages at a time (a power
    of two; 0: one id per block in the loop, `attend_word_blocks`); the tail's one or two
    blocks keep the per-block load.
    LOOP_FLAGS: key-loop options (bits, `triton_quant.WordKernelFlags` lazy_sum and
    paired_values): 1 keeps per-key running sums reduced once after the loop, 2 joins the
    values in the unpack's pair order (with V_JOIN; `triton_quant_programs._word_block`), 4
    gives the single tail 16-row window tiles, 8 swaps the value tile's middle quarters.
    MERGE: the program of each (sequence, KV head) that counts in last at ``counter_ptr``
    (a zeroed int32 per pair, row-major; `triton_decode_merge.count_in_and_merge` resets it)
    merges all NUM_SPLITS + TAIL_PARTS partials (empty ones weigh 0), ``SPLIT_BLOCK`` per
    round over ``G_PAD`` (G's power of two) rows, into ``out`` [T, H, HEAD_DIM] (strides
    ``stride_ot``, ``stride_oh``, 1). Two launches: the page programs only count in; the tail
    parts (launched after them on the stream) count in with acquire-release, and the last of
    them merges.
    WRITE_STEP (WINDOW > 0): the last tail part of each (sequence, KV head) first does the
    storage's write of that head's rows of this step (the ``w_*`` / ``stride_w*`` operands and W_*
    constexprs: `storage.quant_write.StepQuantWrite`, token ``w_tokens`` of the rows),
    codes, scales, head row, window row and the fresh exact rows it then reads
    (`quant_write_kernel.write_token_heads`). No other program of the launch reads what it
    stores: the page programs and the other tail parts stop before the window, whose
    replaced row held a position no query of the step reads
    (`quant_write_kernel._store_decode_window`)."""
    SCALE_LOAD: tl.constexpr = 2 if SCALE_ROWS else (WIDE_SCALES and HEAD_DIM % 64 == 0) * 1
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    if PROGRAMS == 2:
        split = tl.program_id(2) + NUM_SPLITS
    else:
        split = tl.program_id(2)
    # A decode-only batch has one query token per sequence, in order: no load of its index
    # (one global-load latency before the query's, at the head of every program's chain).
    token = seq
    if WRITE_STEP:
        if split == NUM_SPLITS + TAIL_PARTS - 1:
            write_token_heads(
                token.to(tl.int64), w_tokens, kv_head, w_key_ptr, w_value_ptr, w_slots_ptr,
                w_offsets_ptr, w_signs_ptr, stride_wkt, stride_wkh, stride_wvt, stride_wvh,
                w_key_codes_ptr, w_key_scales_ptr, w_value_codes_ptr, w_value_scales_ptr,
                w_head_rows_ptr, w_exact_ptr, w_num_slots, w_num_pages, w_positions_ptr,
                w_seq_slots_ptr, w_ring_rows_ptr, w_ring_positions_ptr, w_slots_held, W_HEADS,
                HEAD_DIM, PAGE_SIZE, K_BITS, V_BITS, W_HAS_OFFSETS, W_ROWS, W_INV_SQRT, WINDOW,
                1)
            tl.debug_barrier()  # the fresh rows stored before this program's loads of them
    ctx = tl.load(context_lens_ptr + seq)
    rows = tl.arange(0, BLOCK_M)
    row_valid = rows < G
    head = kv_head * G + rows
    dims = tl.arange(0, DIM_PAD)
    q = tl.load(q_ptr + token.to(tl.int64) * stride_qt + (head * stride_qh)[:, None]
                + dims[None, :], mask=row_valid[:, None] & (dims < HEAD_DIM)[None, :], other=0.0)
    q_rotated = rotated_queries(q, rot_ptr, scale_log2, BLOCK_M, DIM_PAD)
    q = q_rotated.to(q_ptr.dtype.element_ty)
    if HALF_DOT and q_ptr.dtype.element_ty != tl.float32:
        q_dot = q_rotated.to(tl.float16)
    else:
        q_dot = q
    K_PER: tl.constexpr = 32 // K_BITS
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
    if PROGRAMS == 1:
        m_i, l_i, acc = page_program(
            qs, table_row, split, bulk_hi, kv_head,
            k_ptr, v_ptr, stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh,
            ks_ptr, vs_ptr, stride_ksp, stride_kss, stride_ksh, stride_vsp, stride_vss,
            stride_vsh, BLOCK_M, BLOCK_N, PAGE_SIZE, HEAD_DIM, DIM_PAD, K_BITS, V_BITS,
            NUM_SPLITS, DOT_PRECISION, K_JOIN, V_JOIN, FAST_UNPACK, SCALE_LOAD, PAGE_WINDOW,
            LOOP_FLAGS)
    elif PROGRAMS == 2:
        m_i, l_i, acc = tail_program(
            split - NUM_SPLITS, q, qs, table_row, bulk_hi, ctx, token, kv_head, dims,
            k_ptr, v_ptr, stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh,
            ks_ptr, vs_ptr, stride_ksp, stride_kss, stride_ksh, stride_vsp, stride_vss,
            stride_vsh, head_k_ptr, head_v_ptr, ring_k_ptr, ring_v_ptr, ring_pos_ptr,
            fresh_k_ptr, fresh_v_ptr, stride_er, stride_eh, ring_base,
            BLOCK_M, BLOCK_N, PAGE_SIZE, HEAD_DIM, DIM_PAD, K_BITS, V_BITS, WINDOW,
            DOT_PRECISION, K_JOIN, V_JOIN, FAST_UNPACK, SCALE_LOAD, TAIL_PARTS, LOOP_FLAGS)
    else:
        if split < NUM_SPLITS:
            m_i, l_i, acc = page_program(
                qs, table_row, split, bulk_hi, kv_head,
                k_ptr, v_ptr, stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh,
                ks_ptr, vs_ptr, stride_ksp, stride_kss, stride_ksh, stride_vsp, stride_vss,
                stride_vsh, BLOCK_M, BLOCK_N, PAGE_SIZE, HEAD_DIM, DIM_PAD, K_BITS, V_BITS,
                NUM_SPLITS, DOT_PRECISION, K_JOIN, V_JOIN, FAST_UNPACK, SCALE_LOAD,
                PAGE_WINDOW, LOOP_FLAGS)
        else:
            m_i, l_i, acc = tail_program(
                split - NUM_SPLITS, q, qs, table_row, bulk_hi, ctx, token, kv_head, dims,
                k_ptr, v_ptr, stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh,
                ks_ptr, vs_ptr, stride_ksp, stride_kss, stride_ksh, stride_vsp, stride_vss,
                stride_vsh, head_k_ptr, head_v_ptr, ring_k_ptr, ring_v_ptr, ring_pos_ptr,
                fresh_k_ptr, fresh_v_ptr, stride_er, stride_eh, ring_base,
                BLOCK_M, BLOCK_N, PAGE_SIZE, HEAD_DIM, DIM_PAD, K_BITS, V_BITS, WINDOW,
                DOT_PRECISION, K_JOIN, V_JOIN, FAST_UNPACK, SCALE_LOAD, TAIL_PARTS,
                LOOP_FLAGS)
    acc = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    acc = rotated_back(acc, rot_ptr, BLOCK_M, DIM_PAD)
    PARTIALS: tl.constexpr = NUM_SPLITS + TAIL_PARTS
    part_row = (token.to(tl.int64) * tl.num_programs(1) * G + head) * PARTIALS + split
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
                               kv_head * G, PARTIALS, PARTIALS, G, G_PAD, SPLIT_BLOCK,
                               HEAD_DIM, DIM_PAD)
