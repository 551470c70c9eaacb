"""Triton kernels of the quantized storage's decode-step write (`quant_write` launches them).

`quant_write_kernel`: program ``(t, b)`` takes the key and value rows of token t's b-th block
of HEAD_BLOCK heads [HEAD_BLOCK, HEAD_DIM] (all heads when HEAD_BLOCK is HEADS) as the model
left them (strided views), and in registers subtracts the key offsets (float32, rounded
once to the keys' dtype, as `step_rows.offset_keys`), rotates every group of 32 values
(`hadamard`: the signs, then the five butterfly stages of `hadamard.walsh_hadamard`, then the
1/sqrt(32) factor), quantizes them (`qformat`: signed extreme, fp16 scale, round half to even)
and stores codes and scales at the token's slot; it also stores the rotated rows in the compute
dtype as the step's exact rows and, for a slot that opens a page, as that page's head row.
With WINDOW > 0 (a decode-only step: one token per sequence) it also stores those rows in the
token's sequence's recent window, in place of `window_write_kernel`'s second launch.

`window_write_kernel`: program ``t`` puts token t's exact rows into its sequence's recent
window (`recent.RecentWindow`), the row index computed in the kernel (the rule of
`RecentWindow.index`).

This module imports triton at the top: `quant_write` imports it lazily, and the q8/q4 decode
kernel (`attention.triton_quant_kernels`, itself Triton's) for `write_token_heads`.
"""

from __future__ import annotations

import triton
import triton.language as tl

# Adding then subtracting 1.5 * 2**23 rounds a float32 of magnitude below 2**22 to the nearest
# integer, ties to even (the spacing of floats in [2**23, 2**24) is 1): rintf, which the
# interpreter lacks. Launches turn FMA contraction off, so nothing fuses around it.
ROUND_MAGIC = tl.constexpr(12582912.0)
FP16_MAX = tl.constexpr(65504.0)


@triton.jit
def _round_to(x, DTYPE: tl.constexpr):
    """float32 ``x`` rounded to DTYPE, to nearest even. bfloat16 by its bits: the same result
    as the GPU's conversion, where Triton's interpreter (the CPU tests) truncates instead."""
    if DTYPE == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).to(tl.uint16)
        return tl.where(x == x, rounded.to(tl.bfloat16, bitcast=True), x.to(tl.bfloat16))
    else:
        return x.to(DTYPE)


@triton.jit
def _rotate(x, sign, lanes, INV_SQRT: tl.constexpr):
    """Rotated groups of float32 ``x`` [ROWS, 32] (one group of 32 per row): the
    butterfly, stage by stage (pairs at distance h become (a + b, a - b))."""
    v = x * sign
    v = _butterfly(v, lanes, 1)
    v = _butterfly(v, lanes, 2)
    v = _butterfly(v, lanes, 4)
    v = _butterfly(v, lanes, 8)
    v = _butterfly(v, lanes, 16)
    return v * INV_SQRT


@triton.jit
def _butterfly(v, lanes, DISTANCE: tl.constexpr):
    """One stage: lane pairs (l, l + DISTANCE) of every row become (a + b, a - b)."""
    partner = tl.gather(v, tl.broadcast_to(lanes ^ DISTANCE, v.shape), axis=1)
    return tl.where((lanes & DISTANCE) != 0, partner - v, v + partner)


