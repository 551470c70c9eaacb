"""Triton kernels of shared-prefix ("cascade") decode attention (`triton_cascade` launches them).

A group is decodes whose page tables begin with the same pages (`shared_prefix`). Its query rows
are members x ``G`` query heads of one KV head; `shared_prefix_kernel` attends a block of those
rows to the group's shared keys in one pass, so each shared key and value is read once per row
block instead of once per member, and the rows of a block share every ``tl.dot`` (a decode of
one sequence has only ``G`` rows). The shared prefix is also split along the context, so one or
a few groups still fill the GPU. Each split writes a partial output and its log2-sum-exp per
row, as the split-K decode does.

Each member's own keys (after the prefix) are attended by
`triton_kernels.paged_attention_kernel` with ``REMAINDER``; `merge_cascade_kernel` then merges,
for every query row, the remainder's partials with its group's prefix partials by log-sum-exp.
Sequences in no group pass through the same merge with their remainder partials alone.

Float and quantized pages are read by the same helpers as the plain kernel (`_load_rows`).
`prefix_tiles_kernel` is the same pass for float pages with the per-key work taken out of its
loop (one page id per tile, no masks, offsets from one scalar base): the launch
(`triton_cascade`) prefers it wherever its tile divides the page size.
"""

from __future__ import annotations

import triton
import triton.language as tl

from dyngen_core.kv.attention.triton.key_loop import (
    attend_key_range,
    initial_state,
    load_scaled_queries,
    log2_sum_exp,
    normalized_rows,
    tile_page,
    window_ids,
    window_keys,
)


