"""The reference attention backend: read each sequence's cached keys/values, then PyTorch's
``scaled_dot_product_attention`` with a per-sequence causal mask; and the reference semantics of
reading a quantized cache with a recent-token window (`extend_with_recent`).

Runs on any device. Sequences are padded into one batched call per group: decode tokens (one
query each) form one group, prefill chunks another, so a long prefill does not pad every decode
to its length. The group layout (indices, slots, masks) is built once per forward and reused by
every layer.

Two ways to read the cache: unquantized storage is read slot by slot (only the slots a group
attends over, into one scratch buffer reused by every layer), since copying whole 256-slot pages
into a fresh tensor per layer cost more than the attention itself on the CPU; quantized storage
is read page by page through ``KVStorage.gather``, which dequantizes only those pages.

The window rule: a query at position ``p`` reads key ``j`` (and its value) unquantized when
``p - window < j <= p`` and an exact row of ``j`` is at hand: the step's own rows for positions
written in this step, else the sequence's recent window (`quant.window`) when it still holds
``j``. Every other visible key comes from the pages (whose head rows are exact as well). Each
key is counted once. `extend_with_recent` builds that for one padded group: the page keys are
followed by the exact rows (window rows, then the step's rows) and one mask says which copy each
query sees. The Triton backend implements the same rule in its kernels and is tested against
this.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate

import torch
import torch.nn.functional as F

from dyngen_core.kv.attention.base import ForwardBatch
from dyngen_core.kv.fp16 import FP16Storage
from dyngen_core.kv.quant.storage import QuantStorage
from dyngen_core.kv.storage import KVStorage


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


@dataclass
class _Group:
    """Sequences attended in one padded call.

    page_table: [G, P] pages (trimmed to the group's longest context).
    slots: [G * key_len] cache slot of each sequence's key position; positions past a
        sequence's context repeat its last slot (masked, but always real, finite data).
    token_rows: [Tg] rows of the flattened batch, or None when the group is the whole batch.
    seq_of_row, pos_in_seq: [Tg] where each row goes in the padded query [G, max_query, ...];
        None for decode groups (one query per sequence, no padding).
    mask: [G, 1, max_query, key_len] True where a query may see a key; None when every query
        sees every key (decodes of equal context length).
    layout: where the group's sequences and query rows sit in the batch, for the recent window
        of quantized storage; None when the step reads no window.
    """

    page_table: torch.Tensor
    slots: torch.Tensor
    token_rows: torch.Tensor | None
    seq_of_row: torch.Tensor | None
    pos_in_seq: torch.Tensor | None
    max_query: int
    key_len: int
    mask: torch.Tensor | None
    layout: GroupLayout | None


class SdpaBackend:
    """Reference backend over any KVStorage (the oracle other backends are tested against).
    Unquantized (`FP16Storage`) caches are read slot by slot into a scratch buffer that grows
    to the largest single layer's read and is kept for the next forward."""

    name = "sdpa"

    def __init__(self) -> None:
        # The layout of the batch being run, reused by every layer of the same forward.
        self._cached: tuple[ForwardBatch, torch.device, bool, list[_Group]] | None = None
        self._scratch: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               storage: KVStorage, batch: ForwardBatch, scale: float) -> torch.Tensor:
        """Write k/v [T, Hkv, D] to storage, then attend q [T, H, D]; returns [T, H, D]."""
        storage.write(layer, k, v, batch.slot_mapping, decode_window=batch.decode_window)
        recent = (isinstance(storage, QuantStorage) and storage.recent is not None
                  and batch.seq_slots is not None)
        groups = self._groups(batch, q.device, recent)
        if len(groups) == 1 and groups[0].token_rows is None:
            out = self._attend(layer, q, k, v, storage, batch, groups[0], scale)
        else:
            out = torch.empty_like(q)
            for group in groups:
                assert group.token_rows is not None
                rows = q.index_select(0, group.token_rows)
                out.index_copy_(0, group.token_rows,
                                self._attend(layer, rows, k, v, storage, batch, group, scale))
        if batch.token_seq_slots is not None:
            storage.write_recent(layer, k, v, batch.positions, batch.token_seq_slots)
        return out

    def _attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                storage: KVStorage, batch: ForwardBatch, group: _Group,
                scale: float) -> torch.Tensor:
        keys, values = self._read(layer, storage, group)
        mask = group.mask
        if group.layout is not None:  # planned for a quantized storage with recent windows
            assert isinstance(storage, QuantStorage) and batch.seq_slots is not None
            keys, values, mask = extend_with_recent(storage, layer, batch.seq_slots, k, v,
                                                    group.layout, keys, values)
        return _attend_group(q, keys, values, group, scale, mask)

    def _groups(self, batch: ForwardBatch, device: torch.device, recent: bool) -> list[_Group]:
        """The batch's groups, with the window layout only when ``recent`` needs it."""
        cached = self._cached
        if cached is not None and cached[0] is batch and cached[1:3] == (device, recent):
            return cached[3]
        groups = _plan_groups(batch, device, recent)
        self._cached = (batch, device, recent, groups)
        return groups

    def _read(self, layer: int, storage: KVStorage,
              group: _Group) -> tuple[torch.Tensor, torch.Tensor]:
        """The group's keys and values, each [G, key_len, Hkv, D]."""
        if isinstance(storage, FP16Storage):
            return self._read_slots(storage.keys[layer], storage.values[layer], group)
        keys, values = storage.gather(layer, group.page_table)
        return keys[:, :group.key_len], values[:, :group.key_len]

    def _read_slots(self, keys: torch.Tensor, values: torch.Tensor,
                    group: _Group) -> tuple[torch.Tensor, torch.Tensor]:
        row_shape = keys.shape[2:]
        rows = group.slots.shape[0]
        size = rows * keys[0, 0].numel()
        scratch = self._scratch_for(keys.device, keys.dtype, 2 * size)
        shape = (group.page_table.shape[0], group.key_len, *row_shape)
        slots = group.slots.to(keys.device, non_blocking=True)
        out = []
        for part, source in enumerate((keys, values)):
            buffer = scratch[part * size:(part + 1) * size].view(rows, *row_shape)
            torch.index_select(source.view(-1, *row_shape), 0, slots, out=buffer)
            out.append(buffer.view(shape))
        return out[0], out[1]

    def _scratch_for(self, device: torch.device, dtype: torch.dtype,
                     size: int) -> torch.Tensor:
        scratch = self._scratch.get((device, dtype))
        if scratch is None or scratch.numel() < size:
            scratch = torch.empty(size, device=device, dtype=dtype)
            self._scratch[(device, dtype)] = scratch
        return scratch