@triton.jit
def _quantize_store(rot, codes, scales, slot, valid, rows, lanes, first,
                    GROUPS: tl.constexpr, BLOCK_GROUPS: tl.constexpr, ROWS: tl.constexpr,
                    BITS: tl.constexpr):
    """Quantize rotated groups ``rot`` [ROWS, 32] (`qformat.quantize_rotated`) and store the
    codes and fp16 scales of BLOCK_GROUPS of a token's GROUPS groups, from group ``first``, at
    flat ``slot`` (nothing if not ``valid``). The slot's codes are GROUPS * 32 * BITS / 8
    contiguous bytes (group by group), its scales GROUPS contiguous halves."""
    LOWEST: tl.constexpr = -(1 << (BITS - 1))
    HIGHEST: tl.constexpr = (1 << (BITS - 1)) - 1
    amax = tl.max(tl.abs(rot), axis=1)
    positive = tl.max((rot == amax[:, None]).to(tl.int32), axis=1) > 0
    extreme = tl.where(positive, amax, -amax)
    scale = tl.div_rn(extreme, tl.full(extreme.shape, LOWEST, tl.float32))
    scale16 = tl.minimum(tl.maximum(scale, -FP16_MAX), FP16_MAX).to(tl.float16)
    scale = scale16.to(tl.float32)
    nonzero = scale != 0.0
    ratio = tl.div_rn(rot, tl.broadcast_to(tl.where(nonzero, scale, 1.0)[:, None], rot.shape))
    ratio = tl.minimum(tl.maximum(ratio, LOWEST - 1.0), HIGHEST + 1.0)  # rounding keeps order
    code = (ratio + ROUND_MAGIC) - ROUND_MAGIC
    code = tl.minimum(tl.maximum(code, LOWEST * 1.0), HIGHEST * 1.0)
    code = tl.where(nonzero[:, None], code, 0.0).to(tl.int32)
    group = tl.arange(0, ROWS)
    tl.store(scales + slot * GROUPS + first + group, scale16,
             mask=valid & (group < BLOCK_GROUPS))
    row_mask = valid & (rows < BLOCK_GROUPS)
    rows = rows + first
    if BITS == 8:
        tl.store(codes + slot * (GROUPS * 32) + rows * 32 + lanes, code.to(tl.int8),
                 mask=row_mask & (lanes < 32))
    elif BITS == 4:
        low, high = tl.split(tl.reshape(code - LOWEST, (ROWS, 16, 2)))
        at = codes + slot * (GROUPS * 16) + rows * 16 + tl.arange(0, 16)[None, :]
        tl.store(at, (low | (high << 4)).to(tl.uint8), mask=row_mask)
    else:
        even, odd = tl.split(tl.reshape(code - LOWEST, (ROWS, 8, 2, 2)))
        u0, u2 = tl.split(even)
        u1, u3 = tl.split(odd)
        word = u0 | (u1 << 6) | (u2 << 12) | (u3 << 18)
        at = codes + slot * (GROUPS * 24) + rows * 24 + 3 * tl.arange(0, 8)[None, :]
        tl.store(at, (word & 0xFF).to(tl.uint8), mask=row_mask)
        tl.store(at + 1, ((word >> 8) & 0xFF).to(tl.uint8), mask=row_mask)
        tl.store(at + 2, ((word >> 16) & 0xFF).to(tl.uint8), mask=row_mask)


@triton.jit
def quant_write_kernel(
    key, value, slots, offsets, signs,
    key_token_stride, key_head_stride, value_token_stride, value_head_stride,
    key_codes, key_scales, value_codes, value_scales, head_rows, exact,
    num_slots, num_pages,
    positions, seq_slots, ring_rows, ring_positions, slots_held,
    HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr,
    KEY_BITS: tl.constexpr, VALUE_BITS: tl.constexpr, HAS_OFFSETS: tl.constexpr,
    ROWS: tl.constexpr, INV_SQRT: tl.constexpr, WINDOW: tl.constexpr,
    HEAD_BLOCK: tl.constexpr,
):
    """Program (t, b) writes heads [b * HEAD_BLOCK, (b + 1) * HEAD_BLOCK) of token t (see the
    module docstring; HEAD_BLOCK divides HEADS). ``key``/``value``: rows
    [T, HEADS, HEAD_DIM], last dimension contiguous; ``offsets``: float32 [HEADS, HEAD_DIM]
    (read when HAS_OFFSETS); ``signs``: float32 [32]; codes/scales: the layer's page tensors
    (contiguous); ``head_rows`` [2, num_pages + 1, HEADS, HEAD_DIM] and ``exact``
    [2, T, HEADS, HEAD_DIM] in the compute dtype. ROWS: HEAD_BLOCK * HEAD_DIM / 32 rounded up
    to a power of two. A slot outside [0, num_slots) stores no codes and no head row (its exact
    rows are still stored: a reader may attend to them). WINDOW > 0: the exact rows also go to the
    recent window (``positions``, ``seq_slots`` [T]; ``ring_rows``, ``ring_positions``,
    ``slots_held``: as `window_write_kernel`'s) by the rule of a decode-only step
    (`_store_decode_window`); WINDOW 0 reads none of them."""
    write_token_heads(
        tl.program_id(0).to(tl.int64), tl.num_programs(0).to(tl.int64), tl.program_id(1),
        key, value, slots, offsets, signs,
        key_token_stride, key_head_stride, value_token_stride, value_head_stride,
        key_codes, key_scales, value_codes, value_scales, head_rows, exact,
        num_slots, num_pages, positions, seq_slots, ring_rows, ring_positions, slots_held,
        HEADS, HEAD_DIM, PAGE_SIZE, KEY_BITS, VALUE_BITS, HAS_OFFSETS, ROWS, INV_SQRT, WINDOW,
        HEAD_BLOCK)


