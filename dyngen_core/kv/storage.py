"""The protocol behind every KV storage mode (fp16, q8, q6, q4).

Storage owns the tensors behind pages: per layer, on that layer's device. It knows nothing of
jobs; it is addressed by slots (page * page_size + offset) and page ids, and, for state kept per
running sequence (the quantized modes' recent window), by sequence slots the runner assigns.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

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


class DeviceMoves(NamedTuple):
    """`PageMoves` as int64 tensors on one device, with the pages whose slot 0 moves (a page's
    per-page rows, such as the quantized storage's head rows, follow its slot 0)."""

    page_src: torch.Tensor
    page_dst: torch.Tensor
    slot_src: torch.Tensor
    slot_dst: torch.Tensor
    slot: torch.Tensor
    head_src: torch.Tensor
    head_dst: torch.Tensor


@dataclass
class PageMoves:
    """What running a list of page copies in order comes to, as moves that may all run at
    once, every read before any write (`resolve_copies`): whole pages (``page_src[i]`` onto
    ``page_dst[i]``) and single slots (slot ``slot[i]`` of ``slot_src[i]`` onto the same slot
    of ``slot_dst[i]``); int64 arrays."""

    page_src: np.ndarray
    page_dst: np.ndarray
    slot_src: np.ndarray
    slot_dst: np.ndarray
    slot: np.ndarray
    _on: dict[torch.device, DeviceMoves] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(len(self.page_src) or len(self.slot))

    def on(self, device: torch.device) -> DeviceMoves:
        """The moves as tensors on ``device`` (made once a device, for every layer there)."""
        if device not in self._on:
            first = self.slot == 0
            arrays = (self.page_src, self.page_dst, self.slot_src, self.slot_dst, self.slot,
                      np.concatenate([self.page_src, self.slot_src[first]]),
                      np.concatenate([self.page_dst, self.slot_dst[first]]))
            self._on[device] = DeviceMoves(*(torch.from_numpy(a).to(device) for a in arrays))
        return self._on[device]


def resolve_copies(copies: Sequence[PageCopy], page_size: int) -> PageMoves:
    """The moves ``copies`` (each the first ``num_slots`` slots of page ``src`` onto page
    ``dst``, in order) come to: a copy that reads what an earlier one wrote reads that one's
    source instead, so chains and cycles (defragmentation's, through its spare page) resolve
    into moves that run at once; a slot that ends where it started does not move. A page all
    of whose ``page_size`` slots come from one other page is a whole-page move."""
    empty = np.zeros(0, dtype=np.int64)
    if not copies:
        return PageMoves(empty, empty, empty, empty, empty)
    pages = np.array(sorted({c.src for c in copies} | {c.dst for c in copies}), dtype=np.int64)
    row = {int(page): i for i, page in enumerate(pages)}
    width = max(c.num_slots for c in copies)
    origin = np.repeat(pages[:, None], width, axis=1)  # where each slot's content comes from
    for c in copies:
        origin[row[c.dst], :c.num_slots] = origin[row[c.src], :c.num_slots]
    moved = origin != pages[:, None]
    whole = moved.all(axis=1) & (origin == origin[:, :1]).all(axis=1) if width == page_size \
        else np.zeros(len(pages), dtype=bool)
    rows, slots = np.nonzero(moved & ~whole[:, None])
    return PageMoves(origin[whole, 0], pages[whole], origin[rows, slots], pages[rows], slots)


def copy_page_slots(tensors: Sequence[torch.Tensor], moves: PageMoves) -> None:
    """Run ``moves`` (`resolve_copies`) in every tensor of ``tensors`` (each indexed
    [num_pages, page_size, ...], any strides): a tensor's whole pages and single slots are
    both gathered before either is scattered (a move may read a page another one writes)."""
    if not moves:
        return
    for tensor in tensors:
        on = moves.on(tensor.device)
        pages = tensor.index_select(0, on.page_src) if len(on.page_src) else None
        slots = tensor[on.slot_src, on.slot] if len(on.slot) else None
        if pages is not None:
            tensor.index_copy_(0, on.page_dst, pages)
        if slots is not None:
            tensor[on.slot_dst, on.slot] = slots
