"""Triton kernels of the paged attention backend (`triton_paged` launches them).

One program serves one block of query rows of one sequence against one KV head: the rows are
``BLOCK_Q`` tokens x ``G_PAD`` query heads of that KV head's group (GQA), so a decode program
reads each key and value of the group once for all its query heads. A third grid axis splits the
context ("split-K", flash-decoding): each split writes a partial result with its log-sum-exp and
`combine_splits_kernel` merges them, or with ``MERGE`` (decodes) the split program that
finishes last merges them in the same launch (`triton_decode_merge`). The query loading, the
key loop (`triton_decode_tiles`: `attend_key_range`, or with ``PAGE_WINDOW`` page ids loaded
ahead of the tiles so the tile loads pipeline) and the normalization are helpers
(`load_scaled_queries`, `attend_key_range`, `normalized_rows`) that the shared-prefix
kernel of `triton_cascade_kernels` reuses; with ``REMAINDER`` this kernel attends only each
sequence's keys after its group's shared prefix (the cascade's second pass).

Pages are read in place through the page table, in one of two layouts:

- float pages (``K_BITS == 0``): [num_pages, page_size, num_kv_heads, head_dim] in fp16/bf16/fp32;
- quantized pages (``K_BITS`` in 4, 6, 8): codes [num_pages, page_size, num_kv_heads, packed]
  (value ``d`` starts at bit ``d * bits`` of its row, little-endian; 4- and 8-bit rows are read
  as int32 words, 6-bit rows as bytes) and float16 scales
  [num_pages, page_size, num_kv_heads, head_dim / 32], in the group-rotated space of
  `storage.hadamard`. Since the rotation ``R`` is orthogonal, ``q . k = (q R^T) . k'`` and
  ``sum p v = (sum p v') R``: the kernel rotates q once and un-rotates the output once instead
  of un-rotating every cached row.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dyngen_core.kv.attention.triton.decode_merge import count_in_and_merge
from dyngen_core.kv.attention.triton.decode_tiles import attend_key_range as attend_key_range
from dyngen_core.kv.attention.triton.decode_tiles import attend_keys
from dyngen_core.kv.attention.triton.exact_kernels import attend_exact_rows
from dyngen_core.kv.attention.triton.rotation import rotated_back, rotated_queries
from dyngen_core.kv.attention.triton.step_write import store_step_row


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


# The page table's width changes with the longest sequence of each batch; left specialized
# (Triton compiles separately for 1, multiples of 16 and the rest), the first long prefill after
# short ones paid a fresh compile of this kernel inside the step.
@triton.jit(do_not_specialize=["stride_pt"])
def paged_attention_kernel(
    q_ptr, stride_qt, stride_qh,
    k_ptr, v_ptr, stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh,
    ks_ptr, vs_ptr, stride_ksp, stride_kss, stride_ksh, stride_vsp, stride_vss, stride_vsh,
    rot_ptr,
    page_table_ptr, stride_pt, context_lens_ptr, query_start_ptr,
    block_seq_ptr, block_first_ptr, kv_start_ptr,
    head_k_ptr, head_v_ptr, ring_k_ptr, ring_v_ptr, ring_pos_ptr, seq_slots_ptr,
    fresh_k_ptr, fresh_v_ptr, stride_er, stride_eh,
    out_ptr, stride_ot, stride_oh,
    part_out_ptr, part_lse_ptr, counter_ptr,
    step_k_ptr, step_v_ptr, stride_skt, stride_skh, stride_svt, stride_svh, slot_ptr, num_slots,
    scale_log2,
    G: tl.constexpr, G_PAD: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr, PAGE_SIZE: tl.constexpr,
    K_BITS: tl.constexpr, V_BITS: tl.constexpr, NUM_SPLITS: tl.constexpr,
    DECODE: tl.constexpr, REMAINDER: tl.constexpr, WRITE_PARTIALS: tl.constexpr,
    HEADS: tl.constexpr, WINDOW: tl.constexpr, DOT_PRECISION: tl.constexpr,
    MERGE: tl.constexpr = False, SPLIT_BLOCK: tl.constexpr = 1, WRITE_STEP: tl.constexpr = False,
    PAGE_WINDOW: tl.constexpr = 0,
):
    """Grid (query blocks, kv heads, splits). DECODE: block i is sequence i, one query token;
    else block i is sequence ``block_seq[i]`` from its query token ``block_first[i]``.
    REMAINDER: attend only keys from ``kv_start[seq]`` on (a cascade's own-keys pass; the shared
    prefix before it is attended by `triton_cascade_kernels.shared_prefix_kernel`).
    WRITE_PARTIALS: write each split's output and log-sum-exp for a later merge (required when
    NUM_SPLITS > 1 or REMAINDER) instead of the output itself.
    MERGE (DECODE with WRITE_PARTIALS, not REMAINDER): the last split program of each
    (sequence, KV head) to finish merges the partials into the output, ``SPLIT_BLOCK`` splits
    at a time (`triton_decode_merge.count_in_and_merge`; ``counter_ptr``: one zeroed int32
    per (sequence, KV head), row-major).
    WRITE_STEP (DECODE, float pages): first store this step's key/value rows (``step_k`` /
    ``step_v`` [T, kv_heads, head_dim], at flat ``slot_ptr[t]``) into the pages, by the split
    holding the last position (`triton_step_write.store_step_row`).
    HEADS, WINDOW: the exact rows of quantized storage (`attend_key_range`,
    `attend_exact_rows`; the reference rule is `attention.sdpa_recent`): head rows, and with
    WINDOW > 0 each sequence's recent window (slot per sequence in ``seq_slots``, -1: none)
    plus this step's rows ``fresh_k`` / ``fresh_v`` [T, kv_heads, head_dim], all in the
    rotated space; every exact-row tensor has strides (``stride_er``, ``stride_eh``, 1).
    The exact window rows are attended in a second loop on the last split (in place
    substitution, possible for decodes, cost more registers than the loop saved).
    DOT_PRECISION: "ieee" for float32 inputs (exact, like torch), "tf32" otherwise.
    PAGE_WINDOW > 0 (a power of two; BLOCK_N must divide PAGE_SIZE): the key loop loads the
    page ids of that many pages ahead of their tiles, so its tile loads pipeline
    (`triton_decode_tiles.attend_key_windows`); 0: each tile loads its page ids."""
    block = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    if DECODE:
        seq = block
        first = block * 0
    else:
        seq = tl.load(block_seq_ptr + block)
        first = tl.load(block_first_ptr + block)
    q_start = tl.load(query_start_ptr + seq)
    q_len = tl.load(query_start_ptr + seq + 1) - q_start
    ctx = tl.load(context_lens_ptr + seq)

    rows = tl.arange(0, BLOCK_M)
    token = first + rows // G_PAD
    head_in_group = rows % G_PAD
    row_valid = (token < q_len) & (head_in_group < G) & (rows < BLOCK_Q * G_PAD)
    head = kv_head * G + head_in_group
    position = ctx - q_len + token
    dims = tl.arange(0, HEAD_PAD)
    q_rows = (q_start + token).to(tl.int64) * stride_qt + head * stride_qh
    q = load_scaled_queries(q_ptr, q_rows, row_valid, dims, rot_ptr, scale_log2, K_BITS,
                            HEAD_DIM, BLOCK_M, HEAD_PAD)

    last_token = tl.minimum(first + BLOCK_Q, q_len)
    kv_end = ctx - q_len + last_token
    if REMAINDER:
        kv_begin = tl.load(kv_start_ptr + seq)
    else:
        kv_begin = ctx * 0
    chunk = tl.cdiv(tl.cdiv(kv_end - kv_begin, NUM_SPLITS), BLOCK_N) * BLOCK_N
    kv_lo = kv_begin + split * chunk
    kv_hi = tl.minimum(kv_lo + chunk, kv_end)
    table_row = page_table_ptr + seq.to(tl.int64) * stride_pt
    if WRITE_STEP:
        store_step_row(step_k_ptr, step_v_ptr, stride_skt, stride_skh, stride_svt, stride_svh,
                       slot_ptr, num_slots, q_start.to(tl.int64),
                       (kv_lo < kv_end) & (kv_end <= kv_hi), kv_head, dims, k_ptr, v_ptr,
                       stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh,
                       PAGE_SIZE, HEAD_DIM)
    step_start = ctx - q_len
    near_lo = step_start + first - WINDOW + 1
    if WINDOW > 0:
        seq_slot = tl.load(seq_slots_ptr + seq)
        ring_base = tl.where(seq_slot >= 0, seq_slot * WINDOW, -1)
    else:
        ring_base = ctx * 0 - 1
    m_i, l_i, acc = initial_state(BLOCK_M, HEAD_PAD)
    # Keys below near_lo are never read exactly: the bulk of the range runs without the
    # window's per-block work, the last block or two with it.
    if WINDOW > 0:
        window_lo = (tl.maximum(near_lo, 0) // BLOCK_N) * BLOCK_N
        bulk_hi = tl.minimum(kv_hi, tl.maximum(kv_lo, window_lo))
    else:
        bulk_hi = kv_hi
    m_i, l_i, acc = attend_keys(
        q, m_i, l_i, acc, table_row, kv_lo, bulk_hi, position, kv_head, dims,
        k_ptr, v_ptr, stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh,
        ks_ptr, vs_ptr, stride_ksp, stride_kss, stride_ksh, stride_vsp, stride_vss, stride_vsh,
        head_k_ptr, head_v_ptr, stride_er, stride_eh, ring_pos_ptr, ring_base, step_start,
        near_lo,
        BLOCK_M, BLOCK_N, HEAD_DIM, HEAD_PAD, PAGE_SIZE, K_BITS, V_BITS, HEADS, 0, DOT_PRECISION,
        PAGE_WINDOW)
    if WINDOW > 0:
        m_i, l_i, acc = attend_keys(
            q, m_i, l_i, acc, table_row, bulk_hi, kv_hi, position, kv_head, dims,
            k_ptr, v_ptr, stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh,
            ks_ptr, vs_ptr, stride_ksp, stride_kss, stride_ksh, stride_vsp, stride_vss,
            stride_vsh, head_k_ptr, head_v_ptr, stride_er, stride_eh, ring_pos_ptr, ring_base,
            step_start, near_lo,
            BLOCK_M, BLOCK_N, HEAD_DIM, HEAD_PAD, PAGE_SIZE, K_BITS, V_BITS, HEADS, WINDOW,
            DOT_PRECISION, PAGE_WINDOW)
    if WINDOW > 0:
        if split == NUM_SPLITS - 1:
            m_i, l_i, acc = attend_exact_rows(
                q, m_i, l_i, acc, tl.maximum(near_lo, 0), kv_end, position, kv_head, dims,
                fresh_k_ptr, fresh_v_ptr, ring_k_ptr, ring_v_ptr, ring_pos_ptr, stride_er,
                stride_eh, ring_base, step_start, q_start, BLOCK_N, HEAD_DIM, WINDOW,
                DOT_PRECISION)
    acc = normalized_rows(acc, l_i, rot_ptr, V_BITS, BLOCK_M, HEAD_PAD)
    out_token = (q_start + token).to(tl.int64)
    if WRITE_PARTIALS:
        # Partials: [T, H, NUM_SPLITS, HEAD_PAD] and log2-sum-exp [T, H, NUM_SPLITS].
        part_row = (out_token * tl.num_programs(1) * G + head) * NUM_SPLITS + split
        tl.store(part_out_ptr + part_row[:, None] * HEAD_PAD + dims[None, :], acc,
                 mask=row_valid[:, None])
        tl.store(part_lse_ptr + part_row, log2_sum_exp(m_i, l_i), mask=row_valid)
        if MERGE:
            # Splits past the last non-empty one hold no key; the window's exact rows are
            # attended by the last split, so then all are read.
            if WINDOW > 0:
                splits_read = NUM_SPLITS
            else:
                splits_read = tl.cdiv(kv_end - kv_begin, tl.maximum(chunk, 1))
            count_in_and_merge(
                counter_ptr + seq * tl.num_programs(1) + kv_head, part_out_ptr, part_lse_ptr,
                out_ptr, q_start.to(tl.int64) * stride_ot, stride_oh,
                (q_start.to(tl.int64) * tl.num_programs(1) + kv_head) * G, kv_head * G,
                splits_read, NUM_SPLITS, G, G_PAD, SPLIT_BLOCK, HEAD_DIM, HEAD_PAD)
    else:
        o_ptrs = out_ptr + (out_token * stride_ot + head * stride_oh)[:, None] + dims[None, :]
        tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty),
                 mask=row_valid[:, None] & (dims < HEAD_DIM)[None, :])


@triton.jit
def combine_splits_kernel(part_out_ptr, part_lse_ptr, out_ptr, stride_ot, stride_oh,
                          num_heads, NUM_SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr,
                          HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr):
    """Grid (tokens, heads): merge the split partials of one query row into the output."""
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    splits = tl.arange(0, SPLITS_PAD)
    dims = tl.arange(0, HEAD_PAD)
    row = (token * num_heads + head) * NUM_SPLITS
    lse = tl.load(part_lse_ptr + row + splits, mask=splits < NUM_SPLITS, other=float("-inf"))
    top = tl.max(lse, 0)
    weight = tl.exp2(lse - top)
    parts = tl.load(part_out_ptr + (row + splits)[:, None] * HEAD_PAD + dims[None, :],
                    mask=(splits < NUM_SPLITS)[:, None], other=0.0)
    out = tl.sum(parts * weight[:, None], 0) / tl.sum(weight, 0)
    tl.store(out_ptr + token * stride_ot + head * stride_oh + dims,
             out.to(out_ptr.dtype.element_ty), mask=dims < HEAD_DIM)


def launch_combine(parts: torch.Tensor, lse: torch.Tensor, out: torch.Tensor, splits: int,
                   head_dim: int, head_pad: int) -> None:
    """`combine_splits_kernel` over the partials ``parts`` [T, H, splits, head_pad] and ``lse``
    [T, H, splits] of a decode launch, into ``out`` [T, H, head_dim]."""
    num_tokens, num_heads = out.shape[0], out.shape[1]
    combine_splits_kernel[(num_tokens, num_heads)](
        parts, lse, out, out.stride(0), out.stride(1), num_heads,
        NUM_SPLITS=splits, SPLITS_PAD=1 << (splits - 1).bit_length(), HEAD_DIM=head_dim,
        HEAD_PAD=head_pad, num_warps=4,
    )
