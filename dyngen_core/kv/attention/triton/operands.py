"""What the Triton attention kernels read of one layer, as launch-ready bundles: the page tensors,
scales, strides and rotation (`PageOperands`, `page_arguments`, in the order every paged kernel
takes them), the head layout of one call (`HeadShape`), and the exact rows of quantized storage
(`ExactOperands`: page heads, recent windows and this step's own rows, read by the rule of
`attention.sdpa`'s window reader).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dyngen_core.kv.attention.base import ForwardBatch
from dyngen_core.kv.quant.format import GROUP_SIZE
from dyngen_core.kv.quant.storage import QuantStorage
from dyngen_core.kv.storage import KVStorage

LOG2_E = 1.4426950408889634


def next_pow2(n: int) -> int:
    """The smallest power of two >= n (n >= 1)."""
    return 1 << (max(1, n) - 1).bit_length()


@dataclass(frozen=True)
class PageOperands:
    """What the kernel reads for one layer: page tensors (codes as int32 words, or bytes for
    6-bit codes), their float16 scales (None for float pages) and the code widths (0: float)."""

    keys: torch.Tensor
    values: torch.Tensor
    key_scales: torch.Tensor | None
    value_scales: torch.Tensor | None
    key_bits: int
    value_bits: int


def page_operands(storage: KVStorage, layer: int) -> PageOperands:
    """The page tensors of ``layer`` for the storage modes dyngen ships (fp16 and q8/q6/q4)."""
    if storage.mode == "fp16":
        return PageOperands(storage.keys[layer], storage.values[layer],  # type: ignore[attr-defined]
                            None, None, 0, 0)
    pages = storage.layers[layer]  # type: ignore[attr-defined]
    key_bits = storage.key_format.bits  # type: ignore[attr-defined]
    value_bits = storage.value_format.bits  # type: ignore[attr-defined]
    return PageOperands(_code_view(pages.key_codes, key_bits),
                        _code_view(pages.value_codes, value_bits),
                        pages.key_scales, pages.value_scales, key_bits, value_bits)


def _code_view(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """4- and 8-bit codes as int32 words (the kernel loads whole words), 6-bit ones as bytes."""
    as_bytes = codes.view(torch.uint8)
    return as_bytes if bits == 6 else as_bytes.view(torch.int32)


@dataclass(frozen=True)
class HeadShape:
    """Head layout of one attention call: query heads per KV head (and its power-of-two pad),
    head_dim and the padded width the kernels use."""

    num_kv_heads: int
    group: int
    group_pad: int
    head_dim: int
    head_pad: int

    @staticmethod
    def of(q: torch.Tensor, ops: PageOperands) -> HeadShape:
        num_heads, head_dim = q.shape[1], q.shape[2]
        num_kv_heads = ops.keys.shape[2]
        group = num_heads // num_kv_heads
        head_pad = max(next_pow2(head_dim), GROUP_SIZE if ops.key_bits else 16)
        return HeadShape(num_kv_heads, group, next_pow2(group), head_dim, head_pad)


def page_arguments(ops: PageOperands, rotation: torch.Tensor) -> tuple[object, ...]:
    """The page tensors, scales, their strides and the rotation, in the order every paged
    kernel takes them (scales default to the page tensors, unread, for float pages)."""
    ks, vs = ops.key_scales, ops.value_scales
    return (ops.keys, ops.values, *ops.keys.stride()[:3], *ops.values.stride()[:3],
            ks if ks is not None else ops.keys, vs if vs is not None else ops.values,
            *_strides3(ks), *_strides3(vs), rotation)


def _strides3(t: torch.Tensor | None) -> tuple[int, int, int]:
    return (0, 0, 0) if t is None else (t.stride(0), t.stride(1), t.stride(2))


@dataclass(frozen=True)
class ExactOperands:
    """Kernel arguments for the exact rows of one layer: head rows, window rows and their
    positions, the batch's sequence slots, and this step's own rows in the stored form
    (rotated, minus the key offsets). ``window`` 0: head rows only (the other tensors are then
    placeholders the kernel never reads)."""

    head_keys: torch.Tensor
    head_values: torch.Tensor
    ring_keys: torch.Tensor
    ring_values: torch.Tensor
    ring_positions: torch.Tensor
    seq_slots: torch.Tensor
    fresh_keys: torch.Tensor
    fresh_values: torch.Tensor
    window: int

    def arguments(self) -> tuple[object, ...]:
        """In the kernel's order: head, ring, slot and fresh pointers, then the row strides
        (every exact-row tensor is [rows, kv_heads, head_dim], contiguous)."""
        return (self.head_keys, self.head_values, self.ring_keys, self.ring_values,
                self.ring_positions, self.seq_slots, self.fresh_keys, self.fresh_values,
                self.head_keys.stride(0), self.head_keys.stride(1))


def exact_operands(storage: KVStorage, layer: int, batch: ForwardBatch,
                   step_rows: tuple[torch.Tensor, torch.Tensor] | None) -> ExactOperands | None:
    """The exact rows of ``layer`` (None for unquantized storage). ``step_rows``: this step's
    keys and values [T, kv_heads, head_dim] as computed; without them (or without sequence
    slots in the batch, or a window in the storage) only the head rows are read."""
    if not isinstance(storage, QuantStorage):
        return None
    pages = storage.layers[layer]
    heads = (pages.key_heads, pages.value_heads)
    recent = storage.recent
    if recent is None or step_rows is None or batch.seq_slots is None:
        unused = batch.query_start
        return ExactOperands(*heads, heads[0], heads[1], unused, unused, heads[0], heads[1], 0)
    ring = recent.layers[layer]
    # The rows the storage's write just prepared for these tensors: no kernel runs here.
    fresh_keys, fresh_values = storage.exact_rows(layer, *step_rows)
    return ExactOperands(*heads, ring.keys, ring.values, ring.positions, batch.seq_slots,
                         fresh_keys.contiguous(), fresh_values.contiguous(), recent.window)
