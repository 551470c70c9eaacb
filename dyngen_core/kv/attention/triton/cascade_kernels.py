"""Triton kernels of shared-prefix ("cascade") decode attention: two passes a layer.

A group is decodes whose page tables begin with the same pages (`engine.cascade`). Its query
rows are members x ``G`` query heads of one KV head.

1. The prefix pass attends a block of a group's rows to the group's shared keys, so each shared
   key and value is read once per row block instead of once per member, and the rows of a block
   share every ``tl.dot`` (a decode of one sequence has only ``G`` rows). The prefix is also
   split along the context, so one or a few groups still fill the GPU; each split writes a
   partial output and its log2-sum-exp per row. `prefix_tiles_kernel` serves float pages whose
   page size its key tile divides (nothing per key in its loop); `shared_prefix_kernel` is the
   general form (any page format and tile, through the plain kernel's key loop).
2. The own-keys pass (`own_keys_kernel`) attends each sequence's keys after its group's prefix
   (all of them for a sequence in no group), folds its group member's prefix partials into its
   running softmax state and writes the output. Split along the context, each split writes its
   partial and the last split program of each (sequence, KV head) to count in merges them, as
   the plain decode's in-kernel merge does (`merge.count_in_and_merge`: the barrier, the
   acquire-release count and ``.cg`` loads are the same protocol).

`cascade_path` launches them and documents the group tables they read.
"""

from __future__ import annotations

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
from dyngen_core.kv.attention.triton.merge import fold_partials
from dyngen_core.ops.triton_support import tl, triton


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

        kv_lo, kv_hi, table_row = _split_keys(prefix, split, NUM_SPLITS, first, member_seq_ptr,
                                              page_table_ptr, stride_pt, BLOCK_N)
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
def _split_keys(prefix, split, num_splits, first, member_seq_ptr, page_table_ptr, stride_pt,
                BLOCK_N: tl.constexpr):
    """The keys [kv_lo, kv_hi) of a group's ``prefix`` shared keys that split ``split`` of
    ``num_splits`` attends (whole BLOCK_N tiles; empty for late splits of a short prefix), and
    the group's page-table row: members share the prefix's page ids, so the row of its first
    member (``first`` in ``member_seq``) serves all."""
    chunk = tl.cdiv(tl.cdiv(prefix, num_splits), BLOCK_N) * BLOCK_N
    kv_lo = split * chunk
    kv_hi = tl.minimum(kv_lo + chunk, prefix)
    leader = tl.load(member_seq_ptr + first)
    return kv_lo, kv_hi, page_table_ptr + leader.to(tl.int64) * stride_pt


