"""The forward metadata every attention backend reads, and the backend protocol.

`ForwardBatch` describes one flattened forward: T tokens from B sequences (prefill chunks and
decode tokens mixed), each sequence's page table and context length. It is built once per step
from a `StepPlan` and passed down as an argument (never a global: a draft model and the target
share a process).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import torch

from dyngen_core.plan import StepPlan
from dyngen_core.storage.base import KVStorage

if TYPE_CHECKING:
    from dyngen_core.attention.shared_prefix import CascadePlan
    from dyngen_core.attention.triton_cascade_tables import CascadeTables, StaticCascadeLayout


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
    cascade: shared-prefix tables a CUDA graph's batch carries (views of its static buffers,
        `SharedPrefixGraphs`); None elsewhere (an eager forward plans from page_tables_host).
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
    cascade: CascadeTables | None = None

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


@runtime_checkable
class SharedPrefixGraphs(Protocol):
    """A backend that runs shared-prefix ("cascade") decode attention inside CUDA graphs.

    `graphs.DecodeGraphs` plans every decode step (`plan_cascade`); a step with a plan fills
    the tables into a region of its static buffers laid out by `cascade_layout` and replays a
    graph whose batch carries them (``ForwardBatch.cascade``).
    """

    def cascade_layout(self, storage: KVStorage, num_heads: int, num_kv_heads: int,
                       capacity: int) -> StaticCascadeLayout | None:
        """The static tables' layout for batches of up to ``capacity`` sequences of this head
        layout; None when this backend never cascades over ``storage``."""
        ...

    def plan_cascade(self, plan: StepPlan, storage: KVStorage) -> CascadePlan | None:
        """The shared-prefix groups of the decode-only ``plan``; None when no cascade pays."""
        ...
