"""The reference semantics of reading a quantized cache with a recent-token window.

A query at position ``p`` reads key ``j`` (and its value) unquantized when ``p - window < j <= p``
and an exact row of ``j`` is at hand: the step's own rows for positions written in this step,
else the sequence's recent window (`storage.recent`) when it still holds ``j``. Every other
visible key comes from the pages (whose head rows are exact as well). Each key is counted once.

`extend_with_recent` builds that for one padded group of `sdpa`: the page keys are followed by
the exact rows (window rows, then the step's rows) and one mask says which copy each query sees.
The Triton backend implements the same rule in its kernel and is tested against this.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dyngen_core.kv.quant.storage import QuantStorage


@dataclass(frozen=True)
class GroupLayout:
    """What the window rule needs of one padded group of G sequences, Q query rows each.

    seq_index: [G] the sequences' indices in the batch.
    first_pos: [G] position of each sequence's first query token (context - query length).
    query_lens: [G] query tokens per sequence.
    step_rows: [G, Q] row of the flattened batch of each query token (clamped for padding).
    """

    seq_index: torch.Tensor
    first_pos: torch.Tensor
    query_lens: torch.Tensor
    step_rows: torch.Tensor


def extend_with_recent(storage: QuantStorage, layer: int, seq_slots: torch.Tensor,
                       step_keys: torch.Tensor, step_values: torch.Tensor, layout: GroupLayout,
                       page_keys: torch.Tensor, page_values: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Page keys/values [G, L, Hkv, D] extended by the exact rows, and the mask
    [G, 1, Q, L + window + Q] of what each query reads.

    seq_slots: [B] the batch's sequence slots; step_keys / step_values: [T, Hkv, D] the step's
    rows as computed (this function applies the storage's key offsets).
    """
    window = storage.recent_window
    recent = storage.gather_recent(layer, seq_slots.index_select(0, layout.seq_index))
    assert recent is not None
    ring_keys, ring_values, ring_pos = recent
    device = page_keys.device
    length = page_keys.shape[1]
    queries = layout.step_rows.shape[1]
    first = layout.first_pos[:, None]
    query_pos = first + torch.arange(queries, device=device)[None, :]
    # The window is written after attention, so it holds earlier steps' rows only; the guard
    # keeps a row of a position at or past this step (a slot's stale future) out regardless.
    ring_pos = torch.where(ring_pos < first, ring_pos, -1).to(torch.long)
    step_pos = torch.where(torch.arange(queries, device=device)[None, :]
                           < layout.query_lens[:, None], query_pos, -1)
    exact_pos = torch.cat((ring_pos, step_pos), dim=1)
    rows = layout.step_rows.flatten()
    fresh_keys = storage.stored_keys(layer, step_keys).index_select(0, rows)
    fresh_values = step_values.index_select(0, rows)
    shape = (*layout.step_rows.shape, *step_keys.shape[1:])
    keys = torch.cat((page_keys, ring_keys.to(page_keys.dtype),
                      fresh_keys.view(shape).to(page_keys.dtype)), dim=1)
    values = torch.cat((page_values, ring_values.to(page_values.dtype),
                        fresh_values.view(shape).to(page_values.dtype)), dim=1)
    qp = query_pos[:, :, None]
    sees_exact = (exact_pos[:, None, :] >= 0) & (exact_pos[:, None, :] <= qp) & (
        exact_pos[:, None, :] > qp - window)
    held = _held_positions(ring_pos, first, length)
    j = torch.arange(length, device=device)[None, None, :]
    covered = (j > qp - window) & (j <= qp) & held[:, None, :]
    sees_page = (j <= qp) & ~covered
    return keys, values, torch.cat((sees_page, sees_exact), dim=2).unsqueeze(1)


def _held_positions(ring_pos: torch.Tensor, first: torch.Tensor, length: int) -> torch.Tensor:
    """[G, length]: True where an exact row exists: the step's positions and the window's."""
    held = torch.zeros(ring_pos.shape[0], length + 1, dtype=torch.bool, device=ring_pos.device)
    spare = torch.where((ring_pos >= 0) & (ring_pos < length), ring_pos, length)
    held.scatter_(1, spare, True)
    positions = torch.arange(length, device=ring_pos.device)[None, :]
    return held[:, :length] | (positions >= first)