def _attend_group(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, group: _Group,
                  scale: float, mask: torch.Tensor | None) -> torch.Tensor:
    """q: the group's rows [Tg, H, D]; keys/values [G, keys, Hkv, D] -> [Tg, H, D]."""
    keys, values = keys.transpose(1, 2), values.transpose(1, 2)
    if group.seq_of_row is None:
        padded = q.unsqueeze(2)
    else:
        padded = q.new_zeros(group.page_table.shape[0], group.max_query, *q.shape[1:])
        padded[group.seq_of_row, group.pos_in_seq] = q
        padded = padded.transpose(1, 2)
    out = F.scaled_dot_product_attention(padded.to(keys.dtype), keys, values,
                                         attn_mask=mask, scale=scale,
                                         enable_gqa=keys.shape[1] != q.shape[1])
    out = out.to(q.dtype)
    if group.seq_of_row is None:
        return out.squeeze(2)
    return out.transpose(1, 2)[group.seq_of_row, group.pos_in_seq]


def _plan_groups(batch: ForwardBatch, device: torch.device, recent: bool) -> list[_Group]:
    seqs = range(batch.num_seqs)
    decodes = [i for i in seqs if batch.query_lens_host[i] == 1]
    prefills = [i for i in seqs if batch.query_lens_host[i] != 1]
    if not decodes or not prefills:
        return [_make_group(batch, list(seqs), device, whole_batch=True, recent=recent)]
    return [_make_group(batch, decodes, device, whole_batch=False, recent=recent),
            _make_group(batch, prefills, device, whole_batch=False, recent=recent)]


