"""Decode over 4- and 8-bit quantized pages: the q8/q4 decode kernel (`quant_decode_kernel`), its
programs, and its host launch (`attend_word_decode`).

`TritonPagedBackend` routes decode-only batches over q8/q4 pages here (`word_decode_fits`);
prefill and mixed batches, q6 pages and pages the key block does not divide keep
`decode.paged_attention_kernel`. The launch depends on the batch shape only (grid: sequences x
KV heads x (splits + tail parts)), so it is captured in CUDA graphs; its partials are merged by
`merge.combine_splits_kernel`.

Page blocks, keys on the rows of every tile (queries padded to `query_rows`, not to 16: the
scores are [keys, query rows], the output accumulator [dims, query rows]). Keys enter as integers
(`quant_unpack.integer_scores`): the rotated, scaled query becomes int8 codes with one float32
scale a row and group of 32 dims (`integer_queries`, once per program), a key's group of 32 codes
is one int8 tensor-core dot with them (8-bit codes as stored; 4-bit codes as 16 times the code,
a bit operation on each whole word of 8 codes in inline PTX on CUDA, `signed_nibbles`), and
each group's int32 dot is scaled by the key's and the query's group scales. The query's codes
are its only rounding beyond the cache's own (BENCHMARKS.md, sections 4 and 8). Values (4- and
8-bit) are dequantized to float16 with the exponent trick (float32 for float32 queries) and
joined into whole rows for one dot per block (Triton spreads it over the warps), in the
unpack's pair order with the middle column quarters swapped (no byte permutes, no bank
conflicts in the tile's shared-memory stores), put back in dim order once after the loop.
Running softmax sums are kept per key and reduced once after the loop (no per-block sum across
the warps that split the keys). Each key's row of scales is one vector copy that pipelines
with the code words, and the page programs load their page ids `PAGE_WINDOW` pages ahead of
their blocks.

Exact rows (the rule of `attention.sdpa`'s window reader): the page programs mask slot 0 of
every page and stop at ``bulk_hi``, the recent window's first block (without a window, the block
of the step's own key). What is left, the "tail", is (a) the last one or two blocks [bulk_hi,
ctx) under the window rule, (b) every page's exact head row, (c) the window's exact rows and the
step's fresh rows (windows of up to 16 positions in 16-row tiles). `tail_program` attends them in
one program, one after the other, or in three side by side (`tail_parts_for`); each part writes
one more partial, merged like a split. So the page loop carries no exact-row work at all. The
last tail program may first do the storage's write of its head's rows of this step
(`quant.write.write_token_heads`, the ``write`` of `attend_word_decode`), so the layer runs no
write launch: no other program of the launch reads what it stores. The page programs stop
before the step's key, and so do the other tail parts with a window (whose replaced row held a
position no query of the step reads); without a window the one tail program reads the step's
codes and head row itself, after a barrier.

The launch shapes are module constants that production reads and the kernel benchmarks patch
(benchmarks/kernels/quant_decode.py; figures in BENCHMARKS.md, section 4).
"""

from __future__ import annotations

from typing import Any

import torch

from dyngen_core.kv.attention.base import ForwardBatch
from dyngen_core.kv.attention.triton.decode import (
    ExactOperands,
    decode_splits,
    next_pow2,
    register_cap,
)
from dyngen_core.kv.attention.triton.key_loop import (
    attend_exact_rows,
    attend_page_heads,
    log2_sum_exp,
    rotated_back,
    rotated_queries,
    tile_page,
    window_holds,
    window_ids,
    window_keys,
)
from dyngen_core.kv.attention.triton.merge import launch_combine
from dyngen_core.kv.attention.triton.quant_unpack import (
    dequantized_rows,
    integer_queries,
    integer_scores,
    load_scales,
    load_word_rows,
    swapped_quarters,
    unpaired_columns,
)
from dyngen_core.kv.quant.storage import QuantStorage
from dyngen_core.kv.quant.write import StepQuantWrite, write_token_heads
from dyngen_core.kv.storage import KVStorage
from dyngen_core.ops.triton_support import tl, triton

WORD_BITS = (4, 8)
# tl.dot needs 16 along every dimension: 16 words of codes per tile at least.
MIN_TILE = 16
# Keys per loop step (a divisor of the page size) and warps per program.
BLOCK_N = 64
WARPS = 4
# Query rows a program holds at least (padding a KV head's query heads): 8, the narrowest side
# of a tensor-core dot, where the page blocks put them.
MIN_QUERY_ROWS = 8
# Software-pipelining stages of the key loop (Triton's default).
STAGES = 3
# Page ids the page programs load as one vector ahead of their blocks (a power of two).
PAGE_WINDOW = 4
# Decode batches of at most this many sequences run the page and tail programs in one launch
# (the tail's exact rows then overlap the pages); larger ones in two (`launches_for`).
ONE_LAUNCH_MAX_SEQS = 32