@triton.jit
def _page_tile(ptr, slot, slots, stride_s, dims, HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr):
    """Rows ``slot + slots`` (stride ``stride_s`` elements) of the page and head at ``ptr``,
    [BLOCK_N, HEAD_PAD]; columns past HEAD_DIM read as 0 (masked only when the head is padded,
    so a full head loads with no mask at all). The offsets depend on ``slot``, so the compiler
    recomputes them per tile instead of holding a hoisted [BLOCK_N, HEAD_PAD] int32 offset
    tile in registers across the loop."""
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
    DOT_PRECISION: tl.constexpr,
):
    """`shared_prefix_kernel` for float pages, with nothing in its key loop but the two dots,
    the online softmax and two unmasked tile loads. Same grid, tables and partials (its split
    count is the grid's third axis, so a new count does not compile a new kernel).

    What lets the loop drop the general kernel's work: a prefix is whole pages that every
    member sees entirely (the planner's rule), and ``PAGE_SIZE % BLOCK_N == 0`` (the launch's
    duty), so every tile of BLOCK_N keys is valid for every row and lies in one page: one page
    id per tile instead of one per key, one scalar base plus a fixed offset tile instead of
    per-key 64-bit address arithmetic, no key or visibility mask. The queries go to the first
    dot as loaded (the softmax scale multiplies the fp32 scores instead), so they stay in
    shared memory as the tensor cores' operand instead of being held, scaled, in registers.
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
        kv_lo, kv_hi, table_row = _split_keys(prefix, split, num_splits, first, member_seq_ptr,
                                              page_table_ptr, stride_pt, BLOCK_N)
        m_i, l_i, acc = initial_state(BLOCK_M, HEAD_PAD)
        for n0 in range(kv_lo, kv_hi, BLOCK_N):
            page = tl.load(table_row + n0 // PAGE_SIZE).to(tl.int64)
            m_i, l_i, acc = _tile_step(
                q, m_i, l_i, acc, k_ptr + page * stride_kp + kv_head * stride_kh,
                v_ptr + page * stride_vp + kv_head * stride_vh, n0 % PAGE_SIZE, stride_ks,
                stride_vs, scale_log2, dims, slots, HEAD_DIM, HEAD_PAD, DOT_PRECISION)
        acc = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        part_row = (member.to(tl.int64) * num_heads + head) * num_splits + split
        tl.store(part_out_ptr + part_row[:, None] * HEAD_PAD + dims[None, :], acc,
                 mask=row_valid[:, None])
        tl.store(part_lse_ptr + part_row, log2_sum_exp(m_i, l_i), mask=row_valid)


@triton.jit
def own_keys_windowed(q, m_i, l_i, acc, table_row, kv_lo, kv_hi, k_base, v_base, stride_kp,
                      stride_ks, stride_vp, stride_vs, dims, WINDOW: tl.constexpr,
                      BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr,
                      PAGE_SIZE: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """`attend_key_range` for keys [kv_lo, kv_hi) that every row sees, ``kv_lo`` a multiple
    of BLOCK_N counted from a page start and BLOCK_N dividing PAGE_SIZE (so no tile straddles
    a page): one page id per tile, picked out of a vector of ``WINDOW`` ids loaded before the
    window's tiles (`page_window`: no load in the tile loop feeds an address, so the pipeliner
    keeps tile copies in flight). ``q`` is scaled (`load_scaled_queries`)."""
    slots = tl.arange(0, BLOCK_N)
    for first_page in range(kv_lo // PAGE_SIZE, tl.cdiv(kv_hi, PAGE_SIZE), WINDOW):
        ids = window_ids(table_row, first_page, kv_hi, PAGE_SIZE, WINDOW)
        lo, hi = window_keys(first_page, kv_lo, kv_hi, PAGE_SIZE, WINDOW)
        for n0 in range(lo, hi, BLOCK_N):
            page = tile_page(ids, first_page, n0, PAGE_SIZE, WINDOW)
            rows = n0 % PAGE_SIZE + slots
            key_valid = n0 + slots < hi
            mask = key_valid[:, None] & (dims < HEAD_DIM)[None, :]
            k = tl.load(k_base + page * stride_kp + (rows * stride_ks)[:, None] + dims[None, :],
                        mask=mask, other=0.0)
            scores = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=DOT_PRECISION)
            scores = tl.where(key_valid[None, :], scores, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(scores, 1))
            p = tl.exp2(scores - m_new[:, None])
            alpha = tl.exp2(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(v_base + page * stride_vp + (rows * stride_vs)[:, None] + dims[None, :],
                        mask=mask, other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype),
                                                input_precision=DOT_PRECISION)
            m_i = m_new
    return m_i, l_i, acc


# As `paged_attention_kernel`: the page table width follows the batch outside CUDA graphs;
# the prefix split count follows the lengths in eager forwards.
@triton.jit(do_not_specialize=["stride_pt", "pre_splits"])
def own_keys_kernel(
    q_ptr, stride_qt, stride_qh,
    k_ptr, v_ptr, stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh,
    page_table_ptr, stride_pt, context_lens_ptr, query_start_ptr, kv_start_ptr,
    seq_member_ptr, pre_out_ptr, pre_lse_ptr, pre_splits,
    rem_out_ptr, rem_lse_ptr, counter_ptr,
    out_ptr, stride_ot, stride_oh,
    scale_log2,
    G: tl.constexpr, G_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr, PAGE_SIZE: tl.constexpr,
    SPLIT: tl.constexpr, SPLIT_BLOCK: tl.constexpr, DOT_PRECISION: tl.constexpr,
    WINDOW: tl.constexpr = 0,
):
    """Grid (decode sequences, KV heads, splits): one decode token's ``G`` query heads of one
    KV head against its own keys [kv_start[seq], context), merged with its group's prefix.

    seq_member [B]: the sequence's row in the prefix partials [members, H, pre_splits,
        HEAD_PAD] (``pre_out``) and their log2-sum-exp (``pre_lse``), -1 in no group.
    SPLIT (several splits): each split writes its partial to ``rem_out`` [B, H, splits,
        HEAD_PAD] / ``rem_lse`` and counts in at ``counter_ptr[seq * kv_heads + kv_head]``
        (zero between launches); the last one merges. Without SPLIT the grid has one split and
        the program writes the output directly (``rem_*`` and counters are never read).
    WINDOW > 0: the own keys through `own_keys_windowed` (BLOCK_N must divide PAGE_SIZE;
        own keys start at a page: a group's prefix is whole pages)."""
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    num_splits = tl.num_programs(2)
    num_heads = tl.num_programs(1) * G
    q_start = tl.load(query_start_ptr + seq).to(tl.int64)
    ctx = tl.load(context_lens_ptr + seq)
    rows = tl.arange(0, BLOCK_M)
    head_in_group = rows % G_PAD
    row_valid = (rows < G_PAD) & (head_in_group < G)
    head = kv_head * G + head_in_group
    dims = tl.arange(0, HEAD_PAD)
    q = load_scaled_queries(q_ptr, q_start * stride_qt + head * stride_qh, row_valid, dims,
                            q_ptr, scale_log2, 0, HEAD_DIM, BLOCK_M, HEAD_PAD)
    kv_begin = tl.load(kv_start_ptr + seq)
    chunk = tl.cdiv(tl.cdiv(ctx - kv_begin, num_splits), BLOCK_N) * BLOCK_N
    kv_lo = kv_begin + split * chunk
    kv_hi = tl.minimum(kv_lo + chunk, ctx)
    table_row = page_table_ptr + seq.to(tl.int64) * stride_pt
    position = ctx - 1 + rows * 0
    m_i, l_i, acc = initial_state(BLOCK_M, HEAD_PAD)
    if WINDOW > 0:
        m_i, l_i, acc = own_keys_windowed(
            q, m_i, l_i, acc, table_row, kv_lo, kv_hi, k_ptr + kv_head * stride_kh,
            v_ptr + kv_head * stride_vh, stride_kp, stride_ks, stride_vp, stride_vs, dims,
            WINDOW, BLOCK_N, HEAD_DIM, HEAD_PAD, PAGE_SIZE, DOT_PRECISION)
    else:
        m_i, l_i, acc = attend_key_range(
            q, m_i, l_i, acc, table_row, kv_lo, kv_hi, position, kv_head, dims,
            k_ptr, v_ptr, stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh,
            k_ptr, v_ptr, 0, 0, 0, 0, 0, 0,
            k_ptr, v_ptr, 0, 0, table_row, -1, 0, 0,
            BLOCK_M, BLOCK_N, HEAD_DIM, HEAD_PAD, PAGE_SIZE, 0, 0, False, 0, DOT_PRECISION)
    merge = True
    if SPLIT:
        part_row = (seq.to(tl.int64) * num_heads + head) * num_splits
        acc = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(rem_out_ptr + (part_row + split)[:, None] * HEAD_PAD + dims[None, :], acc,
                 mask=row_valid[:, None])
        tl.store(rem_lse_ptr + part_row + split, log2_sum_exp(m_i, l_i), mask=row_valid)
        tl.debug_barrier()  # every thread's partial stores come before the release below
        counter = counter_ptr + seq * tl.num_programs(1) + kv_head
        arrived = tl.atomic_add(counter, 1, sem="acq_rel")
        merge = arrived == num_splits - 1
        if merge:
            m_i, l_i, acc = initial_state(BLOCK_M, HEAD_PAD)
            m_i, l_i, acc = fold_partials(m_i, l_i, acc, rem_out_ptr, rem_lse_ptr, part_row,
                                          num_splits, row_valid, dims, SPLIT_BLOCK, HEAD_PAD)
            tl.store(counter, 0)
    if merge:
        member = tl.load(seq_member_ptr + seq)
        pre_row = (tl.maximum(member, 0).to(tl.int64) * num_heads + head) * pre_splits
        m_i, l_i, acc = fold_partials(m_i, l_i, acc, pre_out_ptr, pre_lse_ptr, pre_row,
                                      tl.where(member >= 0, pre_splits, 0), row_valid, dims,
                                      SPLIT_BLOCK, HEAD_PAD)
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        o_ptrs = out_ptr + (q_start * stride_ot + head * stride_oh)[:, None] + dims[None, :]
        tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty),
                 mask=row_valid[:, None] & (dims < HEAD_DIM)[None, :])


__all__ = ["own_keys_kernel", "own_keys_windowed", "prefix_tiles_kernel",
           "shared_prefix_kernel"]
