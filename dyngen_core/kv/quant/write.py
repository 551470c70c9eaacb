"""The quantized storage's write of a step's rows: one Triton launch per layer (and one more for
the recent window, or none when a decode-only step's window rows are stored by the same launch,
`DecodeWindowWrite`), and its torch twin, the CPU path (`write_pages_torch`,
`write_heads_torch`).

The kernel (`write_kernel.quant_write_kernel`) subtracts the key offsets, rotates each group of
32 values with the Walsh-Hadamard butterfly, quantizes (`format`: signed extreme, fp16 scale,
round half to even) and stores codes, scales, the step's exact rows and the head rows of
page-opening slots, computing its row indices itself. Against the torch twin (which rotates by
a float32 matrix product) codes can differ by one step where a rotated value sits on a rounding
boundary, and exact rows by one step of the compute dtype at their group's largest value.
Slots outside the pages store no codes and no head row; their exact rows are still produced.

Everything launched has a grid of the token count only and reads slots, positions and sequence
slots on the device: capturable in CUDA graphs, no host sync.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch

from dyngen_core.kv.quant.format import GROUP_SIZE, QuantFormat, quantize_rotated
from dyngen_core.kv.quant.hadamard import inv_sqrt
from dyngen_core.kv.quant.window import RecentLayer, RecentWindow
from dyngen_core.ops.triton_support import (
    launch_device,
    require_triton,
    triton_by_default,
)

WINDOW_SCAN = 256
# Overrides the default of `QuantStorage(fold_decode_window=None)` likewise: "1" stores a
# decode-only step's window rows in the write's launch, "0" in a launch of their own.
FOLD_ENV = "DYNGEN_QUANT_FOLD_WINDOW"


@dataclass(frozen=True)
class DecodeWindowWrite:
    """The recent-window write of a decode-only step, done by `launch_quant_write`'s launch.

    positions, seq_slots: [T] each token's position and its sequence's slot (-1: none), on
        the layer's device; one token per sequence (the rule is then `recent.RecentWindow`'s).
    target: the layer's window (`recent.RecentLayer`: rows in the compute dtype, positions).
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


