"""The recent-token window of the quantized caches: each running sequence's last few keys and
values kept unquantized, beside the quantized pages.

A query leans hardest on the keys it attends to most, its own and its nearest predecessors'
(and the first token's, which `storage.QuantStorage` keeps exact as a page head), so reading
the last few positions unquantized removes most of the error a quantized cache adds (figures:
BENCHMARKS.md, section 8); KIVI (Liu et al., 2024) keeps such a full-precision residual for the
same reason.

Layout, per layer on the layer's device: ``rows`` [2, slots * window + 1, kv_heads, head_dim] in
the compute dtype, whose halves are ``keys`` and ``values`` (one tensor, so a step's keys and
values go in with one ``index_copy_``), and ``positions`` [slots * window + 1] int32. Sequence
slot ``s`` owns rows ``s * window ... s * window + window - 1``; position ``p`` goes to row
``s * window + p % window``, and ``positions`` records which position a row holds (-1: none), so a
reader can tell a row it may use from a stale one (a slot handed to another sequence, a sequence
that restarted from a cached prefix). The last row is a spare that absorbs writes of tokens
without a slot, so a write never needs a data-dependent shape (CUDA graphs).

A query at position ``p`` reads key ``j`` from here when ``p - window < j <= p`` and the window
holds ``j`` (keys written in the same step are read from the step's own rows instead: see
`attention.sdpa`); every other key comes from the quantized pages. A sequence without a slot
(-1) keeps nothing here and reads its earlier keys from the pages alone.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass
class RecentLayer:
    """One layer's window rows (see the module docstring for the layout)."""

    rows: torch.Tensor
    positions: torch.Tensor

    @property
    def keys(self) -> torch.Tensor:
        """[slots * window + 1, kv_heads, head_dim], contiguous."""
        return self.rows[0]

    @property
    def values(self) -> torch.Tensor:
        """[slots * window + 1, kv_heads, head_dim], contiguous."""
        return self.rows[1]

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return (self.rows, self.positions)


@dataclass(frozen=True)
class WindowIndex:
    """Where one step's tokens go in every layer's window (`RecentWindow.index`).

    rows: [2T] int64, the window row of each token's key, then of each token's value (in the
        [2 * (slots * window + 1)] rows of a layer's ``rows`` tensor; unkept tokens go to the
        spare rows).
    positions: [T] int32, the position each token's row then holds (-1: none).
    """

    rows: torch.Tensor
    positions: torch.Tensor


class RecentWindow:
    """Unquantized keys/values of the last ``window`` positions of up to ``slots`` sequences.

    window: positions kept per sequence (>= 1).
    slots: sequences held at once (sequence slots 0 .. slots - 1).
    num_kv_heads, head_dim, dtype: the rows' shape and type (the model's compute dtype).
    devices: one device per layer.
    """

    def __init__(self, window: int, slots: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, devices: Sequence[torch.device]) -> None:
        if window < 1 or slots < 1:
            raise ValueError(f"a recent window needs window >= 1 and slots >= 1 "
                             f"(got window={window}, slots={slots})")
        self.window = window
        self.slots = slots
        rows = slots * window + 1
        self.layers = [
            RecentLayer(
                rows=torch.zeros(2, rows, num_kv_heads, head_dim, dtype=dtype, device=device),
                positions=torch.full((rows,), -1, dtype=torch.int32, device=device),
            )
            for device in devices
        ]

    def write_rows(self, layer: int, rows: torch.Tensor, index: WindowIndex) -> None:
        """Store a step's keys and values ``rows`` [2, T, kv_heads, head_dim] where ``index``
        (`index`, the same for every layer of a forward) puts them."""
        target = self.layers[layer]
        flat = target.rows.view(-1, *target.rows.shape[2:])
        flat.index_copy_(0, index.rows, rows.reshape(-1, *rows.shape[2:]).to(flat.dtype))
        target.positions.index_copy_(0, index.rows[: index.positions.shape[0]], index.positions)

    def index(self, positions: torch.Tensor, seq_slots: torch.Tensor,
              device: torch.device) -> WindowIndex:
        """Where tokens at ``positions`` [T] of the sequences in ``seq_slots`` [T] (-1 or out of
        range: not kept) go, on ``device``: the same in every layer. Of a sequence's tokens,
        those within ``window`` of its newest one are kept."""
        slots = seq_slots.to(device=device, dtype=torch.int64)
        pos = positions.to(device=device, dtype=torch.int64)
        spare = self.slots * self.window
        kept = (slots >= 0) & (slots < self.slots)
        # A chunk longer than the window maps several tokens to one row; only the last window
        # of them may be written (on CUDA, index_copy_ picks an arbitrary duplicate).
        owner = torch.where(kept, slots, self.slots)
        newest = torch.full((self.slots + 1,), -1, dtype=torch.int64, device=device)
        newest = newest.scatter_reduce(0, owner, pos, "amax")
        kept &= pos > newest[owner] - self.window
        rows = torch.where(kept, slots * self.window + pos % self.window, spare)
        return WindowIndex(rows=torch.cat((rows, rows + (spare + 1))),
                           positions=torch.where(kept, pos, -1).to(torch.int32))

    def gather(self, layer: int, seq_slots: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The window of each sequence in ``seq_slots`` [G] (-1: none): keys and values
        [G, window, kv_heads, head_dim] and the position each row holds [G, window] (-1 where
        the row holds nothing usable)."""
        target = self.layers[layer]
        device = target.rows.device
        slots = seq_slots.to(device=device, dtype=torch.int64)
        kept = (slots >= 0) & (slots < self.slots)
        base = torch.where(kept, slots, 0) * self.window
        rows = base[:, None] + torch.arange(self.window, device=device)[None, :]
        positions = torch.where(kept[:, None], target.positions[rows], -1)
        return target.keys[rows], target.values[rows], positions

    def clear(self, seq_slots: Sequence[int]) -> None:
        """Forget what the given slots hold (they now belong to new sequences)."""
        if not seq_slots:
            return
        for target in self.layers:
            device = target.positions.device
            index = torch.tensor(list(seq_slots), dtype=torch.int64, device=device)
            rows = (index[:, None] * self.window
                    + torch.arange(self.window, device=device)[None, :]).flatten()
            target.positions.index_fill_(0, rows, -1)

    def nbytes(self) -> int:
        """Bytes held over all layers (`row_nbytes` per row and layer)."""
        return sum(t.numel() * t.element_size() for layer in self.layers for t in layer.tensors())


def row_nbytes(num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """Bytes one row of a `RecentWindow` takes in one layer: its key, its value and the
    position it records."""
    element = torch.empty((), dtype=dtype).element_size()
    return 2 * num_kv_heads * head_dim * element + torch.int32.itemsize