def launches_for(num_seqs: int) -> int:
    """Launches of a decode of ``num_seqs`` sequences: 1 (page and tail programs in one grid)
    up to `ONE_LAUNCH_MAX_SEQS` sequences, else 2 (neither kind's code then takes registers
    from the other)."""
    return 1 if num_seqs <= ONE_LAUNCH_MAX_SEQS else 2


def page_splits(num_seqs: int, num_kv_heads: int, device: torch.device) -> int:
    """Parts each (sequence, KV head)'s keys before the window are split into: in one launch
    (`launches_for`), as many as fill one wave of page programs (`decode_splits` with
    ``one_wave``; the launch is then held at `decode.PROGRAMS_PER_SM` programs a multiprocessor
    by `decode.register_cap`); in two, at least one wave (`decode_splits`), where one split a
    pair lost (BENCHMARKS.md, section 4). From the batch shape only, for CUDA graphs."""
    one_wave = launches_for(num_seqs) == 1
    return decode_splits(num_seqs * num_kv_heads, device, one_wave=one_wave)


def tail_parts_for(window: int, launches: int) -> int:
    """Programs per (sequence, KV head) the tail runs in: 3 side by side when the cache has a
    recent window and the tail has a launch of its own, else 1 (the three phases one after the
    other; without a window (a) and (c) are empty)."""
    return 3 if window > 0 and launches == 2 else 1


def word_decode_fits(batch: ForwardBatch, key_bits: int, value_bits: int,
                     exact: ExactOperands | None) -> bool:
    """Whether `attend_word_decode` serves this attention call: a decode-only batch over q8/q4
    pages (with their exact rows), whose pages hold whole blocks of `BLOCK_N` keys."""
    return (batch.is_decode_only and exact is not None
            and word_pages_fit(key_bits, value_bits, batch.page_size))


def word_pages_fit(key_bits: int, value_bits: int, page_size: int) -> bool:
    """Whether the kernel reads these pages: q8/q4 codes, whole blocks of `BLOCK_N` (at least
    `MIN_TILE`) keys a page."""
    return (key_bits in WORD_BITS and value_bits in WORD_BITS and BLOCK_N >= MIN_TILE
            and page_size % BLOCK_N == 0)


def deferred_word_write(storage: KVStorage, layer: int, key: torch.Tensor,
                        value: torch.Tensor, batch: ForwardBatch) -> StepQuantWrite | None:
    """The storage's write of this step's ``key``/``value`` rows, left to `attend_word_decode`
    (its ``write``), where the batch will take that kernel: a decode-only batch over q8/q4
    pages whose storage writes with Triton (`QuantStorage.deferred_write`), with sequence slots
    where the storage keeps a recent window. The storage then counts the rows as written. None
    (nothing done) elsewhere: the caller writes through the storage."""
    if not isinstance(storage, QuantStorage) or not batch.is_decode_only:
        return None
    if not word_pages_fit(storage.key_format.bits, storage.value_format.bits, batch.page_size):
        return None  # `word_decode_fits` sends the batch elsewhere
    return storage.deferred_write(layer, key, value, batch.slot_mapping, batch.decode_window)


def query_rows(group: int) -> int:
    """Query rows a program holds for a KV head of ``group`` query heads (BLOCK_M): at least
    `MIN_QUERY_ROWS`, a power of two."""
    return max(MIN_QUERY_ROWS, next_pow2(group))


