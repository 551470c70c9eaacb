"""The exact-row operands the Triton kernel reads beside quantized pages.

Quantized storage keeps some rows unquantized (`storage.quant`: the head row of every page, and
for q6/q4 each running sequence's recent window); the rule for which rows a query reads exactly
is `sdpa_recent`'s. This module gathers what `triton_kernels.paged_attention_kernel` needs for it
into one launch-ready bundle: the head rows, the window rows and their positions, the batch's
sequence slots, and this step's own rows in the stored form (rotated, minus the key offsets).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dyngen_core.kv.attention.base import ForwardBatch
from dyngen_core.kv.quant.storage import QuantStorage
from dyngen_core.kv.storage import KVStorage


@dataclass(frozen=True)
class ExactOperands:
    """Kernel arguments for the exact rows of one layer. ``window`` 0: head rows only (the
    other tensors are then placeholders the kernel never reads)."""

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
