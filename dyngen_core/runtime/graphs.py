"""Decode and verify steps through CUDA graphs, replayed with new metadata.

A decode step (every slice one sampled token) runs the same kernels every time; only the token
ids, positions, slots, context lengths and page tables change. `StepGraphs` captures the model's
forward once per batch-size bucket (1, 2, 4, 8, 16, 24, ... up to the largest batch) over
static input buffers, and for each step copies the step's metadata into those buffers (one
pinned host staging area, two copies) and replays the smallest bucket that holds the batch.
Rows of a bucket beyond the batch repeat the batch's last sequence (same token, position, slot
and pages), so they write the very same key/value into the same slot and need no spare page;
their logits are dropped.

A verify step (speculative decoding: each slice its sampled token plus up to k drafts, slices
without drafts among them) replays a graph of its bucket and query length ``q`` (one plus the
step's longest draft), captured the first time they are seen: room for ``q`` tokens per row.
The step's tokens are packed as an eager forward packs them, with their true per-row lengths
(``query_start``); rows of the bucket beyond the batch hold no token and no key (context 0),
and the tokens beyond the step's are padding at slot -1, which the storage writes skip
(`KVStorage.write`), in no sequence, so no attention reads or writes them; their logits are
dropped. The attention backend shapes its launches for ``q`` tokens per row and bounds each
row by its true length on the device. Verify graphs need a backend whose launches read every
length on the device (the "triton" backend) and a storage without per-sequence state, and
cover steps of at most `MAX_VERIFY_TOKENS` padded tokens: past that the forward is dominated
by its matrix products and replaying saves little.

Backend tables: a backend whose graphed decode reads tables of its own (`base.GraphTablesBackend`:
the Triton backend's shared-prefix ("cascade") groups) gets a region of the same static buffer
for them (same copy). Every decode step asks the backend's `GraphTables` to stage the step; a
step that needs its tables writes them into the region and replays its bucket's second graph,
whose batch carries views of them. Those graphs are captured lazily, like the verify graphs,
the first time a bucket sees such a step, from that step's own staged inputs: the warm-up
forwards then write exactly the keys and values the step itself writes (its tokens, at its
slots) and read only what it reads, so a capture in the middle of a generation touches no
other cache data. Each graph keeps the batch it was captured from, and with it the device
tables the backend derived from it (`ForwardBatch.memo`).

The plain decode graphs are captured at construction, warming up on rows that write slot 0 of
page 0: build them before the cache holds data (the generator does it at construction).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from itertools import chain
from typing import TYPE_CHECKING

import numpy as np
import torch

from dyngen_core.engine.plan import SequenceSlice, StepPlan
from dyngen_core.kv.attention.base import (
    AttentionBackend,
    ForwardBatch,
    GraphTables,
    GraphTablesBackend,
)
from dyngen_core.kv.storage import KVStorage
from dyngen_core.model import Model
from dyngen_core.ops.graph_capture import capture
from dyngen_core.runtime.overlap import TokenFeed

if TYPE_CHECKING:
    from torch.cuda import _POOL_HANDLE

GRAPH_BACKENDS = ("triton", "flash")
# The backends whose launches for short queries read every length on the device (verify graphs).
VERIFY_BACKENDS = ("triton",)
# The most tokens (bucket x query length) a graphed verify step runs, padding included.
MAX_VERIFY_TOKENS = 512
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

    longs [3, tokens]: input_ids, positions, slot_mapping rows. ints: ``rows`` context lengths,
    ``rows`` sequence slots, ``rows + 1`` query starts, the backend's tables (``tables_size``
    entries), then the page table [rows, width], flat, so what a bucket reads is one contiguous
    prefix.
    """

    longs: torch.Tensor
    ints: torch.Tensor
    logits_indices: torch.Tensor  # [tokens] = arange: every token's logits
    host_longs: torch.Tensor
    host_ints: torch.Tensor
    copied: torch.cuda.Event
    rows: int
    tokens: int
    width: int
    tables_size: int

    def seq_slots(self, ints: torch.Tensor) -> torch.Tensor:
        return ints[self.rows:2 * self.rows]

    def query_start(self, ints: torch.Tensor) -> torch.Tensor:
        return ints[2 * self.rows:3 * self.rows + 1]

    def tables_region(self, ints: torch.Tensor) -> torch.Tensor:
        start = 3 * self.rows + 1
        return ints[start:start + self.tables_size]

    def page_table(self, ints: torch.Tensor) -> torch.Tensor:
        return ints[3 * self.rows + 1 + self.tables_size:].view(self.rows, self.width)

    def host_views(self) -> DecodeViews:
        """Numpy views of the pinned staging buffers that a decode step writes."""
        ints = self.host_ints
        return DecodeViews(longs=self.host_longs.numpy(), context=ints[:self.rows].numpy(),
                           slots=self.seq_slots(ints).numpy(),
                           query_start=self.query_start(ints).numpy(),
                           tables=self.page_table(ints).numpy())

    def used(self, rows: int) -> int:
        """The prefix of ``ints`` a bucket of ``rows`` reads."""
        return 3 * self.rows + 1 + self.tables_size + rows * self.width

    def batch(self, rows: int, query_len: int, page_size: int,
              tables: object | None = None) -> ForwardBatch:
        """The ForwardBatch of a graph over ``rows`` sequences of up to ``query_len`` tokens
        each (views of the buffers' leading rows and ``rows * query_len`` tokens), carrying
        ``tables`` (the backend's views of its region) for a graph that reads them."""
        tokens = rows * query_len
        seq_slots = self.seq_slots(self.ints)[:rows] if query_len == 1 else None
        return ForwardBatch(
            input_ids=self.longs[0, :tokens], positions=self.longs[1, :tokens],
            slot_mapping=self.longs[2, :tokens],
            query_start=self.query_start(self.ints)[:rows + 1],
            context_lens=self.ints[:rows], page_table=self.page_table(self.ints)[:rows],
            logits_indices=self.logits_indices[:tokens],
            query_lens_host=[query_len] * rows, context_lens_host=[1] * rows,
            page_size=page_size, seq_slots=seq_slots, token_seq_slots=seq_slots,
            graph_tables=tables,
        )