@triton.jit
def write_token_heads(
    token, num_tokens, block, key, value, slots, offsets, signs,
    key_token_stride, key_head_stride, value_token_stride, value_head_stride,
    key_codes, key_scales, value_codes, value_scales, head_rows, exact,
    num_slots, num_pages, positions, seq_slots, ring_rows, ring_positions, slots_held,
    HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr,
    KEY_BITS: tl.constexpr, VALUE_BITS: tl.constexpr, HAS_OFFSETS: tl.constexpr,
    ROWS: tl.constexpr, INV_SQRT: tl.constexpr, WINDOW: tl.constexpr,
    HEAD_BLOCK: tl.constexpr,
):
    """`quant_write_kernel`'s work for token ``token`` (int64) of ``num_tokens`` and its
    ``block``-th block of HEAD_BLOCK heads, in the calling program: the kernel's program
    (t, b), or a decode attention program that writes its own head's rows
    (`attention.triton_quant`'s ``write``). Arguments as the kernel's."""
    slot = tl.load(slots + token).to(tl.int64)
    valid = (slot >= 0) & (slot < num_slots)
    slot = tl.where(valid, slot, 0)  # keep even the masked addresses inside the pages
    GROUPS: tl.constexpr = HEADS * HEAD_DIM // 32
    PER_HEAD: tl.constexpr = HEAD_DIM // 32
    BLOCK_GROUPS: tl.constexpr = HEAD_BLOCK * PER_HEAD
    first = block * BLOCK_GROUPS
    rows = tl.arange(0, ROWS)[:, None]
    lanes = tl.arange(0, 32)[None, :]
    mask = (rows < BLOCK_GROUPS) & (lanes < 32)
    head = (first + rows) // PER_HEAD
    dim = (rows % PER_HEAD) * 32 + lanes
    element = (first + rows) * 32 + lanes  # head * HEAD_DIM + dim
    sign = tl.load(signs + lanes)
    stored_type: tl.constexpr = key.dtype.element_ty
    k = tl.load(key + token * key_token_stride + head * key_head_stride + dim, mask=mask,
                other=0.0)
    if HAS_OFFSETS:
        k = (k.to(tl.float32) - tl.load(offsets + element, mask=mask, other=0.0))
        k = _round_to(k, stored_type)
    v = tl.load(value + token * value_token_stride + head * value_head_stride + dim, mask=mask,
                other=0.0)
    v = _round_to(v.to(tl.float32), stored_type)
    key_rot = _rotate(k.to(tl.float32), sign, lanes, INV_SQRT)
    value_rot = _rotate(v.to(tl.float32), sign, lanes, INV_SQRT)
    exact_type: tl.constexpr = exact.dtype.element_ty
    key_exact = _round_to(key_rot, exact_type)
    value_exact = _round_to(value_rot, exact_type)
    row_size: tl.constexpr = HEADS * HEAD_DIM
    exact_at = exact + token * row_size + element
    tl.store(exact_at, key_exact, mask=mask)
    tl.store(exact_at + num_tokens * row_size, value_exact, mask=mask)
    head_mask = mask & valid & (slot % PAGE_SIZE == 0)
    head_at = head_rows + (slot // PAGE_SIZE) * row_size + element
    tl.store(head_at, key_exact, mask=head_mask)
    tl.store(head_at + (num_pages + 1) * row_size, value_exact, mask=head_mask)
    if WINDOW > 0:
        _store_decode_window(key_exact, value_exact, token, element, mask, positions, seq_slots,
                             ring_rows, ring_positions, slots_held, block == 0, row_size,
                             WINDOW)
    _quantize_store(key_rot, key_codes, key_scales, slot, valid, rows, lanes, first,
                    GROUPS, BLOCK_GROUPS, ROWS, KEY_BITS)
    _quantize_store(value_rot, value_codes, value_scales, slot, valid, rows, lanes, first,
                    GROUPS, BLOCK_GROUPS, ROWS, VALUE_BITS)


@triton.jit
def _store_decode_window(key_exact, value_exact, token, element, mask, positions, seq_slots,
                         ring_rows, ring_positions, slots_held, first_block,
                         ROW_SIZE: tl.constexpr, WINDOW: tl.constexpr):
    """Token ``token``'s exact rows into its sequence's window, when the step is decode-only:
    row ``s * WINDOW + p % WINDOW`` for position ``p`` of sequence slot ``s`` in
    [0, slots_held), else the spare last row holding position -1. With one token per sequence
    this is `window_write_kernel`'s rule (the token is its sequence's newest), and the row it
    replaces held position ``p - WINDOW``, which no query of the step reads (a decode query at
    ``p`` reads window positions in (p - WINDOW, p) and its own from the step's rows), so the
    write may come before attention."""
    slot = tl.load(seq_slots + token).to(tl.int64)
    position = tl.load(positions + token).to(tl.int64)
    kept = (slot >= 0) & (slot < slots_held)
    spare = slots_held * WINDOW
    row = tl.where(kept, slot * WINDOW + position % WINDOW, spare)
    ring_at = ring_rows + row * ROW_SIZE + element
    tl.store(ring_at, key_exact, mask=mask)
    tl.store(ring_at + (spare + 1) * ROW_SIZE, value_exact, mask=mask)
    if first_block:  # one program of the token records the position
        tl.store(ring_positions + row, tl.where(kept, position, -1).to(tl.int32))


@triton.jit
def window_write_kernel(
    exact, positions, seq_slots, ring_rows, ring_positions, slots_held,
    WINDOW: tl.constexpr, ROW_SIZE: tl.constexpr, ROW_PAD: tl.constexpr,
    SCAN: tl.constexpr,
):
    """Program ``t`` stores token t's exact key and value rows (``exact`` [2, T, ROW_SIZE]) in
    the window rows ``ring_rows`` [2, slots_held * WINDOW + 1, ROW_SIZE] and its position in
    ``ring_positions``. The row (`recent.RecentWindow.index`): ``s * WINDOW + p % WINDOW`` for
    a token at position ``p`` of sequence slot ``s`` in [0, slots_held) that is within WINDOW
    of the newest position of that slot in this step; the spare last row, holding position -1,
    for any other token. SCAN: tokens compared per block while finding that newest position."""
    token = tl.program_id(0).to(tl.int64)
    num_tokens = tl.num_programs(0).to(tl.int64)
    slot = tl.load(seq_slots + token).to(tl.int64)
    position = tl.load(positions + token).to(tl.int64)
    kept = (slot >= 0) & (slot < slots_held)
    newest = tl.full((), -1, tl.int64)
    for start in range(0, num_tokens, SCAN):
        others = start + tl.arange(0, SCAN)
        inside = others < num_tokens
        other_slots = tl.load(seq_slots + others, mask=inside, other=-1).to(tl.int64)
        other_positions = tl.load(positions + others, mask=inside, other=-1).to(tl.int64)
        same = inside & (other_slots == slot)
        newest = tl.maximum(newest, tl.max(tl.where(same, other_positions, -1), axis=0))
    kept = kept & (position > newest - WINDOW)
    spare = slots_held * WINDOW
    row = tl.where(kept, slot * WINDOW + position % WINDOW, spare)
    elements = tl.arange(0, ROW_PAD)
    inside_row = elements < ROW_SIZE
    key_row = tl.load(exact + token * ROW_SIZE + elements, mask=inside_row)
    value_row = tl.load(exact + (num_tokens + token) * ROW_SIZE + elements, mask=inside_row)
    tl.store(ring_rows + row * ROW_SIZE + elements, key_row, mask=inside_row)
    tl.store(ring_rows + (spare + 1 + row) * ROW_SIZE + elements, value_row, mask=inside_row)
    tl.store(ring_positions + row, tl.where(kept, position, -1).to(tl.int32))
