"""Decode through CUDA graphs: one graph per batch-size bucket, replayed with new metadata.

A decode step (every slice one sampled token, no drafts) runs the same kernels every time; only
the token ids, positions, slots, context lengths and page tables change. `DecodeGraphs` captures
the model's forward once per bucket (1, 2, 4, 8, 16, 24, ... up to the largest batch) over
static input buffers, and for each step copies the step's metadata into those buffers (one
pinned host staging area, two copies) and replays the smallest bucket that holds the batch.

Rows of a bucket beyond the batch repeat the batch's last sequence (same token, position, slot
and pages), so they write the very same key/value into the same slot and need no spare page;
their logits are dropped.

Backend tables: a backend whose graphed decode reads tables of its own (`base.GraphTablesBackend`:
the Triton backend's shared-prefix ("cascade") groups) gets a region of the same static buffer
for them (same copy). Every step asks the backend's `GraphTables` to stage the step; a step that
needs its tables writes them into the region and replays its bucket's second graph, whose batch
carries views of them. Those graphs are captured lazily, the first time a bucket sees such a
step, from that step's own staged inputs: the warm-up forwards then write exactly the keys and
values the step itself writes (its tokens, at its slots) and read only what it reads, so a
capture in the middle of a generation touches no other cache data.

The plain graphs are captured at construction, warming up on rows that write slot 0 of page 0:
build them before the cache holds data (the generator does it at construction).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from dyngen_core.engine.plan import StepPlan
from dyngen_core.kv.attention.base import (
    AttentionBackend,
    ForwardBatch,
    GraphTables,
    GraphTablesBackend,
)
from dyngen_core.kv.storage import KVStorage
from dyngen_core.model import Model
from dyngen_core.runtime.overlap import TokenFeed

if TYPE_CHECKING:
    from torch.cuda import _POOL_HANDLE

GRAPH_BACKENDS = ("triton", "flash")
StepFunction = Callable[[ForwardBatch], torch.Tensor]
TablesWriter = Callable[[np.ndarray], None]


def default_buckets(max_batch_size: int) -> list[int]:
    """1, 2, 4, 8, then every 8 up to 64, every 16 up to 128, every 32 beyond, and
    ``max_batch_size`` itself: above 32, padding fills less than a fifth of a bucket."""
    sizes = [1, 2, 4, 8]
    step_sizes = ((64, 8), (128, 16), (1 << 30, 32))
    size = 8
    for limit, step in step_sizes:
        while size + step <= min(limit, max_batch_size):
            size += step
            sizes.append(size)
    sizes = [s for s in sizes if s < max_batch_size]
    return [*sizes, max_batch_size]


@dataclass
class _StaticInputs:
    """The device buffers every graph reads, and their pinned host staging twins.

    longs [3, B]: input_ids, positions, slot_mapping rows. ints: B context lengths, B sequence
    slots, the backend's tables (``tables_size`` entries), then the page table [B, width],
    flat, so what a bucket reads is one contiguous prefix.
    """

    longs: torch.Tensor
    ints: torch.Tensor
    query_start: torch.Tensor  # [B + 1] = arange: one query token per sequence
    logits_indices: torch.Tensor  # [B] = arange
    host_longs: torch.Tensor
    host_ints: torch.Tensor
    copied: torch.cuda.Event
    capacity: int
    width: int
    tables_size: int

    def page_table(self, ints: torch.Tensor) -> torch.Tensor:
        return ints[2 * self.capacity + self.tables_size:].view(self.capacity, self.width)

    def tables_region(self, ints: torch.Tensor) -> torch.Tensor:
        return ints[2 * self.capacity:2 * self.capacity + self.tables_size]

    def seq_slots(self, ints: torch.Tensor) -> torch.Tensor:
        return ints[self.capacity:2 * self.capacity]

    def batch(self, size: int, page_size: int, tables: object | None = None) -> ForwardBatch:
        """The ForwardBatch of a bucket: views of the first ``size`` rows (and ``tables``,
        the backend's views of its region, for a graph that reads them)."""
        return ForwardBatch(
            input_ids=self.longs[0, :size], positions=self.longs[1, :size],
            slot_mapping=self.longs[2, :size], query_start=self.query_start[:size + 1],
            context_lens=self.ints[:size], page_table=self.page_table(self.ints)[:size],
            logits_indices=self.logits_indices[:size],
            query_lens_host=[1] * size, context_lens_host=[1] * size, page_size=page_size,
            seq_slots=self.seq_slots(self.ints)[:size],
            token_seq_slots=self.seq_slots(self.ints)[:size], graph_tables=tables,
        )


class DecodeGraphs:
    """CUDA graphs of the decode forward for one model, storage and attention backend.

    model: the Model (its ``forward(batch, storage, backend)`` is captured).
    storage: the cache's KVStorage.
    backend: an attention backend whose decode launch depends on the batch size alone
        ("triton", "flash"); the sdpa backend reads host-side lengths and cannot be captured.
        One that is also a `GraphTablesBackend` gets a second graph per bucket for the steps
        that read its tables.
    page_size: the cache's slots per page.
    max_context: the longest sequence (prompt + generated) a graphed decode may hold; it sets
        the width of the static page table.
    max_batch_size: the largest bucket.
    buckets: explicit bucket sizes (sorted, ascending); default `default_buckets`.
    compile_model: run the forward through ``torch.compile`` before capturing, which fuses the
        small element-wise kernels of norms, rotary and activations.
    """

    def __init__(self, model: Model, storage: KVStorage, backend: AttentionBackend,
                 *, page_size: int, max_context: int, max_batch_size: int = 256,
                 buckets: Sequence[int] | None = None, compile_model: bool = False) -> None:
        if backend.name not in GRAPH_BACKENDS:
            raise ValueError(f"CUDA graphs need a capturable attention backend "
                             f"({', '.join(GRAPH_BACKENDS)}); got {backend.name!r}")
        device = torch.device(model.device)
        if device.type != "cuda":
            raise ValueError(f"CUDA graphs need a model on CUDA; this one is on {device}")
        self.model, self.storage, self.backend = model, storage, backend
        self.page_size = page_size
        self.width = -(-max_context // page_size)
        self.buckets = sorted(buckets or default_buckets(max_batch_size))
        self.device = device
        self.compiled = compile_model
        self._step: StepFunction = self._make_step(compile_model)
        self._tables: GraphTables | None = None
        if isinstance(backend, GraphTablesBackend):
            config = model.config
            self._tables = backend.graph_tables(storage, config.num_heads, config.num_kv_heads,
                                                self.buckets[-1])
        self._inputs = self._allocate(self.buckets[-1])
        # Keyed by (bucket, reads the backend's tables); those graphs are captured on first use.
        self._graphs: dict[tuple[int, bool], torch.cuda.CUDAGraph] = {}
        self._outputs: dict[tuple[int, bool], torch.Tensor] = {}
        self._pool: _POOL_HANDLE | None = None
        with self._capture_mode():
            for size in reversed(self.buckets):  # largest first: smaller ones reuse its memory
                self._capture(size, with_tables=False)

    def can_run(self, plan: StepPlan) -> bool:
        """True for plans of decodes only (one token, sampled, no drafts) that fit a bucket."""
        slices = plan.slices
        if not slices or len(slices) > self.buckets[-1]:
            return False
        return all(len(s.token_ids) == 1 and s.sample and not s.draft_ids
                   and s.end_pos <= self.width * self.page_size for s in slices)

    def run(self, plan: StepPlan, seq_slots: Sequence[int] | None = None,
            feed: TokenFeed | None = None) -> torch.Tensor:
        """Replay the smallest bucket holding the plan; float32 logits [len(slices), vocab].
        ``seq_slots``: each slice's sequence slot (-1 or None: none). ``feed``: input tokens
        still on the device (an overlapped previous step's), written into the static inputs.

        The logits are a view of the graph's output buffer: read them before the next `run`.
        """
        size = len(plan.slices)
        bucket = next(b for b in self.buckets if b >= size)
        writer = self._tables.stage(plan) if self._tables is not None else None
        self._stage(plan, bucket, seq_slots, writer)
        if feed is not None:
            feed.apply(self._inputs.longs[0, :bucket], size)
        key = (bucket, writer is not None)
        if key not in self._graphs:
            with self._capture_mode():  # the static inputs hold this very step (module doc)
                self._capture(bucket, with_tables=True)
        self._graphs[key].replay()
        return self._outputs[key][:size]

    def _make_step(self, compile_model: bool) -> StepFunction:
        model, storage, backend = self.model, self.storage, self.backend
        if not compile_model:
            def step(batch: ForwardBatch) -> torch.Tensor:
                return model(batch, storage, backend)

            return step
        # torch.compile fails on regions that enter inference_mode (pytorch#169477), so the
        # compiled step calls the model's own methods undecorated, under no_grad; attention
        # stays eager (a graph break per layer costs nothing once captured in a CUDA graph).
        hidden_fn = _undecorated(type(model).forward_hidden)
        logits_fn = _undecorated(type(model).compute_logits)
        eager_attention = _EagerAttention(backend)

        def compiled_step(batch: ForwardBatch) -> torch.Tensor:
            hidden = hidden_fn(model, batch, storage, eager_attention)
            return logits_fn(model, hidden.index_select(0, batch.logits_indices))

        # Dynamic shapes: one compile serves every bucket (the batch size is symbolic).
        return torch.compile(compiled_step, dynamic=True)

    def _allocate(self, size: int) -> _StaticInputs:
        device = self.device
        host_longs = torch.zeros(3, size, dtype=torch.int64).pin_memory()
        tables_size = self._tables.size if self._tables is not None else 0
        host_ints = torch.zeros(size * (2 + self.width) + tables_size,
                                dtype=torch.int32).pin_memory()
        host_ints[:size] = 1  # every warm-up row sees one slot: slot 0 of page 0
        host_ints[size:2 * size] = -1  # and keeps no per-sequence state
        inputs = _StaticInputs(
            longs=host_longs.to(device), ints=host_ints.to(device),
            query_start=torch.arange(size + 1, dtype=torch.int32, device=device),
            logits_indices=torch.arange(size, dtype=torch.int64, device=device),
            host_longs=host_longs, host_ints=host_ints, copied=torch.cuda.Event(),
            capacity=size, width=self.width, tables_size=tables_size,
        )
        inputs.copied.record()
        return inputs

    def _capture_mode(self) -> ExitStack:
        """What capture runs under: inference mode, or for the compiled step no_grad (compile
        fails on inference-mode regions, pytorch#169477) with room for its recompiles."""
        stack = ExitStack()
        if not self.compiled:
            stack.enter_context(torch.inference_mode())
            return stack
        # Each layer recompiles its attention block (its layer index is a static int to dynamo);
        # under the default limit of 8 recompiles, layers past the 8th would stay eager.
        from torch._dynamo import config as dynamo_config

        limit = max(64, 2 * len(self.model.layers))
        stack.enter_context(torch.inference_mode(False))  # a lazy capture runs inside one
        stack.enter_context(torch.no_grad())
        stack.enter_context(dynamo_config.patch(recompile_limit=limit))
        return stack

    def _capture(self, size: int, *, with_tables: bool) -> None:
        """Warm up and capture the graph of bucket ``size`` over the static inputs as they are
        (plain, or reading the backend's tables in their region)."""
        inputs = self._inputs
        tables = None
        if with_tables:
            assert self._tables is not None
            tables = self._tables.views(inputs.tables_region(inputs.ints), size)
        batch = inputs.batch(size, self.page_size, tables)
        for _ in range(3):
            self._step(batch)
        torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        # thread_local: a lazy capture must not fail on another thread's unrelated CUDA call.
        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            self._outputs[(size, with_tables)] = self._step(batch)
        self._pool = graph.pool()
        self._graphs[(size, with_tables)] = graph
        torch.cuda.synchronize(self.device)

    def _stage(self, plan: StepPlan, bucket: int, seq_slots: Sequence[int] | None,
               writer: TablesWriter | None) -> None:
        """Fill the pinned staging buffers (the backend's tables through ``writer``) and copy
        them into the static device inputs."""
        inputs = self._inputs
        inputs.copied.synchronize()  # the previous step's copy has read the staging buffers
        longs = inputs.host_longs.numpy()
        ints = inputs.host_ints.numpy()
        tables = inputs.page_table(inputs.host_ints).numpy()
        slots = inputs.seq_slots(inputs.host_ints).numpy()
        size = len(plan.slices)
        slots[:size] = -1 if seq_slots is None else seq_slots
        page_size = self.page_size
        for row, piece in enumerate(plan.slices):
            pos = piece.start_pos
            pages_used = pos // page_size + 1
            longs[0, row] = piece.token_ids[0]
            longs[1, row] = pos
            longs[2, row] = piece.page_table[pos // page_size] * page_size + pos % page_size
            ints[row] = pos + 1
            tables[row, :pages_used] = piece.page_table[:pages_used]
        if bucket > size:
            longs[:, size:bucket] = longs[:, size - 1:size]
            ints[size:bucket] = ints[size - 1]
            slots[size:bucket] = slots[size - 1]
            tables[size:bucket] = tables[size - 1]
        if writer is not None:
            writer(inputs.tables_region(inputs.host_ints).numpy())
        used = 2 * inputs.capacity + inputs.tables_size + bucket * inputs.width
        inputs.longs.copy_(inputs.host_longs, non_blocking=True)
        inputs.ints[:used].copy_(inputs.host_ints[:used], non_blocking=True)
        inputs.copied.record()


class _EagerAttention:
    """Forwards to an attention backend outside torch.compile (its kernels run as they are)."""

    def __init__(self, inner: AttentionBackend) -> None:
        self.inner = inner
        self.name = inner.name

    @torch.compiler.disable
    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               storage: KVStorage, batch: ForwardBatch, scale: float) -> torch.Tensor:
        return self.inner.attend(layer, q, k, v, storage, batch, scale)


def _undecorated(function: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """The function under a decorator that kept ``__wrapped__`` (torch.inference_mode does)."""
    return getattr(function, "__wrapped__", function)


def decode_graphs_for(model: Model, storage: KVStorage, backend: AttentionBackend,
                      *, page_size: int, max_context: int, max_batch_size: int,
                      compile_model: bool = False) -> DecodeGraphs | None:
    """`DecodeGraphs` when the model is on CUDA and the backend can be captured, else None.

    Arguments as in `DecodeGraphs`.
    """
    if model.device.type != "cuda" or backend.name not in GRAPH_BACKENDS:
        return None
    return DecodeGraphs(model, storage, backend, page_size=page_size, max_context=max_context,
                        max_batch_size=max_batch_size, compile_model=compile_model)


__all__ = ["DecodeGraphs", "decode_graphs_for", "default_buckets"]