def word_dim_pad(head_dim: int, key_bits: int, value_bits: int) -> int:
    """Columns the kernel works on: a power of two >= head_dim, with >= 16 words per row."""
    return max(next_pow2(head_dim), MIN_TILE * 32 // min(key_bits, value_bits))


def check_scale_rows(page_args: tuple[Any, ...], groups: int) -> None:
    """Raise ValueError unless the scales (`decode.page_arguments`: tensors at 8 and 9,
    strides at 10 to 15) put every row of ``groups`` scales at a multiple of ``groups``
    elements, as the kernel tells Triton (for one vector copy a row)."""
    tensors, strides = page_args[8:10], page_args[10:16]
    aligned = (all(int(stride) % groups == 0 for stride in strides)
               and all(t.data_ptr() % (2 * groups) == 0 for t in tensors))
    if not aligned:
        raise ValueError(f"the q8/q4 decode kernel reads scale rows aligned to {groups} scales; "
                         f"these scales have strides {tuple(strides)} (allocate them as "
                         f"QuantStorage does: head-major [pages, kv_heads, page_size, groups])")


def check_key_rows(page_args: tuple[Any, ...]) -> None:
    """Raise ValueError unless the key codes (`decode.page_arguments`: tensor at 0, strides in
    int32 words at 2 to 4) start every page, slot and KV head row on 16 bytes, as the kernel
    tells Triton (for 16-byte copies of each group's codes)."""
    keys, strides = page_args[0], page_args[2:5]
    assert isinstance(keys, torch.Tensor)
    if any(int(stride) % 4 for stride in strides) or keys.data_ptr() % 16:
        raise ValueError(f"the q8/q4 decode kernel reads key rows aligned to 16 bytes; these "
                         f"codes have strides {tuple(strides)} words (allocate them as "
                         f"QuantStorage does: head-major [pages, kv_heads, page_size, words])")


def attend_word_decode(q: torch.Tensor, page_args: tuple[object, ...], batch: ForwardBatch,
                       exact: ExactOperands, scale_log2: float, *, key_bits: int,
                       value_bits: int, num_kv_heads: int, splits: int,
                       write: StepQuantWrite | None = None) -> torch.Tensor:
    """Attention of the decode queries q [B, H, D] over their q8/q4 pages and exact rows.

    page_args: `decode.page_arguments` of the layer (codes as int32 words, scales, strides,
        rotation).
    scale_log2: softmax scale times log2(e).
    splits: parts the keys before the window are split into (`page_splits`: from the batch
        shape only, for CUDA graphs).
    write: the storage's write of this step's rows, left to this launch
        (`QuantStorage.deferred_write`; one token per sequence): the last tail program of
        each (sequence, KV head) stores its head's codes, scales, head row, exact rows and
        (with a recent window) window row first. With a window, ``exact`` must name the
        write's exact rows as its fresh rows. None: the storage wrote them before.
    """
    if q.shape[0] != batch.num_seqs:
        raise ValueError(f"a decode batch has one query row per sequence: {q.shape[0]} rows "
                         f"for {batch.num_seqs} sequences (word_decode_fits tells which "
                         f"batches this kernel serves)")
    launches = launches_for(batch.num_seqs)
    tail_parts = tail_parts_for(exact.window, launches)
    write_args, write_shape = _write_operands(write, exact, q)
    tokens, num_heads, head_dim = q.shape
    group = num_heads // num_kv_heads
    dim_pad = word_dim_pad(head_dim, key_bits, value_bits)
    check_key_rows(page_args)
    if dim_pad == head_dim:
        check_scale_rows(page_args, head_dim // 32)
    partials = splits + tail_parts
    parts = torch.empty(tokens, num_heads, partials, dim_pad, dtype=torch.float32,
                        device=q.device)
    lse = torch.empty(tokens, num_heads, partials, dtype=torch.float32, device=q.device)
    arguments = (q, q.stride(0), q.stride(1), *page_args,
                 batch.page_table, batch.page_table.stride(0), batch.context_lens,
                 *exact.arguments(), parts, lse, scale_log2, *write_args)
    shape = {"G": group, "BLOCK_M": query_rows(group), "BLOCK_N": BLOCK_N,
             "HEAD_DIM": head_dim, "DIM_PAD": dim_pad, "PAGE_SIZE": batch.page_size,
             "K_BITS": key_bits, "V_BITS": value_bits, "NUM_SPLITS": splits,
             "WINDOW": exact.window,
             "DOT_PRECISION": "ieee" if q.dtype == torch.float32 else "tf32",
             "FAST_UNPACK": q.is_cuda,  # inline PTX: not in the interpreter
             "PAGE_WINDOW": PAGE_WINDOW, "TAIL_PARTS": tail_parts, **write_shape}
    # The tail alone (one or two blocks) keeps the per-block page id load: one compile of it
    # serves every page window.
    grids = [(partials, 0, shape)] if launches == 1 else [
        (splits, 1, shape), (tail_parts, 2, shape | {"PAGE_WINDOW": 0})]
    # One launch holds its page programs in one wave (`page_splits`); two keep the compiler's
    # registers, their programs being smaller than the one launch's.
    cap = register_cap(batch.num_seqs * num_kv_heads * partials, WARPS,
                       q.device) if launches == 1 else None
    for programs, role, constants in grids:
        quant_decode_kernel[(batch.num_seqs, num_kv_heads, programs)](
            *arguments, **constants, PROGRAMS=role, num_warps=WARPS, num_stages=STAGES,
            maxnreg=cap)
    out = torch.empty_like(q)
    launch_combine(parts, lse, out, partials, head_dim, dim_pad)
    return out


def _write_operands(write: StepQuantWrite | None, exact: ExactOperands, q: torch.Tensor
                    ) -> tuple[tuple[object, ...], dict[str, Any]]:
    """`quant_decode_kernel`'s ``w_*`` arguments and W_* constexprs for ``write`` (None:
    placeholders it never reads)."""
    if write is None:
        return (q,) * 5 + (0,) * 4 + (q,) * 6 + (0, 0) + (q,) * 4 + (0, 0), {}
    shape = write.constants
    if exact.window != shape["WINDOW"]:
        raise ValueError(f"a write left to the decode kernel stores a window of "
                         f"{shape['WINDOW']} rows, the exact rows' is {exact.window}: take "
                         f"both from the same storage (QuantStorage.deferred_write)")
    if exact.window and exact.fresh_keys.data_ptr() != write.exact[0].data_ptr():
        raise ValueError("the exact operands' fresh rows must be the write's exact rows: "
                         "build them after QuantStorage.deferred_write")
    return (*write.arguments(), write.num_tokens), {
        "WRITE_STEP": True, "W_HEADS": shape["HEADS"], "W_HAS_OFFSETS": shape["HAS_OFFSETS"],
        "W_ROWS": shape["ROWS"], "W_INV_SQRT": shape["INV_SQRT"]}


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
    part_out_ptr, part_lse_ptr,
    scale_log2,
    w_key_ptr, w_value_ptr, w_slots_ptr, w_offsets_ptr, w_signs_ptr,
    stride_wkt, stride_wkh, stride_wvt, stride_wvh,
    w_key_codes_ptr, w_key_scales_ptr, w_value_codes_ptr, w_value_scales_ptr, w_head_rows_ptr,
    w_exact_ptr, w_num_slots, w_num_pages, w_positions_ptr, w_seq_slots_ptr, w_ring_rows_ptr,
    w_ring_positions_ptr, w_slots_held, w_tokens,
    G: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
    DIM_PAD: tl.constexpr, PAGE_SIZE: tl.constexpr, K_BITS: tl.constexpr,
    V_BITS: tl.constexpr, NUM_SPLITS: tl.constexpr, WINDOW: tl.constexpr,
    DOT_PRECISION: tl.constexpr, PROGRAMS: tl.constexpr, FAST_UNPACK: tl.constexpr,
    PAGE_WINDOW: tl.constexpr, TAIL_PARTS: tl.constexpr,
    WRITE_STEP: tl.constexpr = False, W_HEADS: tl.constexpr = 1,
    W_HAS_OFFSETS: tl.constexpr = False, W_ROWS: tl.constexpr = 1,
    W_INV_SQRT: tl.constexpr = 1.0,
):
    """Grid (sequences, KV heads, NUM_SPLITS + TAIL_PARTS) over a decode-only batch (one query
    token per sequence: sequence i's is token i). Programs with split < NUM_SPLITS share the
    keys before the window's first block; programs NUM_SPLITS + t are the tail's parts t
    (module docstring). Each writes its partial [T, H, NUM_SPLITS + TAIL_PARTS, DIM_PAD] and
    log2-sum-exp [T, H, NUM_SPLITS + TAIL_PARTS] in the float32 buffers. Exact-row operands
    as `decode.paged_attention_kernel`'s (``seq_slots`` unread when WINDOW is 0). PROGRAMS: 0
    runs both kinds in one grid; 1 only the page programs (grid z NUM_SPLITS), 2 only the tail
    (grid z TAIL_PARTS). FAST_UNPACK: unpack in inline PTX (CUDA only). PAGE_WINDOW: the page
    programs load page ids ahead, PAGE_WINDOW pages at a time (a power of two; 0: one id per
    block in the loop); the tail's one or two blocks keep the per-block load.
    WRITE_STEP: the last tail part of each (sequence, KV head) first does the storage's write
    of that head's rows of this step (the ``w_*`` / ``stride_w*`` operands and W_* constexprs:
    `quant.write.StepQuantWrite`, token ``w_tokens`` of the rows)."""
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    if PROGRAMS == 2:
        split = tl.program_id(2) + NUM_SPLITS
    else:
        split = tl.program_id(2)
    # A decode-only batch has one query token per sequence, in order: no load of its index.
    token = seq
    if WRITE_STEP:
        if split == NUM_SPLITS + TAIL_PARTS - 1:
            write_token_heads(
                token.to(tl.int64), w_tokens, kv_head, w_key_ptr, w_value_ptr, w_slots_ptr,
                w_offsets_ptr, w_signs_ptr, stride_wkt, stride_wkh, stride_wvt, stride_wvh,
                w_key_codes_ptr, w_key_scales_ptr, w_value_codes_ptr, w_value_scales_ptr,
                w_head_rows_ptr, w_exact_ptr, w_num_slots, w_num_pages, w_positions_ptr,
                w_seq_slots_ptr, w_ring_rows_ptr, w_ring_positions_ptr, w_slots_held, W_HEADS,
                HEAD_DIM, PAGE_SIZE, K_BITS, V_BITS, W_HAS_OFFSETS, W_ROWS, W_INV_SQRT, WINDOW)
            tl.debug_barrier()  # what it stored (codes, head and fresh rows) before its loads
    ctx = tl.load(context_lens_ptr + seq)
    rows = tl.arange(0, BLOCK_M)
    row_valid = rows < G
    head = kv_head * G + rows
    dims = tl.arange(0, DIM_PAD)
    q = tl.load(q_ptr + token.to(tl.int64) * stride_qt + (head * stride_qh)[:, None]
                + dims[None, :], mask=row_valid[:, None] & (dims < HEAD_DIM)[None, :], other=0.0)
    q_rotated = rotated_queries(q, rot_ptr, scale_log2, BLOCK_M, DIM_PAD)
    q = q_rotated.to(q_ptr.dtype.element_ty)
    qs = integer_queries(q_rotated, BLOCK_M, DIM_PAD, K_BITS)
    if WINDOW > 0:
        seq_slot = tl.load(seq_slots_ptr + seq)
        ring_base = tl.where(seq_slot >= 0, seq_slot * WINDOW, -1)
    else:
        ring_base = ctx * 0 - 1
    # The page programs stop at the block of the window's first key or, without a window, of
    # the step's own key (the tail's, which may write that key first).
    TAIL_KEYS: tl.constexpr = WINDOW if WINDOW > 0 else 1
    bulk_hi = (tl.maximum(ctx - TAIL_KEYS, 0) // BLOCK_N) * BLOCK_N
    table_row = page_table_ptr + seq.to(tl.int64) * stride_pt
    if PROGRAMS == 1:
        m_i, l_i, acc = page_program(
            qs, table_row, split, bulk_hi, kv_head,
            k_ptr, v_ptr, stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh,
            ks_ptr, vs_ptr, stride_ksp, stride_kss, stride_ksh, stride_vsp, stride_vss,
            stride_vsh, BLOCK_M, BLOCK_N, PAGE_SIZE, HEAD_DIM, DIM_PAD, K_BITS, V_BITS,
            NUM_SPLITS, DOT_PRECISION, FAST_UNPACK, PAGE_WINDOW)
    elif PROGRAMS == 2:
        m_i, l_i, acc = tail_program(
            split - NUM_SPLITS, q, qs, table_row, bulk_hi, ctx, token, kv_head, dims,
            k_ptr, v_ptr, stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh,
            ks_ptr, vs_ptr, stride_ksp, stride_kss, stride_ksh, stride_vsp, stride_vss,
            stride_vsh, head_k_ptr, head_v_ptr, ring_k_ptr, ring_v_ptr, ring_pos_ptr,
            fresh_k_ptr, fresh_v_ptr, stride_er, stride_eh, ring_base,
            BLOCK_M, BLOCK_N, PAGE_SIZE, HEAD_DIM, DIM_PAD, K_BITS, V_BITS, WINDOW,
            DOT_PRECISION, FAST_UNPACK, TAIL_PARTS)
    else:
        if split < NUM_SPLITS:
            m_i, l_i, acc = page_program(
                qs, table_row, split, bulk_hi, kv_head,
                k_ptr, v_ptr, stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh,
                ks_ptr, vs_ptr, stride_ksp, stride_kss, stride_ksh, stride_vsp, stride_vss,
                stride_vsh, BLOCK_M, BLOCK_N, PAGE_SIZE, HEAD_DIM, DIM_PAD, K_BITS, V_BITS,
                NUM_SPLITS, DOT_PRECISION, FAST_UNPACK, PAGE_WINDOW)
        else:
            m_i, l_i, acc = tail_program(
                split - NUM_SPLITS, q, qs, table_row, bulk_hi, ctx, token, kv_head, dims,
                k_ptr, v_ptr, stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh,
                ks_ptr, vs_ptr, stride_ksp, stride_kss, stride_ksh, stride_vsp, stride_vss,
                stride_vsh, head_k_ptr, head_v_ptr, ring_k_ptr, ring_v_ptr, ring_pos_ptr,
                fresh_k_ptr, fresh_v_ptr, stride_er, stride_eh, ring_base,
                BLOCK_M, BLOCK_N, PAGE_SIZE, HEAD_DIM, DIM_PAD, K_BITS, V_BITS, WINDOW,
                DOT_PRECISION, FAST_UNPACK, TAIL_PARTS)
    acc = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    acc = rotated_back(acc, rot_ptr, BLOCK_M, DIM_PAD)
    PARTIALS: tl.constexpr = NUM_SPLITS + TAIL_PARTS
    part_row = (token.to(tl.int64) * tl.num_programs(1) * G + head) * PARTIALS + split
    tl.store(part_out_ptr + part_row[:, None] * DIM_PAD + dims[None, :], acc,
             mask=row_valid[:, None])
    tl.store(part_lse_ptr + part_row, log2_sum_exp(m_i, l_i), mask=row_valid)


@triton.jit
def page_program(qs, table_row, split, bulk_hi, kv_head,
                 k_ptr, v_ptr, stride_kp, stride_ks, stride_kh, stride_vp, stride_vs,
                 stride_vh, ks_ptr, vs_ptr, stride_ksp, stride_kss, stride_ksh, stride_vsp,
                 stride_vss, stride_vsh,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr,
                 HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr, K_BITS: tl.constexpr,
                 V_BITS: tl.constexpr, NUM_SPLITS: tl.constexpr,
                 DOT_PRECISION: tl.constexpr, FAST_UNPACK: tl.constexpr,
                 PAGE_WINDOW: tl.constexpr):
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
        FAST_UNPACK, PAGE_WINDOW)


@triton.jit
def tail_program(part, q, qs, table_row, bulk_hi, ctx, token, kv_head, dims,
                 k_ptr, v_ptr, stride_kp, stride_ks, stride_kh, stride_vp, stride_vs,
                 stride_vh, ks_ptr, vs_ptr, stride_ksp, stride_kss, stride_ksh, stride_vsp,
                 stride_vss, stride_vsh, head_k_ptr, head_v_ptr, ring_k_ptr, ring_v_ptr,
                 ring_pos_ptr, fresh_k_ptr, fresh_v_ptr, stride_er, stride_eh, ring_base,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr,
                 HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr, K_BITS: tl.constexpr,
                 V_BITS: tl.constexpr, WINDOW: tl.constexpr, DOT_PRECISION: tl.constexpr,
                 FAST_UNPACK: tl.constexpr, TAIL_PARTS: tl.constexpr):
    """Tail part ``part`` of TAIL_PARTS (1 or 3; module docstring) for the decode query at
    ``ctx - 1``: (m, l, acc) of its keys, ``q`` the query tile (exact rows), ``qs`` its
    int8 codes as the blocks take them (`integer_queries`)."""
    # A window of up to 16 positions is one 16-row tile of exact rows, not a key block.
    ROWS_N: tl.constexpr = 16 if WINDOW <= 16 else BLOCK_N
    position = ctx - 1
    near_lo = ctx - WINDOW
    positions = position + tl.zeros([BLOCK_M], tl.int32)
    if TAIL_PARTS == 1:
        m_i, l_i, acc = _word_range(
            qs, table_row, bulk_hi, ctx, kv_head, k_ptr, v_ptr, stride_kp, stride_ks,
            stride_kh, stride_vp, stride_vs, stride_vh, ks_ptr, vs_ptr, stride_ksp, stride_kss,
            stride_ksh, stride_vsp, stride_vss, stride_vsh, ring_pos_ptr, ring_base, position,
            near_lo, position, BLOCK_M, BLOCK_N, PAGE_SIZE, HEAD_DIM, DIM_PAD, K_BITS, V_BITS,
            WINDOW, DOT_PRECISION, FAST_UNPACK, 0)
        m_i, l_i, acc = attend_page_heads(
            q, m_i, l_i, acc, table_row, tl.cdiv(ctx, PAGE_SIZE), positions, kv_head, dims,
            head_k_ptr, head_v_ptr, stride_er, stride_eh, ring_pos_ptr, ring_base, position,
            near_lo, PAGE_SIZE, BLOCK_N, HEAD_DIM, WINDOW, DOT_PRECISION)
        if WINDOW > 0:
            m_i, l_i, acc = attend_exact_rows(
                q, m_i, l_i, acc, tl.maximum(near_lo, 0), ctx, positions, kv_head, dims,
                fresh_k_ptr, fresh_v_ptr, ring_k_ptr, ring_v_ptr, ring_pos_ptr, stride_er,
                stride_eh, ring_base, position, token, ROWS_N, HEAD_DIM, WINDOW,
                DOT_PRECISION)
    else:
        m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, DIM_PAD], tl.float32)
        if part == 0:
            m_i, l_i, acc = _word_range(
                qs, table_row, bulk_hi, ctx, kv_head, k_ptr, v_ptr, stride_kp, stride_ks,
                stride_kh, stride_vp, stride_vs, stride_vh, ks_ptr, vs_ptr, stride_ksp,
                stride_kss, stride_ksh, stride_vsp, stride_vss, stride_vsh, ring_pos_ptr,
                ring_base, position, near_lo, position, BLOCK_M, BLOCK_N, PAGE_SIZE, HEAD_DIM,
                DIM_PAD, K_BITS, V_BITS, WINDOW, DOT_PRECISION, FAST_UNPACK, 0)
        elif part == 1:
            m_i, l_i, acc = attend_page_heads(
                q, m_i, l_i, acc, table_row, tl.cdiv(ctx, PAGE_SIZE), positions, kv_head,
                dims, head_k_ptr, head_v_ptr, stride_er, stride_eh, ring_pos_ptr, ring_base,
                position, near_lo, PAGE_SIZE, BLOCK_N, HEAD_DIM, WINDOW, DOT_PRECISION)
        elif WINDOW > 0:
            m_i, l_i, acc = attend_exact_rows(
                q, m_i, l_i, acc, tl.maximum(near_lo, 0), ctx, positions, kv_head, dims,
                fresh_k_ptr, fresh_v_ptr, ring_k_ptr, ring_v_ptr, ring_pos_ptr, stride_er,
                stride_eh, ring_base, position, token, ROWS_N, HEAD_DIM, WINDOW,
                DOT_PRECISION)
    return m_i, l_i, acc