def _make_group(batch: ForwardBatch, seq_ids: list[int], device: torch.device,
                whole_batch: bool, recent: bool) -> _Group:
    all_starts = [0, *accumulate(batch.query_lens_host)]
    query_lens = [batch.query_lens_host[i] for i in seq_ids]
    context_lens = [batch.context_lens_host[i] for i in seq_ids]
    max_query, key_len = max(query_lens), max(context_lens)
    page_table = batch.page_table.to(device)[:, :-(-key_len // batch.page_size)]
    if not whole_batch:
        page_table = page_table.index_select(0, _tensor(seq_ids, device))
    rows: list[int] = []
    seq_of_row: list[int] = []
    pos_in_seq: list[int] = []
    for local, seq in enumerate(seq_ids):
        qlen = batch.query_lens_host[seq]
        rows.extend(range(all_starts[seq], all_starts[seq] + qlen))
        seq_of_row.extend([local] * qlen)
        pos_in_seq.extend(range(qlen))
    padded = max_query > 1
    sees_all = not padded and min(context_lens) == key_len
    return _Group(
        page_table=page_table,
        slots=_slots(page_table, context_lens, key_len, batch.page_size),
        token_rows=None if whole_batch else _tensor(rows, device),
        seq_of_row=_tensor(seq_of_row, device) if padded else None,
        pos_in_seq=_tensor(pos_in_seq, device) if padded else None,
        max_query=max_query,
        key_len=key_len,
        mask=None if sees_all else _causal_mask(context_lens, query_lens, key_len, device),
        layout=_layout(seq_ids, all_starts, query_lens, context_lens, max_query, device)
        if recent else None,
    )


def _layout(seq_ids: list[int], all_starts: list[int], query_lens: list[int],
            context_lens: list[int], max_query: int, device: torch.device) -> GroupLayout:
    step_rows = [all_starts[seq] + min(i, qlen - 1)
                 for seq, qlen in zip(seq_ids, query_lens, strict=True) for i in range(max_query)]
    return GroupLayout(
        seq_index=_tensor(seq_ids, device),
        first_pos=_tensor([c - q for c, q in zip(context_lens, query_lens, strict=True)], device),
        query_lens=_tensor(query_lens, device),
        step_rows=_tensor(step_rows, device).view(len(seq_ids), max_query),
    )


def _slots(page_table: torch.Tensor, context_lens: list[int], key_len: int,
           page_size: int) -> torch.Tensor:
    """[G * key_len] slot of every key position, clamped to each sequence's last position."""
    device = page_table.device
    positions = torch.arange(key_len, device=device)[None, :]
    last = _tensor([c - 1 for c in context_lens], device)[:, None]
    positions = torch.minimum(positions, last)
    pages = page_table.to(torch.long).gather(1, positions // page_size)
    return (pages * page_size + positions % page_size).flatten()


def _causal_mask(context_lens: list[int], query_lens: list[int], key_len: int,
                 device: torch.device) -> torch.Tensor:
    """[G, 1, max_query, key_len]: query j of a sequence sits at position
    context_len - query_len + j and sees slots up to it."""
    first_pos = _tensor([c - q for c, q in zip(context_lens, query_lens, strict=True)], device)
    query_pos = first_pos[:, None] + torch.arange(max(query_lens), device=device)[None, :]
    mask = torch.arange(key_len, device=device)[None, None, :] <= query_pos[:, :, None]
    return mask.unsqueeze(1)


def _tensor(values: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.long).to(device, non_blocking=True)
