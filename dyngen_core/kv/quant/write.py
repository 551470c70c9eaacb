"""The quantized storage's write of a step's rows: one Triton launch per layer (and one more for
the recent window, or none when a decode-only step's window rows are stored by the same launch,
`DecodeWindowWrite`), and its torch twin, the CPU path (`prepare_rows`, `write_pages_torch`,
`write_heads_torch`).

`quant_write_kernel`: program ``(t, h)`` takes KV head h's key and value rows of token t as the
model left them (strided views), and in registers subtracts the key offsets (float32, rounded
once to the keys' dtype, as `offset_keys`), rotates every group of 32 values (`format`: the
signs, the five butterfly stages of `format.walsh_hadamard`, the 1/sqrt(32) factor), quantizes
them (`format.quantize_rotated`: signed extreme, fp16 scale, round half to even) and stores
codes and scales at the token's slot (in the head-major pages: row ``(page * HEADS + h) *
PAGE_SIZE + offset``); it also stores the rotated rows in the compute dtype as the
step's exact rows and, for a slot that opens a page, as that page's head row. With WINDOW > 0 (a
decode-only step: one token per sequence) it also stores those rows in the token's sequence's
recent window, in place of `window_write_kernel`'s second launch. The q8/q4 decode kernel runs
the same work in its own programs (`write_token_heads`, `attention.triton.quant_decode`).

`window_write_kernel`: program ``t`` puts token t's exact rows into its sequence's recent window
(`window.RecentWindow`), the row index computed in the kernel (`window.RecentWindow.index`).

Against the torch twin (which rotates by a float32 matrix product) codes can differ by one step
where a rotated value sits on a rounding boundary, and exact rows by one step of the compute
dtype at their group's largest value. Slots outside the pages store no codes and no head row;
their exact rows are still produced. Everything launched has a grid of the token count only and
reads slots, positions and sequence slots on the device: capturable in CUDA graphs, no host
sync.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from dyngen_core.kv.quant.format import (
    GROUP_SIZE,
    QuantFormat,
    inv_sqrt,
    quantize_rotated,
    rotate,
)
from dyngen_core.kv.quant.window import RecentLayer, RecentWindow
from dyngen_core.ops.triton_support import (
    launch_device,
    require_triton,
    tl,
    triton,
    triton_by_default,
)

WINDOW_SCAN = 256


@dataclass(frozen=True)
class ExactStepRows:
    """This step's rows of one layer as the storage keeps them, keys at index 0, values at 1.

    exact: the rows rotated (`format.rotate`) in the compute dtype, the form of the exact
        rows (page heads, recent windows).
    stored: [2, T, kv_heads, head_dim] in the keys' dtype: keys minus the layer's key offsets
        (what the quantized pages encode), values as given; None when the write that made
        ``exact`` kept them in registers only (the Triton write).
    rotated: ``stored`` rotated, float32 (what the torch codec quantizes); None likewise.
    """

    exact: torch.Tensor
    stored: torch.Tensor | None = None
    rotated: torch.Tensor | None = None


def prepare_rows(key: torch.Tensor, value: torch.Tensor, offsets: torch.Tensor | None,
                 rotation: torch.Tensor, dtype: torch.dtype) -> ExactStepRows:
    """Keys [T, kv_heads, head_dim] minus ``offsets`` (float32 [kv_heads, head_dim], or None)
    and values (cast to the keys' dtype) in one tensor, rotated by one float32 matrix product
    and cast once to ``dtype``: per element the same arithmetic as offsetting, rotating and
    casting keys and values one by one."""
    stored = torch.empty((2, *key.shape), dtype=key.dtype, device=key.device)
    offset_keys(key, offsets, stored[0])
    stored[1].copy_(value)
    rotated = rotate(stored, rotation)
    return ExactStepRows(stored=stored, rotated=rotated, exact=rotated.to(dtype))


def offset_keys(key: torch.Tensor, offsets: torch.Tensor | None,
                out: torch.Tensor) -> torch.Tensor:
    """``key`` minus ``offsets`` into ``out`` (the keys' dtype): computed in float32 and
    rounded once, in one kernel (``key.float() - offsets``, then cast)."""
    if offsets is None:
        return out.copy_(key)
    return torch.sub(key, offsets, out=out)


def head_index(slot_mapping: torch.Tensor, page_size: int, num_pages: int,
               device: torch.device) -> torch.Tensor:
    """Rows of a layer's head rows, flattened to [2 * (num_pages + 1), ...], that a step's
    keys, then values, written at ``slot_mapping`` [T] go to: a page's head row for slot 0 of
    a page, the spare last row for the others (no data-dependent shapes: CUDA graphs)."""
    slots = slot_mapping.to(device=device, dtype=torch.int64)
    rows = torch.where(slots % page_size == 0, slots // page_size, num_pages)
    return torch.cat((rows, rows + (num_pages + 1)))


@dataclass(frozen=True)
class DecodeWindowWrite:
    """The recent-window write of a decode-only step, done by `launch_quant_write`'s launch.

    positions, seq_slots: [T] each token's position and its sequence's slot (-1: none), on
        the layer's device; one token per sequence (the rule is then `window.RecentWindow`'s).
    target: the layer's window (`window.RecentLayer`: rows in the compute dtype, positions).
    window: positions kept per sequence.
    """

    positions: torch.Tensor
    seq_slots: torch.Tensor
    target: RecentLayer
    window: int

    def arguments(self) -> tuple[object, ...]:
        """In the kernel's order: positions, sequence slots, rows, positions, slots held."""
        rows = self.target.rows
        return (self.positions, self.seq_slots, rows, self.target.positions,
                (rows.shape[1] - 1) // self.window)


def decode_window_write(recent: RecentWindow | None, layer: int, device: torch.device,
                        decode_window: tuple[torch.Tensor, torch.Tensor] | None
                        ) -> DecodeWindowWrite | None:
    """The window write of ``layer`` for a decode-only step's (positions, sequence slots)
    ``decode_window`` (None: none given, or no window reserved)."""
    if decode_window is None or recent is None:
        return None
    positions, seq_slots = (t.to(device) for t in decode_window)
    return DecodeWindowWrite(positions, seq_slots, recent.layers[layer], recent.window)


def resolve_triton_write(option: bool | None, device: torch.device) -> bool:
    """Whether a layer on ``device`` takes the Triton write. ``option`` None: on CUDA with
    triton installed (`triton_support.triton_by_default`); True: raises ValueError where the
    kernel cannot run (no triton; the CPU without ``TRITON_INTERPRET=1``); False: never."""
    if option is None:
        return triton_by_default(device)
    if option:
        require_triton(device, "triton_write")
    return option


@dataclass(frozen=True)
class StepQuantWrite:
    """Everything `write_token_heads` takes for one layer's step write:
    the tensors and sizes (`arguments`, in its order after ``token, num_tokens, block``) and
    its constexprs (`constants`). `launch_quant_write` launches `quant_write_kernel` with it;
    a decode attention kernel given it writes its own heads' rows instead
    (`attention.triton.quant_decode`'s ``write``). ``exact``: where the step's exact rows go
    [2, T, kv_heads, head_dim], in the compute dtype."""

    tensors: tuple[object, ...]
    exact: torch.Tensor
    constants: dict[str, Any]

    @property
    def num_tokens(self) -> int:
        return int(self.exact.shape[1])

    def arguments(self) -> tuple[object, ...]:
        return self.tensors


def step_quant_write(key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor,
                     offsets: torch.Tensor | None, signs: torch.Tensor,
                     pages: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
                     bits: tuple[int, int], head_rows: torch.Tensor, dtype: torch.dtype,
                     window: DecodeWindowWrite | None = None) -> StepQuantWrite:
    """The write (`launch_quant_write` launches it) that quantizes key/value rows [T,
    kv_heads, head_dim] (last dimension contiguous, or they are copied) into ``pages`` (key
    codes, key scales, value codes, value scales: a layer's [num_pages, page_size, kv_heads,
    ...] views of head-major memory, as `storage.QuantStorage` allocates them: the kernel
    addresses a slot's head row itself) at flat slots ``slot_mapping`` [T] (int32 or int64),
    keys minus ``offsets`` (float32 [kv_heads, head_dim], or None); ``bits``: (key bits,
    value bits); ``signs``: `format.rotation_signs` (32) on the device. Rows at slot 0 of a
    page also go to ``head_rows`` [2, num_pages + 1, kv_heads, head_dim]. Its ``exact`` (allocated
    here, written by the launch) will hold the step's exact rows [2, T, kv_heads, head_dim]
    in ``dtype`` (rotated, minus the offsets: `ExactStepRows.exact`). ``window``:
    also store those rows in the recent window of a decode-only step (its rows must be in
    ``dtype``). One program writes one KV head of one token."""
    tokens, heads, head_dim = key.shape
    exact = torch.empty((2, tokens, heads, head_dim), dtype=dtype, device=key.device)
    key, value = _last_dim_contiguous(key), _last_dim_contiguous(value)
    key_codes, key_scales, value_codes, value_scales = pages
    num_pages, page_size = key_codes.shape[:2]
    if window is not None and window.target.rows.dtype != dtype:
        raise ValueError(f"the window rows are {window.target.rows.dtype}; the exact rows "
                         f"{dtype}: build both with the storage's compute dtype")
    window_args = window.arguments() if window is not None else (
        slot_mapping, slot_mapping, exact, slot_mapping, 0)
    tensors = (key, value, slot_mapping, key if offsets is None else offsets.contiguous(),
               signs, key.stride(0), key.stride(1), value.stride(0), value.stride(1),
               key_codes, key_scales, value_codes, value_scales, head_rows, exact,
               num_pages * page_size, num_pages, *window_args)
    constants: dict[str, Any] = {"HEADS": heads, "HEAD_DIM": head_dim, "PAGE_SIZE": page_size,
                 "KEY_BITS": bits[0], "VALUE_BITS": bits[1], "HAS_OFFSETS": offsets is not None,
                 "ROWS": _next_pow2(head_dim // GROUP_SIZE),
                 "INV_SQRT": inv_sqrt(GROUP_SIZE),
                 "WINDOW": window.window if window is not None else 0}
    return StepQuantWrite(tensors, exact, constants)


def launch_quant_write(write: StepQuantWrite) -> None:
    """Launch `quant_write_kernel` over ``write`` (`step_quant_write`): one program a token
    and KV head."""
    tokens = write.num_tokens
    if tokens == 0:
        return
    shape = write.constants
    device = write.exact.device
    with launch_device(device):
        quant_write_kernel[(tokens, shape["HEADS"])](
            *write.arguments(), **shape,
            num_warps=min(4, max(1, shape["ROWS"] // 4)), enable_fp_fusion=False,
        )


def write_window_triton(exact: torch.Tensor, positions: torch.Tensor, seq_slots: torch.Tensor,
                        ring_rows: torch.Tensor, ring_positions: torch.Tensor,
                        window: int) -> None:
    """Store the step's exact rows ``exact`` [2, T, kv_heads, head_dim] in a layer's window
    (``ring_rows`` [2, slots * window + 1, kv_heads, head_dim] and ``ring_positions``
    [slots * window + 1], `window.RecentLayer`) for tokens at ``positions`` [T] of the
    sequences in ``seq_slots`` [T] (-1 or out of range: not kept), as
    `window.RecentWindow.write_rows` with `RecentWindow.index` does."""
    tokens = exact.shape[1]
    if tokens == 0:
        return
    row_size = exact.shape[2] * exact.shape[3]
    device = ring_rows.device
    with launch_device(device):
        window_write_kernel[(tokens,)](
            exact.contiguous().to(ring_rows.dtype), positions.to(device),
            seq_slots.to(device), ring_rows, ring_positions,
            (ring_rows.shape[1] - 1) // window,
            WINDOW=window, ROW_SIZE=row_size, ROW_PAD=_next_pow2(row_size),
            SCAN=WINDOW_SCAN, num_warps=4,
        )


def _last_dim_contiguous(rows: torch.Tensor) -> torch.Tensor:
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def _next_pow2(n: int) -> int:
    return 1 << (max(1, n) - 1).bit_length()


def write_pages_torch(pages: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
                      formats: tuple[QuantFormat, QuantFormat], rotated: torch.Tensor,
                      slot_mapping: torch.Tensor) -> None:
    """The torch twin of the write's codes and scales (the CPU path): quantize a step's rotated
    rows ``rotated`` [2, T, H, D] (float32, keys then values) with the torch codec into
    ``pages`` (key codes, key scales, value codes, value scales: [num_pages, page_size, H, ...]
    views, any strides) at flat ``slot_mapping`` [T]."""
    key_codes, key_scales, value_codes, value_scales = pages
    page_size = key_codes.shape[1]
    slots = slot_mapping.to(torch.int64)
    page, offset = slots // page_size, slots % page_size
    for rows, codes, scales, fmt in ((rotated[0], key_codes, key_scales, formats[0]),
                                     (rotated[1], value_codes, value_scales, formats[1])):
        packed, row_scales = quantize_rotated(rows, fmt)
        codes[page, offset] = packed
        scales[page, offset] = row_scales


def write_heads_torch(head_rows: torch.Tensor, index: torch.Tensor, exact: torch.Tensor) -> None:
    """The torch twin of the write's head rows: copy the step's exact rows ``exact``
    [2, T, H, D] into ``head_rows`` [2, num_pages + 1, H, D] at `head_index`
    ``index`` [2T]."""
    flat = head_rows.view(-1, *head_rows.shape[2:])
    flat.index_copy_(0, index, exact.view(-1, *head_rows.shape[2:]))


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
def _quantize_store(rot, codes, scales, row, valid, rows, lanes, GROUPS: tl.constexpr,
                    ROWS: tl.constexpr, BITS: tl.constexpr):
    """Quantize rotated groups ``rot`` [ROWS, 32] (`format.quantize_rotated`; rows past
    GROUPS unused) and store their codes and fp16 scales at head row ``row`` of the page
    tensors (nothing if not ``valid``): GROUPS * 32 * BITS / 8 contiguous bytes (group by
    group) and GROUPS contiguous halves."""
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
    tl.store(scales + row * GROUPS + group, scale16, mask=valid & (group < GROUPS))
    row_mask = valid & (rows < GROUPS)
    if BITS == 8:
        tl.store(codes + row * (GROUPS * 32) + rows * 32 + lanes, code.to(tl.int8),
                 mask=row_mask & (lanes < 32))
    elif BITS == 4:
        low, high = tl.split(tl.reshape(code - LOWEST, (ROWS, 16, 2)))
        at = codes + row * (GROUPS * 16) + rows * 16 + tl.arange(0, 16)[None, :]
        tl.store(at, (low | (high << 4)).to(tl.uint8), mask=row_mask)
    else:
        even, odd = tl.split(tl.reshape(code - LOWEST, (ROWS, 8, 2, 2)))
        u0, u2 = tl.split(even)
        u1, u3 = tl.split(odd)
        word = u0 | (u1 << 6) | (u2 << 12) | (u3 << 18)
        at = codes + row * (GROUPS * 24) + rows * 24 + 3 * tl.arange(0, 8)[None, :]
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
):
    """Program (t, h) writes KV head h of token t (module docstring). ``key``/``value``: rows
    [T, HEADS, HEAD_DIM], last dimension contiguous; ``offsets``: float32 [HEADS, HEAD_DIM]
    (read when HAS_OFFSETS); ``signs``: float32 [32]; codes/scales: the layer's page tensors
    (head-major, `storage.QuantStorage`); ``head_rows`` [2, num_pages + 1, HEADS, HEAD_DIM]
    and ``exact`` [2, T, HEADS, HEAD_DIM] in the compute dtype. ROWS: HEAD_DIM / 32 rounded up
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
        HEADS, HEAD_DIM, PAGE_SIZE, KEY_BITS, VALUE_BITS, HAS_OFFSETS, ROWS, INV_SQRT, WINDOW)


@triton.jit
def write_token_heads(
    token, num_tokens, head, key, value, slots, offsets, signs,
    key_token_stride, key_head_stride, value_token_stride, value_head_stride,
    key_codes, key_scales, value_codes, value_scales, head_rows, exact,
    num_slots, num_pages, positions, seq_slots, ring_rows, ring_positions, slots_held,
    HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr,
    KEY_BITS: tl.constexpr, VALUE_BITS: tl.constexpr, HAS_OFFSETS: tl.constexpr,
    ROWS: tl.constexpr, INV_SQRT: tl.constexpr, WINDOW: tl.constexpr,
):
    """`quant_write_kernel`'s work for token ``token`` (int64) of ``num_tokens`` and its KV
    head ``head``, in the calling program: the kernel's program (t, h), or a decode attention
    program that writes its own head's rows
    (`attention.triton.quant_decode`'s ``write``). Arguments as the kernel's."""
    slot = tl.load(slots + token).to(tl.int64)
    valid = (slot >= 0) & (slot < num_slots)
    slot = tl.where(valid, slot, 0)  # keep even the masked addresses inside the pages
    PER_HEAD: tl.constexpr = HEAD_DIM // 32
    rows = tl.arange(0, ROWS)[:, None]
    lanes = tl.arange(0, 32)[None, :]
    mask = (rows < PER_HEAD) & (lanes < 32)
    dim = (rows % PER_HEAD) * 32 + lanes
    element = head * HEAD_DIM + dim
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
                             ring_rows, ring_positions, slots_held, head == 0, row_size,
                             WINDOW)
    # The pages are head-major (`storage.QuantStorage`): the head's row of this slot.
    head_row = ((slot // PAGE_SIZE) * HEADS + head) * PAGE_SIZE + slot % PAGE_SIZE
    _quantize_store(key_rot, key_codes, key_scales, head_row, valid, rows, lanes, PER_HEAD,
                    ROWS, KEY_BITS)
    _quantize_store(value_rot, value_codes, value_scales, head_row, valid, rows, lanes,
                    PER_HEAD, ROWS, VALUE_BITS)


@triton.jit
def _store_decode_window(key_exact, value_exact, token, element, mask, positions, seq_slots,
                         ring_rows, ring_positions, slots_held, first_head,
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
    if first_head:  # one program of the token records the position
        tl.store(ring_positions + row, tl.where(kept, position, -1).to(tl.int32))


@triton.jit
def window_write_kernel(
    exact, positions, seq_slots, ring_rows, ring_positions, slots_held,
    WINDOW: tl.constexpr, ROW_SIZE: tl.constexpr, ROW_PAD: tl.constexpr,
    SCAN: tl.constexpr,
):
    """Program ``t`` stores token t's exact key and value rows (``exact`` [2, T, ROW_SIZE]) in
    the window rows ``ring_rows`` [2, slots_held * WINDOW + 1, ROW_SIZE] and its position in
    ``ring_positions``. The row (`window.RecentWindow.index`): ``s * WINDOW + p % WINDOW`` for
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