@dataclass
class DecodeViews:
    """The host arrays a decode step is staged in: ``longs`` [3, tokens] (input ids,
    positions, slots of the cache), ``context`` [rows] (context lengths), ``slots`` [rows]
    (sequence slots), ``query_start`` [rows + 1] and ``tables`` [rows, width] (page tables)."""

    longs: np.ndarray
    context: np.ndarray
    slots: np.ndarray
    query_start: np.ndarray
    tables: np.ndarray

    @classmethod
    def zeros(cls, rows: int, width: int, tokens: int) -> DecodeViews:
        """Zeroed arrays for ``rows`` sequences of up to ``width`` pages and ``tokens`` token
        columns, apart from any staging buffer (what `StepGraphs` stages into are views of its
        pinned buffers, `_StaticInputs.host_views`)."""
        return cls(longs=np.zeros((3, tokens), dtype=np.int64),
                   context=np.zeros(rows, dtype=np.int32), slots=np.zeros(rows, dtype=np.int32),
                   query_start=np.zeros(rows + 1, dtype=np.int32),
                   tables=np.zeros((rows, width), dtype=np.int32))


class DecodeStaging:
    """Writes decode and verify steps into `DecodeViews`, a column at a time.

    A row's page table is written only when its slice brings another list than the one the row
    holds, or needs more of its pages: a job's decode slices share one list while its table
    does not change, and a planned list is never changed in place (`SequenceSlice`), so the
    row already holds those pages. Only this object writes the tables.

    views: the arrays to write.
    page_size: slots per page.
    """

    def __init__(self, views: DecodeViews, page_size: int) -> None:
        self.views = views
        self.page_size = page_size
        rows = views.tables.shape[0]
        self._row_index = np.arange(rows)
        self._one_token_starts = np.arange(rows + 1, dtype=views.query_start.dtype)
        # Per row: the list it holds (kept alive, so identity is meaningful) and how many of
        # its pages were written.
        self._lists: list[list[int] | None] = [None] * rows
        self._pages = [0] * rows

    def stage(self, slices: Sequence[SequenceSlice], bucket: int,
              seq_slots: Sequence[int] | None) -> None:
        """Write a decode step (each slice one token, none past the tables' width) for a graph
        of ``bucket`` rows; rows past the slices repeat the last one. ``seq_slots``: each
        slice's sequence slot (None: -1, no per-sequence state)."""
        views, page_size = self.views, self.page_size
        size = len(slices)
        positions = np.array([s.start_pos for s in slices], dtype=np.int64)
        pages = positions // page_size
        self._write_tables(slices, (pages + 1).tolist())
        longs, tables = views.longs, views.tables
        longs[0, :size] = [s.token_ids[0] for s in slices]
        longs[1, :size] = positions
        slot_pages = tables[self._row_index[:size], pages].astype(np.int64)
        longs[2, :size] = slot_pages * page_size + positions % page_size
        views.context[:size] = positions + 1
        views.slots[:size] = -1 if seq_slots is None else seq_slots
        views.query_start[:bucket + 1] = self._one_token_starts[:bucket + 1]
        if bucket > size:
            longs[:, size:bucket] = longs[:, size - 1:size]
            views.context[size:bucket] = views.context[size - 1]
            views.slots[size:bucket] = views.slots[size - 1]
            tables[size:bucket] = tables[size - 1]
            self._lists[size:bucket] = [None] * (bucket - size)

    def stage_verify(self, slices: Sequence[SequenceSlice], bucket: int, query_len: int) -> int:
        """Write a verify step (each slice one token and its drafts, `decode_query_len`) for a
        graph of ``bucket`` rows of ``query_len`` tokens, packed: the slices' tokens back to
        back with their true lengths (``query_start``); rows past the slices hold no token and
        no key (context 0), and tokens past the step's are padding at slot -1. Returns the
        step's token count."""
        views, page_size = self.views, self.page_size
        size = len(slices)
        lengths = np.array([1 + len(s.draft_ids) for s in slices], dtype=np.int64)
        firsts = np.array([s.start_pos for s in slices], dtype=np.int64)
        ends = firsts + lengths
        self._write_tables(slices, (-(-ends // page_size)).tolist())
        bounds = np.cumsum(lengths)
        total = int(bounds[-1])
        rows = np.repeat(self._row_index[:size], lengths)
        positions = np.repeat(firsts - (bounds - lengths), lengths) + np.arange(total)
        longs = views.longs
        longs[0, :total] = list(chain.from_iterable(s.token_ids + s.draft_ids for s in slices))
        longs[1, :total] = positions
        slot_pages = views.tables[rows, positions // page_size].astype(np.int64)
        longs[2, :total] = slot_pages * page_size + positions % page_size
        views.context[:size] = ends
        views.context[size:bucket] = 0
        views.query_start[0] = 0
        views.query_start[1:size + 1] = bounds
        views.query_start[size + 1:bucket + 1] = total
        longs[:2, total:bucket * query_len] = 0
        longs[2, total:bucket * query_len] = -1  # padding tokens: not stored
        return total

    def _write_tables(self, slices: Sequence[SequenceSlice], used: list[int]) -> None:
        lists, pages, tables = self._lists, self._pages, self.views.tables
        for row, (piece, count) in enumerate(zip(slices, used, strict=True)):
            table = piece.page_table
            if lists[row] is not table or pages[row] < count:
                tables[row, :count] = table[:count]
                lists[row] = table
                pages[row] = count


@dataclass
class _Graph:
    """One captured graph, its output (logits of every token) and the batch it replays."""

    graph: torch.cuda.CUDAGraph
    logits: torch.Tensor
    batch: ForwardBatch


class StepGraphs:
    """CUDA graphs of the decode and verify forwards for one model, storage and backend.

    model: the Model (its ``forward(batch, storage, backend)`` is captured).
    storage: the cache's KVStorage.
    backend: an attention backend whose decode launch depends on the batch size alone
        ("triton", "flash"); the sdpa backend reads host-side lengths and cannot be captured.
        One that is also a `GraphTablesBackend` gets a second graph per bucket for the decode
        steps that read its tables.
    page_size: the cache's slots per page.
    max_context: the longest sequence (prompt + generated) a graphed step may hold; it sets
        the width of the static page table.
    max_batch_size: the largest bucket.
    buckets: explicit bucket sizes (sorted, ascending); default `default_buckets`.
    compile_model: run the forward through ``torch.compile`` before capturing, which fuses the
        small element-wise kernels of norms, rotary and activations.
    verify_steps: also replay verify steps (module docstring): needs the "triton" backend and a
        storage that keeps no per-sequence state (False is taken for any other backend).
    """

    def __init__(self, model: Model, storage: KVStorage, backend: AttentionBackend,
                 *, page_size: int, max_context: int, max_batch_size: int = 256,
                 buckets: Sequence[int] | None = None, compile_model: bool = False,
                 verify_steps: bool = True) -> None:
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
        self.verify_steps = verify_steps and backend.name in VERIFY_BACKENDS
        self._step: StepFunction = self._make_step(compile_model)
        self._tables: GraphTables | None = None
        if isinstance(backend, GraphTablesBackend):
            config = model.local_config  # this rank's heads under tensor parallelism
            self._tables = backend.graph_tables(storage, config.num_heads, config.num_kv_heads,
                                                self.buckets[-1])
        self._inputs = self._allocate(self.buckets[-1])
        self._staging = DecodeStaging(self._inputs.host_views(), page_size)
        # The last plan `can_run` accepted and its query length (`run` reads it back).
        self._query_lens: tuple[StepPlan | None, int] = (None, 1)
        # Keyed by (bucket, query length, reads the backend's tables); all but the plain
        # decode graphs are captured on first use.
        self._graphs: dict[tuple[int, int, bool], _Graph] = {}
        self._pool: _POOL_HANDLE | None = None
        # Graphs captured so far: a step that captured one took a one-time cost, not its own.
        self.captures = 0
        with self._capture_mode():
            for size in reversed(self.buckets):  # largest first: smaller ones reuse its memory
                self._capture(size, 1, with_tables=False)

    def can_run(self, plan: StepPlan) -> bool:
        """True for plans of decodes (one sampled token per slice) that fit a bucket, and,
        with ``verify_steps``, of decodes with drafts within `MAX_VERIFY_TOKENS`."""
        slices = plan.slices
        if not slices or len(slices) > self.buckets[-1]:
            return False
        query_len = decode_query_len(slices, self.width * self.page_size)
        if query_len is None:
            return False
        self._query_lens = (plan, query_len)
        return query_len == 1 or (self.verify_steps
                                  and self._bucket(len(slices)) * query_len <= MAX_VERIFY_TOKENS)

    def run(self, plan: StepPlan, seq_slots: Sequence[int] | None = None,
            feed: TokenFeed | None = None) -> torch.Tensor:
        """Replay the graph of the smallest bucket holding the plan (`can_run` must hold);
        float32 logits [tokens, vocab], the plan's sample rows in slice order. ``seq_slots``:
        each slice's sequence slot (-1 or None: none; a verify step takes none). ``feed``:
        input tokens still on the device (an overlapped previous step's), written into the
        static inputs.

        The logits are a view of the graph's output buffer: read them before the next `run`.
        """
        size = len(plan.slices)
        bucket = self._bucket(size)
        known, query_len = self._query_lens
        self._query_lens = (None, 1)
        if known is not plan:  # `can_run` was asked of another plan, or not at all
            checked = decode_query_len(plan.slices, self.width * self.page_size)
            if checked is None:
                raise ValueError("StepGraphs.run takes decode and verify steps only (see "
                                 "can_run)")
            query_len = checked
        if query_len == 1:
            writer = self._tables.stage(plan) if self._tables is not None else None
            self._stage_decode(plan, bucket, seq_slots, writer)
            tokens = size
        else:
            if seq_slots is not None and any(slot >= 0 for slot in seq_slots):
                raise ValueError("a graphed verify step keeps no per-sequence state; build the "
                                 "graphs with verify_steps=False for this storage")
            writer = None
            tokens = self._stage_verify(plan, bucket, query_len)
        if feed is not None:
            feed.apply(self._inputs.longs[0, :bucket * query_len], tokens)
        key = (bucket, query_len, writer is not None)
        if key not in self._graphs:
            with self._capture_mode():  # the static inputs hold this very step (module doc)
                self._capture(bucket, query_len, with_tables=writer is not None)
        graph = self._graphs[key]
        graph.graph.replay()
        return graph.logits[:tokens]

    def _bucket(self, size: int) -> int:
        return next(b for b in self.buckets if b >= size)

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

    def _allocate(self, rows: int) -> _StaticInputs:
        device = self.device
        tokens = max(rows, MAX_VERIFY_TOKENS) if self.verify_steps else rows
        host_longs = torch.zeros(3, tokens, dtype=torch.int64).pin_memory()
        tables_size = self._tables.size if self._tables is not None else 0
        host_ints = torch.zeros(rows * (3 + self.width) + 1 + tables_size,
                                dtype=torch.int32).pin_memory()
        host_ints[:rows] = 1  # every warm-up row sees one slot: slot 0 of page 0
        host_ints[rows:2 * rows] = -1  # and keeps no per-sequence state
        host_ints[2 * rows:3 * rows + 1] = torch.arange(rows + 1, dtype=torch.int32)
        inputs = _StaticInputs(
            longs=host_longs.to(device), ints=host_ints.to(device),
            logits_indices=torch.arange(tokens, dtype=torch.int64, device=device),
            host_longs=host_longs, host_ints=host_ints, copied=torch.cuda.Event(),
            rows=rows, tokens=tokens, width=self.width, tables_size=tables_size,
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

    def _capture(self, size: int, query_len: int, *, with_tables: bool) -> None:
        """Warm up and capture the graph of bucket ``size`` and ``query_len`` tokens per row
        over the static inputs as they are (plain, or reading the backend's tables in their
        region)."""
        inputs = self._inputs
        tables = None
        if with_tables:
            assert self._tables is not None
            tables = self._tables.views(inputs.tables_region(inputs.ints), size)
        batch = inputs.batch(size, query_len, self.page_size, tables)
        for _ in range(3):  # the warm-ups also leave the backend's tables in batch.memo
            self._step(batch)
        torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        with capture(graph, self._pool):
            logits = self._step(batch)
        self._pool = graph.pool()
        self._graphs[(size, query_len, with_tables)] = _Graph(graph, logits, batch)
        self.captures += 1
        torch.cuda.synchronize(self.device)

    def _stage_decode(self, plan: StepPlan, bucket: int, seq_slots: Sequence[int] | None,
                      writer: TablesWriter | None) -> None:
        """Fill the pinned staging buffers with a decode step (the backend's tables through
        ``writer``) and copy them into the static device inputs."""
        inputs = self._inputs
        inputs.copied.synchronize()  # the previous step's copy has read the staging buffers
        self._staging.stage(plan.slices, bucket, seq_slots)
        if writer is not None:
            writer(inputs.tables_region(inputs.host_ints).numpy())
        self._copy(bucket)

    def _stage_verify(self, plan: StepPlan, bucket: int, query_len: int) -> int:
        """Fill the staging buffers with a verify step, packed (module docstring), and copy
        them into the static device inputs; returns the step's token count."""
        self._inputs.copied.synchronize()
        tokens = self._staging.stage_verify(plan.slices, bucket, query_len)
        self._copy(bucket)
        return tokens

    def _copy(self, bucket: int) -> None:
        inputs = self._inputs
        used = inputs.used(bucket)
        inputs.longs.copy_(inputs.host_longs, non_blocking=True)
        inputs.ints[:used].copy_(inputs.host_ints[:used], non_blocking=True)
        inputs.copied.record()


def decode_query_len(slices: Sequence[SequenceSlice], max_context: int) -> int | None:
    """One plus the longest draft of ``slices`` when each is a sampled decode of one token
    (drafts allowed) ending within ``max_context`` positions; else None (one pass, as lean as
    it can be: it runs every step over every job)."""
    last_position = max_context - 1
    longest = 0
    for s in slices:
        drafts = len(s.draft_ids)
        if len(s.token_ids) != 1 or not s.sample or s.start_pos + drafts > last_position:
            return None
        if drafts > longest:
            longest = drafts
    return 1 + longest


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


def step_graphs_for(model: Model, storage: KVStorage, backend: AttentionBackend,
                    *, page_size: int, max_context: int, max_batch_size: int,
                    compile_model: bool = False, verify_steps: bool = True) -> StepGraphs | None:
    """`StepGraphs` when the model is on CUDA and the backend can be captured, else None.

    Arguments as in `StepGraphs`.
    """
    if model.device.type != "cuda" or backend.name not in GRAPH_BACKENDS:
        return None
    return StepGraphs(model, storage, backend, page_size=page_size, max_context=max_context,
                      max_batch_size=max_batch_size, compile_model=compile_model,
                      verify_steps=verify_steps)


__all__ = ["MAX_VERIFY_TOKENS", "DecodeStaging", "DecodeViews", "StepGraphs", "decode_query_len",
           "default_buckets", "step_graphs_for"]