@triton.jit
def _word_range(qs, table_row, lo, hi, kv_head,
                k_ptr, v_ptr, stride_kp, stride_ks, stride_kh, stride_vp, stride_vs,
                stride_vh, ks_ptr, vs_ptr, stride_ksp, stride_kss, stride_ksh, stride_vsp,
                stride_vss, stride_vsh, ring_pos_ptr, ring_base, step_start, near_lo,
                position,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr,
                HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr, K_BITS: tl.constexpr,
                V_BITS: tl.constexpr, WINDOW: tl.constexpr, DOT_PRECISION: tl.constexpr,
                FAST_UNPACK: tl.constexpr, PAGE_WINDOW: tl.constexpr):
    """`attend_word_blocks` over keys [lo, hi) from an empty state: (m, l, acc) with the running
    sums reduced and the accumulator back in one [BLOCK_M, DIM_PAD] tile in dim order."""
    V_PER: tl.constexpr = 32 // V_BITS
    m_i, l_i, acc = attend_word_blocks(
        qs, tl.full([BLOCK_M], -1.0e30, tl.float32), tl.zeros([BLOCK_N, BLOCK_M], tl.float32),
        tl.zeros([DIM_PAD, BLOCK_M], tl.float32), table_row, lo, hi, kv_head,
        k_ptr, v_ptr, stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh,
        ks_ptr, vs_ptr, stride_ksp, stride_kss, stride_ksh, stride_vsp, stride_vss, stride_vsh,
        ring_pos_ptr, ring_base, step_start, near_lo, position,
        BLOCK_N, PAGE_SIZE, HEAD_DIM, DIM_PAD, K_BITS, V_BITS, WINDOW, DOT_PRECISION,
        FAST_UNPACK, PAGE_WINDOW)
    l_i = tl.sum(l_i, 0)
    acc = swapped_quarters(tl.trans(acc), BLOCK_M, DIM_PAD)  # undo the blocks' column order
    return m_i, l_i, unpaired_columns(acc, BLOCK_M, DIM_PAD // V_PER, V_PER)


@triton.jit
def attend_word_blocks(qs, m_i, l_i, acc, table_row, lo, hi, kv_head,
                       k_ptr, v_ptr, stride_kp, stride_ks, stride_kh, stride_vp, stride_vs,
                       stride_vh, ks_ptr, vs_ptr, stride_ksp, stride_kss, stride_ksh,
                       stride_vsp, stride_vss, stride_vsh,
                       ring_pos_ptr, ring_base, step_start, near_lo, position,
                       BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr,
                       DIM_PAD: tl.constexpr, K_BITS: tl.constexpr, V_BITS: tl.constexpr,
                       WINDOW: tl.constexpr, DOT_PRECISION: tl.constexpr,
                       FAST_UNPACK: tl.constexpr, PAGE_WINDOW: tl.constexpr):
    """Online softmax of the query codes ``qs`` (`integer_queries`) over keys [lo, hi)
    (block-aligned ``lo``; BLOCK_N divides PAGE_SIZE, so a block lies in one page) of one
    decode query at ``position``, carrying (m_i, l_i, acc); one block is `_word_block`.
    PAGE_WINDOW 0: each block loads its page id at the top of its step; PAGE_WINDOW > 0 (a
    power of two): the ids of PAGE_WINDOW pages are loaded as one vector before the loop over
    those pages' blocks (`key_loop.window_ids`), so no load of the loop feeds an address and
    the code words of later blocks stay in flight."""
    if PAGE_WINDOW > 0:
        for first_page in range(lo // PAGE_SIZE, tl.cdiv(hi, PAGE_SIZE), PAGE_WINDOW):
            ids = window_ids(table_row, first_page, hi, PAGE_SIZE, PAGE_WINDOW)
            start, end = window_keys(first_page, lo, hi, PAGE_SIZE, PAGE_WINDOW)
            for n0 in range(start, end, BLOCK_N):
                page = tile_page(ids, first_page, n0, PAGE_SIZE, PAGE_WINDOW)
                m_i, l_i, acc = _word_block(
                    qs, m_i, l_i, acc, page, n0, hi, kv_head, k_ptr, v_ptr, stride_kp,
                    stride_ks, stride_kh, stride_vp, stride_vs, stride_vh, ks_ptr, vs_ptr,
                    stride_ksp, stride_kss, stride_ksh, stride_vsp, stride_vss, stride_vsh,
                    ring_pos_ptr, ring_base, step_start, near_lo, position,
                    BLOCK_N, PAGE_SIZE, HEAD_DIM, DIM_PAD, K_BITS, V_BITS, WINDOW,
                    DOT_PRECISION, FAST_UNPACK)
    else:
        for n0 in range(lo, hi, BLOCK_N):
            page = tl.load(table_row + n0 // PAGE_SIZE).to(tl.int64)
            m_i, l_i, acc = _word_block(
                qs, m_i, l_i, acc, page, n0, hi, kv_head, k_ptr, v_ptr, stride_kp,
                stride_ks, stride_kh, stride_vp, stride_vs, stride_vh, ks_ptr, vs_ptr,
                stride_ksp, stride_kss, stride_ksh, stride_vsp, stride_vss, stride_vsh,
                ring_pos_ptr, ring_base, step_start, near_lo, position,
                BLOCK_N, PAGE_SIZE, HEAD_DIM, DIM_PAD, K_BITS, V_BITS, WINDOW,
                DOT_PRECISION, FAST_UNPACK)
    return m_i, l_i, acc


@triton.jit
def _word_block(qs, m_i, l_i, acc, page, n0, hi, kv_head,
                k_ptr, v_ptr, stride_kp, stride_ks, stride_kh, stride_vp, stride_vs,
                stride_vh, ks_ptr, vs_ptr, stride_ksp, stride_kss, stride_ksh,
                stride_vsp, stride_vss, stride_vsh,
                ring_pos_ptr, ring_base, step_start, near_lo, position,
                BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr,
                DIM_PAD: tl.constexpr, K_BITS: tl.constexpr, V_BITS: tl.constexpr,
                WINDOW: tl.constexpr, DOT_PRECISION: tl.constexpr,
                FAST_UNPACK: tl.constexpr):
    """One block of `attend_word_blocks`: keys [n0, n0 + BLOCK_N) (those below ``hi``) in page
    ``page`` (int64). Slot 0 of every page is skipped (its exact head row is attended
    elsewhere). WINDOW > 0: keys the window covers (`window_holds`, keys from ``near_lo`` on)
    are skipped too. Keys enter as integers (`integer_scores`), values in one dot over whole
    rows (paired, quarters swapped: `_word_range` undoes it). Keys run along the rows of
    every tile: the scores and ``l_i`` (running sums, reduced after the loop) are [BLOCK_N,
    BLOCK_M], the accumulator ``acc`` [DIM_PAD, BLOCK_M]."""
    # The value dots' dtype: float32 for float32 queries (the only ones that set "ieee"),
    # else float16 (dequantized rows stay in its range as their scales do).
    DT: tl.constexpr = tl.float32 if DOT_PRECISION == "ieee" else tl.float16
    V_PER: tl.constexpr = 32 // V_BITS
    V_WPAD: tl.constexpr = DIM_PAD // V_PER
    G_PAD: tl.constexpr = DIM_PAD // 32
    slots = n0 % PAGE_SIZE + tl.arange(0, BLOCK_N)
    keys = n0 + tl.arange(0, BLOCK_N)
    key_valid = keys < hi
    scores = integer_scores(qs, k_ptr + kv_head * stride_kh + page * stride_kp, slots,
                            stride_ks, ks_ptr, kv_head * stride_ksh + page * stride_ksp,
                            stride_kss, key_valid, BLOCK_N, HEAD_DIM, G_PAD, K_BITS, FAST_UNPACK)
    visible = key_valid & (slots != 0)
    if WINDOW > 0:
        near = key_valid & (keys >= near_lo)
        held = near & window_holds(keys, near, ring_pos_ptr, ring_base, step_start, WINDOW)
        visible = visible & ~(held & (keys > position - WINDOW))
    scores = tl.where(visible[:, None], scores, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(scores, 0))
    p = tl.exp2(scores - m_new[None, :])
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha[None, :] + p  # no per-block sum across the warps that split the keys
    p = p.to(DT)
    vwords = load_word_rows(v_ptr + kv_head * stride_vh + page * stride_vp, slots, stride_vs,
                            key_valid, V_WPAD, HEAD_DIM // V_PER)
    vscale = load_scales(vs_ptr, kv_head * stride_vsh + page * stride_vsp, slots, stride_vss,
                         key_valid, G_PAD, 32 // V_PER, HEAD_DIM).to(DT)
    vrows = swapped_quarters(dequantized_rows(vwords, vscale, BLOCK_N, V_WPAD, V_BITS, DT,
                                              FAST_UNPACK), BLOCK_N, DIM_PAD)
    if FAST_UNPACK and DT == tl.float16:
        # An opaque copy in 32-bit pairs: the dot then reads its operand from shared memory two
        # halves at a time (not one), with no register moves after each matrix load.
        vrows = tl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [vrows], dtype=tl.float16,
                                          is_pure=False, pack=2)
    acc = tl.dot(tl.trans(vrows), p, acc * alpha[None, :], input_precision=DOT_PRECISION)
    return m_new, l_i, acc
