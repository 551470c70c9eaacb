"""The protocol behind every KV storage mode (fp16, q8, q6, q4).

Storage owns the tensors behind pages: per layer, on that layer's device. It knows nothing of
jobs; it is addressed by slots (page * page_size + offset) and page ids, and, for state kept per
running sequence (the quantized modes' recent window), by sequence slots the runner assigns.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np
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


def slot_moves(copies: Sequence[PageCopy]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """What running ``copies`` in order (each the first ``num_slots`` slots of page ``src`` onto
    page ``dst``) comes to, as moves that may all run at once, every read before any write:
    (page read, page written, slot) int64 arrays, one entry per slot whose content changes.
    A copy that reads what an earlier one wrote reads that one's source instead, so chains
    and cycles (defragmentation's, through its spare page) resolve into one gather and one
    scatter, and a slot copied back where it came from does not move."""
    if not copies:
        empty = np.zeros(0, dtype=np.int64)
        return empty, empty, empty
    pages = np.array(sorted({c.src for c in copies} | {c.dst for c in copies}), dtype=np.int64)
    row = {int(page): i for i, page in enumerate(pages)}
    width = max(c.num_slots for c in copies)
    origin = np.repeat(pages[:, None], width, axis=1)  # where each slot's content comes from
    for c in copies:
        origin[row[c.dst], :c.num_slots] = origin[row[c.src], :c.num_slots]
    rows, slots = np.nonzero(origin != pages[:, None])
    return origin[rows, slots], pages[rows], slots


def copy_page_slots(tensors: Sequence[torch.Tensor], copies: Sequence[PageCopy]) -> None:
    """Copy the first ``num_slots`` slots of page ``src`` to page ``dst`` in every tensor of
    ``tensors`` (each indexed [num_pages, page_size, ...], any strides), with the result of
    running ``copies`` in order, as one indexed copy per tensor (`slot_moves`)."""
    moves = slot_moves(copies)
    if not len(moves[0]):
        return
    indices: dict[torch.device, torch.Tensor] = {}
    for tensor in tensors:
        if tensor.device not in indices:
            indices[tensor.device] = torch.from_numpy(np.stack(moves)).to(tensor.device)
        src, dst, slot = indices[tensor.device]
        tensor[dst, slot] = tensor[src, slot]
