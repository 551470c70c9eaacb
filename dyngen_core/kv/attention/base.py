"""The forward metadata every attention backend reads, how a plan becomes it, and the backend
protocol.

`ForwardBatch` describes one flattened forward: T tokens from B sequences (prefill chunks and
decode tokens mixed), each sequence's page table and context length. It is built once per step
from a `StepPlan` and passed down as an argument (never a global: a draft model and the target
share a process).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import torch

from dyngen_core.engine.plan import SequenceSlice, StepPlan
from dyngen_core.kv.storage import KVStorage

if TYPE_CHECKING:
    import numpy as np


@dataclass
class ForwardBatch:
    """Tensors on the model's device, plus host copies of the small shapes (no device syncs).

    input_ids, positions, slot_mapping: [T] (int64); slot = page * page_size + offset.
    query_start: [B + 1] (int32) cumulative query lengths (cu_seqlens_q).
    context_lens: [B] (int32) tokens in cache for each sequence once this step is written.
    page_table: [B, max_pages] (int32), padded with 0 beyond a sequence's pages.
    logits_indices: [S] (int64) rows of the flattened tokens whose logits are wanted.
    query_lens_host / context_lens_host: the same lengths as Python lists.
    page_tables_host: each sequence's pages as Python lists (unpadded), or None where the batch
        was not built from a plan (replayed CUDA graphs).
    seq_slots: [B] (int32) each sequence's slot for per-sequence storage state (the recent
        window of quantized caches), -1 for none; token_seq_slots: [T] the same per token.
        None when the runner assigned no slots.
    graph_tables: what a CUDA graph's batch carries for its backend (`GraphTables.views`: views
        of the graph's static buffers); None elsewhere.
    memo: what a backend derives from the host lists once per forward and reuses in every
        layer (query blocks, launch tables), keyed by the backend. It lives as long as the
        batch, so a CUDA graph that keeps its batch keeps the device tables its capture read.
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    query_start: torch.Tensor
    context_lens: torch.Tensor
    page_table: torch.Tensor
    logits_indices: torch.Tensor
    query_lens_host: list[int]
    context_lens_host: list[int]
    page_size: int
    page_tables_host: list[list[int]] | None = None
    seq_slots: torch.Tensor | None = None
    token_seq_slots: torch.Tensor | None = None
    graph_tables: object | None = None
    memo: dict[object, object] = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens_host)

    @property
    def is_decode_only(self) -> bool:
        # max() runs in C: backends ask this every layer of an eager forward.
        return not self.query_lens_host or max(self.query_lens_host) == 1

    @property
    def decode_window(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(positions, token_seq_slots) of a decode-only batch with sequence slots, else None:
        what `KVStorage.write`'s ``decode_window`` takes."""
        if self.token_seq_slots is None or not self.is_decode_only:
            return None
        return self.positions, self.token_seq_slots


class AttentionBackend(Protocol):
    """Writes this step's keys/values into storage and attends over each sequence's pages.

    q: [T, num_heads, head_dim]; k, v: [T, num_kv_heads, head_dim] (rotary already applied).
    Returns [T, num_heads, head_dim]. Attention is causal within a sequence: the token at
    position p sees cache slots 0..p of its own sequence.
    """

    name: str

    def attend(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        storage: KVStorage,
        batch: ForwardBatch,
        scale: float,
    ) -> torch.Tensor: ...


class GraphTables(Protocol):
    """A backend's own int32 tables that a graphed decode step reads from a fixed region of the
    graph's static inputs (the Triton backend's shared-prefix groups), for batches of up to the
    capacity they were made for.

    `graphs.StepGraphs` holds ``size`` entries for them in its static int32 buffer. Each step
    it asks `stage` for the step's writer before its staging buffers are free, runs the writer on
    the host copy of the region (copied to the device with the step's metadata) and replays a
    graph whose batch carries `views` of the device copy (``ForwardBatch.graph_tables``); a step
    `stage` gives None replays the plain graph.
    """

    size: int

    def stage(self, plan: StepPlan) -> Callable[[np.ndarray], None] | None:
        """What writes the tables of the decode step ``plan`` into the host region (int32,
        ``size`` entries); None when the step needs none."""
        ...

    def views(self, region: torch.Tensor, bucket: int) -> object:
        """What the batch of a graph of ``bucket`` sequences carries: views of the device
        ``region``."""
        ...


@runtime_checkable
class GraphTablesBackend(Protocol):
    """A backend whose graphed decode reads tables of its own (`GraphTables`)."""

    def graph_tables(self, storage: KVStorage, num_heads: int, num_kv_heads: int,
                     capacity: int) -> GraphTables | None:
        """The tables of one set of decode graphs over batches of up to ``capacity`` sequences
        of this head layout; None when this backend needs none over ``storage``."""
        ...


@runtime_checkable
class PrefillShapesBackend(Protocol):
    """A backend whose short prefills take launch shapes of their own, compiled on first use."""

    def short_prefill_lengths(self, storage: KVStorage, dtype: torch.dtype,
                              group: int) -> tuple[int, ...]:
        """One prompt length per launch shape of short prefills over ``storage`` for a model
        of this dtype and ``group`` query heads per KV head (a start-up prefill of each
        compiles them before users' jobs need them); () when there are none."""
        ...


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