# As `paged_attention_kernel`: the page table width follows the batch outside CUDA graphs.
@triton.jit(do_not_specialize=["stride_pt"])
def shared_prefix_kernel(
    q_ptr, stride_qt, stride_qh,
    k_ptr, v_ptr, stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh,
    ks_ptr, vs_ptr, stride_ksp, stride_kss, stride_ksh, stride_vsp, stride_vss, stride_vsh,
    rot_ptr,
    page_table_ptr, stride_pt, context_lens_ptr, query_start_ptr,
    member_seq_ptr, group_end_ptr, group_prefix_ptr, block_group_ptr, block_first_ptr,
    num_blocks_ptr,
    part_out_ptr, part_lse_ptr,
    scale_log2,
    G: tl.constexpr, G_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr, PAGE_SIZE: tl.constexpr,
    K_BITS: tl.constexpr, V_BITS: tl.constexpr, NUM_SPLITS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Grid (programs, kv heads, splits): blocks of a group's members, each against one split of
    the group's shared keys; program i takes blocks i, i + programs, ... below ``num_blocks``.

    member_seq [M]: the batch sequence of each member, groups one after another.
    group_end [groups]: one past each group's last member in ``member_seq``.
    group_prefix [groups]: shared keys of each group (whole pages).
    block_group, block_first [row blocks]: the group of a block and its first member; a block
        holds up to ``BLOCK_M // G_PAD`` members of one group, row = member * G_PAD + head.
    num_blocks [1]: the row blocks in use (the tables may be longer: static graph buffers).
    Writes partials [M, H, NUM_SPLITS, HEAD_PAD] (float32) and log2-sum-exp [M, H, NUM_SPLITS].
    """
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    # A fixed grid (CUDA graphs) may have fewer programs than blocks: each takes every
    # num_programs(0)-th block; an eager grid has one program per block.
    num_blocks = tl.load(num_blocks_ptr)
    for block in range(tl.program_id(0), num_blocks, tl.num_programs(0)):
        group = tl.load(block_group_ptr + block)
        first = tl.load(block_first_ptr + block)
        end = tl.load(group_end_ptr + group)
        prefix = tl.load(group_prefix_ptr + group)

        rows = tl.arange(0, BLOCK_M)
        member = first + rows // G_PAD
        head_in_group = rows % G_PAD
        row_valid = (member < end) & (head_in_group < G)
        head = kv_head * G + head_in_group
        seq = tl.load(member_seq_ptr + member, mask=row_valid, other=0)
        # Every prefix key is visible to every member (the planner's rule); the mask keeps
        # it exact.
        position = tl.load(context_lens_ptr + seq, mask=row_valid, other=0) - 1
        token = tl.load(query_start_ptr + seq, mask=row_valid, other=0)
        dims = tl.arange(0, HEAD_PAD)
        q_rows = token.to(tl.int64) * stride_qt + head * stride_qh
        q = load_scaled_queries(q_ptr, q_rows, row_valid, dims, rot_ptr, scale_log2, K_BITS,
                                HEAD_DIM, BLOCK_M, HEAD_PAD)

        chunk = tl.cdiv(tl.cdiv(prefix, NUM_SPLITS), BLOCK_N) * BLOCK_N
        kv_lo = split * chunk
        kv_hi = tl.minimum(kv_lo + chunk, prefix)
        # Members share the prefix's page ids, so the first member's page-table row serves all.
        leader = tl.load(member_seq_ptr + first)
        table_row = page_table_ptr + leader.to(tl.int64) * stride_pt
        # Shared prefixes are planned over unquantized pages only: no head rows, no window.
        m_i, l_i, acc = initial_state(BLOCK_M, HEAD_PAD)
        m_i, l_i, acc = attend_key_range(
            q, m_i, l_i, acc, table_row, kv_lo, kv_hi, position, kv_head, dims,
            k_ptr, v_ptr, stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh,
            ks_ptr, vs_ptr, stride_ksp, stride_kss, stride_ksh, stride_vsp, stride_vss, stride_vsh,
            k_ptr, v_ptr, 0, 0, table_row, -1, 0, 0,
            BLOCK_M, BLOCK_N, HEAD_DIM, HEAD_PAD, PAGE_SIZE, K_BITS, V_BITS, False, 0,
            DOT_PRECISION)
        acc = normalized_rows(acc, l_i, rot_ptr, V_BITS, BLOCK_M, HEAD_PAD)
        part_row = (member.to(tl.int64) * tl.num_programs(1) * G + head) * NUM_SPLITS + split
        tl.store(part_out_ptr + part_row[:, None] * HEAD_PAD + dims[None, :], acc,
                 mask=row_valid[:, None])
        tl.store(part_lse_ptr + part_row, log2_sum_exp(m_i, l_i), mask=row_valid)


@triton.jit
def merge_cascade_kernel(rem_out_ptr, rem_lse_ptr, pre_out_ptr, pre_lse_ptr, seq_member_ptr,
                         out_ptr, stride_ot, stride_oh, num_heads,
                         REM_SPLITS: tl.constexpr, REM_PAD: tl.constexpr,
                         PRE_SPLITS: tl.constexpr, PRE_PAD: tl.constexpr,
                         HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr):
    """Grid (decode tokens, heads): the output of one query row from its remainder partials
    [T, H, REM_SPLITS, HEAD_PAD] and, for a group member (``seq_member[token] >= 0``), its
    prefix partials [M, H, PRE_SPLITS, HEAD_PAD], weighted by their log2-sum-exp."""
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    member = tl.load(seq_member_ptr + token).to(tl.int64)
    in_group = member >= 0
    dims = tl.arange(0, HEAD_PAD)

    rem = tl.arange(0, REM_PAD)
    rem_valid = rem < REM_SPLITS
    rem_row = (token * num_heads + head) * REM_SPLITS + rem
    rem_lse = tl.load(rem_lse_ptr + rem_row, mask=rem_valid, other=float("-inf"))
    pre = tl.arange(0, PRE_PAD)
    pre_valid = (pre < PRE_SPLITS) & in_group
    pre_row = (tl.maximum(member, 0) * num_heads + head) * PRE_SPLITS + pre
    pre_lse = tl.load(pre_lse_ptr + pre_row, mask=pre_valid, other=float("-inf"))

    top = tl.maximum(tl.max(rem_lse, 0), tl.max(pre_lse, 0))
    rem_weight = tl.exp2(rem_lse - top)
    pre_weight = tl.exp2(pre_lse - top)
    rem_parts = tl.load(rem_out_ptr + rem_row[:, None] * HEAD_PAD + dims[None, :],
                        mask=rem_valid[:, None], other=0.0)
    pre_parts = tl.load(pre_out_ptr + pre_row[:, None] * HEAD_PAD + dims[None, :],
                        mask=pre_valid[:, None], other=0.0)
    total = tl.sum(rem_parts * rem_weight[:, None], 0) + tl.sum(pre_parts * pre_weight[:, None], 0)
    out = total / (tl.sum(rem_weight, 0) + tl.sum(pre_weight, 0))
    tl.store(out_ptr + token * stride_ot + head * stride_oh + dims,
             out.to(out_ptr.dtype.element_ty), mask=dims < HEAD_DIM)


@triton.jit
def _page_tile(ptr, slot, slots, stride_s, dims, HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr):
    """Rows ``slot + slots`` (stride ``stride_s`` elements) of the page and head at ``ptr``,
    [BLOCK_N, HEAD_PAD]; columns past HEAD_DIM read as 0 (masked only when the head is padded,
    so a full head loads with no mask at all). The offsets depend on ``slot``, so the compiler
    recomputes them per tile instead of holding a hoisted [BLOCK_N, HEAD_PAD] int32 offset
    tile in registers across the loop (64 registers a thread at 64 x 128 and 8 warps)."""
    offsets = ((slot + slots) * stride_s)[:, None] + dims[None, :]
    if HEAD_DIM == HEAD_PAD:
        tile = tl.load(ptr + offsets)
    else:
        tile = tl.load(ptr + offsets, mask=(dims < HEAD_DIM)[None, :], other=0.0)
    return tile


@triton.jit
def _tile_step(q, m_i, l_i, acc, k_base, v_base, slot, stride_ks, stride_vs, scale_log2, dims,
               slots, HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr,
               DOT_PRECISION: tl.constexpr):
    """The online softmax over one tile: keys ``slot + slots`` of the page and head at
    ``k_base`` / ``v_base``; the scale multiplies the fp32 scores (q stays the dot operand)."""
    k = _page_tile(k_base, slot, slots, stride_ks, dims, HEAD_DIM, HEAD_PAD)
    scores = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=DOT_PRECISION)
    m_new = tl.maximum(m_i, tl.max(scores, 1) * scale_log2)
    p = tl.exp2(scores * scale_log2 - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    v = _page_tile(v_base, slot, slots, stride_vs, dims, HEAD_DIM, HEAD_PAD)
    acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype),
                                        input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def _window_tiles(q, m_i, l_i, acc, table_row, kv_lo, kv_hi, k_head, v_head, stride_ks,
                  stride_vs, stride_kp, stride_vp, scale_log2, dims, slots,
                  WINDOW: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
                  HEAD_PAD: tl.constexpr, PAGE_SIZE: tl.constexpr,
                  DOT_PRECISION: tl.constexpr):
    """`_tile_step` over keys [kv_lo, kv_hi) (whole tiles), the page ids of each WINDOW pages
    loaded as one vector first (`triton_page_window`)."""
    for first_page in range(kv_lo // PAGE_SIZE, tl.cdiv(kv_hi, PAGE_SIZE), WINDOW):
        ids = window_ids(table_row, first_page, kv_hi, PAGE_SIZE, WINDOW)
        lo, hi = window_keys(first_page, kv_lo, kv_hi, PAGE_SIZE, WINDOW)
        for n0 in range(lo, hi, BLOCK_N):
            page = tile_page(ids, first_page, n0, PAGE_SIZE, WINDOW)
            m_i, l_i, acc = _tile_step(
                q, m_i, l_i, acc, k_head + page * stride_kp, v_head + page * stride_vp,
                n0 % PAGE_SIZE, stride_ks, stride_vs, scale_log2, dims, slots, HEAD_DIM,
                HEAD_PAD, DOT_PRECISION)
    return m_i, l_i, acc


# As `paged_attention_kernel`: the page table width follows the batch outside CUDA graphs.
@triton.jit(do_not_specialize=["stride_pt"])
def prefix_tiles_kernel(
    q_ptr, stride_qt, stride_qh,
    k_ptr, v_ptr, stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh,
    page_table_ptr, stride_pt, query_start_ptr,
    member_seq_ptr, group_end_ptr, group_prefix_ptr, block_group_ptr, block_first_ptr,
    num_blocks_ptr,
    part_out_ptr, part_lse_ptr,
    scale_log2,
    G: tl.constexpr, G_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr, PAGE_SIZE: tl.constexpr,
    DOT_PRECISION: tl.constexpr, WINDOW: tl.constexpr = 0,
):
    """`shared_prefix_kernel` for float pages, with nothing in its key loop but the two dots,
    the online softmax and two unmasked tile loads. Same grid, tables and partials (its split
    count is the grid's third axis, so a new count does not compile a new kernel).

    What lets the loop drop the general kernel's work: a prefix is whole pages that every
    member sees entirely (`shared_prefix`'s rule), and ``PAGE_SIZE % BLOCK_N == 0`` (the
    launch's duty), so every tile of BLOCK_N keys is valid for every row and lies in one page:
    one page id per tile instead of one per key, one scalar base plus a fixed offset tile
    instead of per-key 64-bit address arithmetic, no key or visibility mask. The queries go to
    the first dot as loaded (the softmax scale multiplies the fp32 scores instead), so they
    stay in shared memory as the tensor cores' operand: scaled in registers first, they were
    reloaded from shared memory every step and held 47 more registers a thread (ptxas, sm_90,
    128 rows x 8 warps: 240 -> 193; 64 rows x 8 warps: 127, two programs a multiprocessor).

    WINDOW > 0 (a power of two): the page ids of WINDOW pages are loaded as one vector ahead of
    those pages' tiles (`_window_tiles`). Loading each tile's page id inside the key loop makes
    the tile's address depend on a load of the same loop, and Triton's pipeliner (3.6, sm_90)
    then waits for every copy in flight at the top of each step (``async_wait {num = 0}`` in
    its TTGIR); with the ids picked out of a vector by a masked sum the copies stay in flight.
    """
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    num_splits = tl.num_programs(2)
    num_heads = tl.num_programs(1) * G
    rows = tl.arange(0, BLOCK_M)
    dims = tl.arange(0, HEAD_PAD)
    slots = tl.arange(0, BLOCK_N)
    head_in_group = rows % G_PAD
    head = kv_head * G + head_in_group
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
        m_i, l_i, acc = initial_state(BLOCK_M, HEAD_PAD)
        if WINDOW == 0:
            for n0 in range(kv_lo, kv_hi, BLOCK_N):
                page = tl.load(table_row + n0 // PAGE_SIZE).to(tl.int64)
                m_i, l_i, acc = _tile_step(
                    q, m_i, l_i, acc, k_ptr + page * stride_kp + kv_head * stride_kh,
                    v_ptr + page * stride_vp + kv_head * stride_vh, n0 % PAGE_SIZE, stride_ks,
                    stride_vs, scale_log2, dims, slots, HEAD_DIM, HEAD_PAD, DOT_PRECISION)
        else:
            m_i, l_i, acc = _window_tiles(
                q, m_i, l_i, acc, table_row, kv_lo, kv_hi, k_ptr + kv_head * stride_kh,
                v_ptr + kv_head * stride_vh, stride_ks, stride_vs, stride_kp, stride_vp,
                scale_log2, dims, slots, WINDOW, BLOCK_N, HEAD_DIM, HEAD_PAD, PAGE_SIZE,
                DOT_PRECISION)
        acc = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        part_row = (member.to(tl.int64) * num_heads + head) * num_splits + split
        tl.store(part_out_ptr + part_row[:, None] * HEAD_PAD + dims[None, :], acc,
                 mask=row_valid[:, None])
        tl.store(part_lse_ptr + part_row, log2_sum_exp(m_i, l_i), mask=row_valid)
