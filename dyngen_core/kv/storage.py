"""The protocol behind every KV storage mode (fp16, q8, q6, q4).

Storage owns the tensors behind pages: per layer, on that layer's device. It knows nothing of
jobs; it is addressed by slots (page * page_size + offset) and page ids, and, for state kept per
running sequence (the quantized modes' recent window), by sequence slots the runner assigns.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from dyngen_core.engine.plan import PageCopy


class KVStorage(Protocol):
    """Paged key/value storage for every layer of one model."""

    mode: str
    page_size: int
    num_pages: int

    def write(self, layer: int, key: torch.Tensor, value: torch.Tensor,
              slot_mapping: torch.Tensor, *,
              decode_window: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        """Store key/value rows [T, num_kv_heads, head_dim] at the given flat slots. Where
        the write runs in Triton (CUDA with triton installed), a row at a slot outside the
        storage (-1: a CUDA graph's padding) is not stored; the torch writers take only slots
        inside it. ``decode_window``: (positions, sequence slots) [T] when the step is
        decode-only (one token per sequence): a storage with per-sequence state may store it
        now, in the same pass, and then make the `write_recent` of the same tensors a no-op;
        others ignore it."""

    def write_recent(self, layer: int, key: torch.Tensor, value: torch.Tensor,
                     positions: torch.Tensor, seq_slots: torch.Tensor) -> None:
        """Keep the step's rows in per-sequence state (the quantized modes' recent window):
        ``positions`` and ``seq_slots`` [T] give each token's position and its sequence's slot
        (-1: none). Backends call it after the layer's attention, which must still see the
        rows of earlier steps; a no-op for storages that keep no such state."""

    def gather(self, layer: int, page_table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of the pages in ``page_table`` [B, P], in compute dtype, as
        [B, P * page_size, num_kv_heads, head_dim]. Quantized modes dequantize only these pages."""

    def reserve_sequences(self, count: int) -> int:
        """Make room for per-sequence state of up to ``count`` sequences at once and return how
        many it made room for, n (slots 0 .. n - 1; readers then pass sequence slots, -1 for a
        sequence without one, which then reads the pages alone); 0 and a no-op for storages
        that keep no such state. A storage may hold fewer than ``count``."""

    def clear_sequences(self, seq_slots: Sequence[int]) -> None:
        """Forget the per-sequence state of ``seq_slots`` (they now belong to new sequences)."""

    def copy_pages(self, copies: Sequence[PageCopy]) -> None:
        """Copy slot ranges between pages, in every layer, in order."""

    def nbytes(self) -> int:
        """Device memory held by the storage tensors."""


def copies_independent(copies: Sequence[PageCopy]) -> bool:
    """True when no copy reads a page that any copy writes and no page is written twice: the
    copies may then run at once, in any order."""
    written = {c.dst for c in copies}
    return not any(c.src in written for c in copies) and len(written) == len(copies)


def copy_page_slots(tensors: Sequence[torch.Tensor], copies: Sequence[PageCopy]) -> None:
    """Copy the first ``num_slots`` slots of page ``src`` to page ``dst`` in every tensor of
    ``tensors`` (each indexed [num_pages, page_size, ...], any strides), in the order of
    ``copies``: one indexed copy per tensor when the copies are independent (the common case:
    partial-page reuse, defrag moves into free pages), else copy by copy."""
    if not copies:
        return
    if not copies_independent(copies):
        for copy in copies:
            for tensor in tensors:
                tensor[copy.dst, :copy.num_slots] = tensor[copy.src, :copy.num_slots]
        return
    # (page read, page written, slot) of every slot copied: [3, slots copied]
    moves = [(c.src, c.dst, slot) for c in copies for slot in range(c.num_slots)]
    if not moves:
        return
    indices: dict[torch.device, torch.Tensor] = {}
    for tensor in tensors:
        if tensor.device not in indices:
            indices[tensor.device] = torch.tensor(moves, device=tensor.device).T
        src, dst, slot = indices[tensor.device]
        tensor[dst, slot] = tensor[src, slot]
