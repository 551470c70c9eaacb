"""Turning a `StepPlan` (plain integers) into the `ForwardBatch` tensors a forward reads.

Everything is assembled on the host as Python lists, then each field becomes one tensor moved to
the device without blocking, so building a batch costs one small copy per field.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from dyngen_core.attention.base import ForwardBatch
from dyngen_core.plan import SequenceSlice, StepPlan


@dataclass
class _HostBatch:
    input_ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    slot_mapping: list[int] = field(default_factory=list)
    query_start: list[int] = field(default_factory=lambda: [0])
    context_lens: list[int] = field(default_factory=list)
    page_rows: list[list[int]] = field(default_factory=list)
    logits_indices: list[int] = field(default_factory=list)
    query_lens: list[int] = field(default_factory=list)

    def add(self, piece: SequenceSlice, page_size: int) -> None:
        tokens = piece.token_ids + piece.draft_ids
        if not tokens:
            raise ValueError(f"job {piece.job_id}: a slice must feed at least one token")
        pages_needed = -(-piece.end_pos // page_size)
        if len(piece.page_table) < pages_needed:
            raise ValueError(
                f"job {piece.job_id}: page table has {len(piece.page_table)} pages but "
                f"positions up to {piece.end_pos} need {pages_needed} of {page_size} slots"
            )
        offset = len(self.input_ids)
        positions = range(piece.start_pos, piece.end_pos)
        self.input_ids.extend(tokens)
        self.positions.extend(positions)
        self.slot_mapping.extend(piece.page_table[p // page_size] * page_size + p % page_size
                                 for p in positions)
        self.query_start.append(offset + len(tokens))
        self.context_lens.append(piece.end_pos)
        self.page_rows.append(piece.page_table[:pages_needed])
        self.query_lens.append(len(tokens))
        end = offset + len(tokens)
        self.logits_indices.extend(range(end - piece.num_logits, end))


def build_forward_batch(plan: StepPlan, page_size: int, device: str | torch.device,
                        seq_slots: Sequence[int] | None = None) -> ForwardBatch:
    """The forward metadata for ``plan.slices`` (page copies are not part of it).

    plan: the step; slices are flattened in order, each slice's tokens being its
        ``token_ids`` followed by its ``draft_ids`` at positions ``start_pos ...``.
    page_size: slots per page (slot = page * page_size + offset).
    device: where the tensors go (the model's device).
    seq_slots: each slice's sequence slot (per-sequence storage state; -1 for none), or None.
    logits_indices lists, for each slice with ``sample=True``, its last ``num_logits`` rows.
    """
    host = _HostBatch()
    for piece in plan.slices:
        host.add(piece, page_size)
    width = max((len(row) for row in host.page_rows), default=0)
    page_table = [row + [0] * (width - len(row)) for row in host.page_rows]
    target = torch.device(device)

    def to_device(values: list[int] | list[list[int]], dtype: torch.dtype) -> torch.Tensor:
        tensor = torch.tensor(values, dtype=dtype)
        if target.type == "cuda":
            tensor = tensor.pin_memory()
        return tensor.to(target, non_blocking=True)

    slot_tensors = None
    if seq_slots is not None:
        if len(seq_slots) != len(plan.slices):
            raise ValueError(f"{len(seq_slots)} sequence slots for {len(plan.slices)} slices")
        slots = list(seq_slots)
        per_token = [s for s, n in zip(slots, host.query_lens, strict=True) for _ in range(n)]
        slot_tensors = (to_device(slots, torch.int32), to_device(per_token, torch.int32))
    return ForwardBatch(
        input_ids=to_device(host.input_ids, torch.long),
        positions=to_device(host.positions, torch.long),
        slot_mapping=to_device(host.slot_mapping, torch.long),
        query_start=to_device(host.query_start, torch.int32),
        context_lens=to_device(host.context_lens, torch.int32),
        page_table=to_device(page_table, torch.int32).reshape(len(page_table), width),
        logits_indices=to_device(host.logits_indices, torch.long),
        query_lens_host=host.query_lens,
        context_lens_host=host.context_lens,
        page_size=page_size,
        page_tables_host=host.page_rows,
        seq_slots=slot_tensors[0] if slot_tensors else None,
        token_seq_slots=slot_tensors[1] if slot_tensors else None,
    )