def resolve_fold_window(option: bool | None) -> bool:
    """Whether `QuantStorage` folds a decode-only step's window write into its page write.
    ``option`` None: the ``DYNGEN_QUANT_FOLD_WINDOW`` environment variable ("1" or "0"), on
    when unset (H200, q4, 8 KV heads x 128: write and window 4.59 -> 3.36 us a layer at batch
    1, 5.01 -> 3.82 at batch 32, and one launch less; benchmarks/quant_write.py)."""
    if option is not None:
        return option
    chosen = os.environ.get(FOLD_ENV, "")
    if chosen not in ("", "0", "1"):
        raise ValueError(f"{FOLD_ENV}={chosen!r}: use '1' or '0' (or unset it)")
    return chosen != "0"


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
    """Everything `quant_write_kernel.write_token_heads` takes for one layer's step write:
    the tensors and sizes (`arguments`, in its order after ``token, num_tokens, block``) and
    its constexprs (`constants`). `launch_quant_write` launches `quant_write_kernel` with it;
    a decode attention kernel given it writes its own heads' rows instead
    (`attention.triton_quant`'s ``write``). ``exact``: where the step's exact rows go
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
                     window: DecodeWindowWrite | None = None,
                     head_block: int = 1) -> StepQuantWrite:
    """The write (`launch_quant_write` launches it) that quantizes key/value rows [T,
    kv_heads, head_dim] (last dimension contiguous, or they are copied) into ``pages`` (key
    codes, key scales, value codes, value scales: a layer's [num_pages, page_size, kv_heads,
    ...] tensors) at flat slots ``slot_mapping`` [T] (int32 or int64), keys minus
    ``offsets`` (float32 [kv_heads, head_dim], or None); ``bits``: (key bits, value bits);
    ``signs``: `hadamard.rotation_signs` (32) on the device. Rows at slot 0 of a page also
    go to ``head_rows`` [2, num_pages + 1, kv_heads, head_dim]. Its ``exact`` (allocated
    here, written by the launch) will hold the step's exact rows [2, T, kv_heads, head_dim]
    in ``dtype`` (rotated, minus the offsets: `step_rows.ExactStepRows.exact`). ``window``:
    also store those rows in the recent window of a decode-only step (its rows must be in
    ``dtype``). ``head_block``: KV heads per program (a divisor of kv_heads). One: a batch-1
    write is one program's chain of dependent steps, and split by head it is eight times
    narrower (H200, 8 KV heads x 128, q4 with the window folded, us a layer: 3.57 -> 2.44 at
    batch 1, 3.83 -> 2.85 at batch 32; 2 and 4 heads in between; benchmarks/quant_write.py
    --head-blocks)."""
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
    if head_block < 1 or heads % head_block:
        raise ValueError(f"head_block={head_block} does not divide the {heads} KV heads")
    tensors = (key, value, slot_mapping, key if offsets is None else offsets.contiguous(),
               signs, key.stride(0), key.stride(1), value.stride(0), value.stride(1),
               key_codes, key_scales, value_codes, value_scales, head_rows, exact,
               num_pages * page_size, num_pages, *window_args)
    constants: dict[str, Any] = {"HEADS": heads, "HEAD_DIM": head_dim, "PAGE_SIZE": page_size,
                 "KEY_BITS": bits[0], "VALUE_BITS": bits[1], "HAS_OFFSETS": offsets is not None,
                 "ROWS": _next_pow2(head_block * head_dim // GROUP_SIZE),
                 "INV_SQRT": inv_sqrt(GROUP_SIZE),
                 "WINDOW": window.window if window is not None else 0,
                 "HEAD_BLOCK": head_block}
    return StepQuantWrite(tensors, exact, constants)


def launch_quant_write(write: StepQuantWrite) -> None:
    """Launch `quant_write_kernel` over ``write`` (`step_quant_write`): one program a token
    and block of HEAD_BLOCK KV heads."""
    from dyngen_core.kv.quant.write_kernel import quant_write_kernel

    tokens = write.num_tokens
    if tokens == 0:
        return
    shape = write.constants
    device = write.exact.device
    with launch_device(device):
        quant_write_kernel[(tokens, shape["HEADS"] // shape["HEAD_BLOCK"])](
            *write.arguments(), **shape,
            num_warps=min(4, max(1, shape["ROWS"] // 4)), enable_fp_fusion=False,
        )


def write_window_triton(exact: torch.Tensor, positions: torch.Tensor, seq_slots: torch.Tensor,
                        ring_rows: torch.Tensor, ring_positions: torch.Tensor,
                        window: int) -> None:
    """Store the step's exact rows ``exact`` [2, T, kv_heads, head_dim] in a layer's window
    (``ring_rows`` [2, slots * window + 1, kv_heads, head_dim] and ``ring_positions``
    [slots * window + 1], `recent.RecentLayer`) for tokens at ``positions`` [T] of the
    sequences in ``seq_slots`` [T] (-1 or out of range: not kept), as
    `recent.RecentWindow.write_rows` with `RecentWindow.index` does."""
    from dyngen_core.kv.quant.write_kernel import window_write_kernel

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
    ``pages`` (key codes, key scales, value codes, value scales) at flat ``slot_mapping`` [T]."""
    key_codes, key_scales, value_codes, value_scales = pages
    slots = slot_mapping.to(torch.int64)
    for rows, codes, scales, fmt in ((rotated[0], key_codes, key_scales, formats[0]),
                                     (rotated[1], value_codes, value_scales, formats[1])):
        packed, row_scales = quantize_rotated(rows, fmt)
        codes.view(-1, *codes.shape[2:]).index_copy_(0, slots, packed)
        scales.view(-1, *scales.shape[2:]).index_copy_(0, slots, row_scales)


def write_heads_torch(head_rows: torch.Tensor, index: torch.Tensor, exact: torch.Tensor) -> None:
    """The torch twin of the write's head rows: copy the step's exact rows ``exact``
    [2, T, H, D] into ``head_rows`` [2, num_pages + 1, H, D] at `step_rows.head_index`
    ``index`` [2T]."""
    flat = head_rows.view(-1, *head_rows.shape[2:])
    flat.index_copy_(0, index, exact.view(-1, *head_rows.shape[2:]))
