"""CUDA graphs of the fused draw: the top-k and `fused.compact_draw_kernel` replayed as
one graph launch (`DrawGraphs`).

Why: each torch or Triton launch costs host time in Python and the driver, and the fused draw
of a step launches the top-k, an output allocation and the Triton kernel (whose launcher binds
a dozen arguments in Python) every step. A replay is one launch; the RNG keys still cross in
one copy, into the graph's static input (figures: BENCHMARKS.md, "5. Host overhead").

What a graph holds: for one logits buffer (``x``'s storage, offset, strides and dtype), a row
bucket, a candidate bound and a top-k (`fused.TOPK_CHOICES`), that top-k of the bucket's rows
of that buffer and the kernel over them, writing tokens into a static output. Its inputs are
static tensors: the RNG keys (copied in every call) and the rows' columns (temperature, top_k,
top_p: copied when the sampler's rows change, `fused.fused_columns`). Rows past the call's
count are padding: computed from whatever the buffer and the static inputs hold there, and
dropped. Buckets are multiples of
`ROW_BUCKET` rows, capped at the rows the buffer's storage holds, so a batch that loses or gains
a job keeps its graph.

Keyed by address: the decode graphs return logits as views of their static outputs, so one
address serves every step of a bucket. Another tensor at an address a graph knows, with the
same layout, is read correctly (a replay reads whatever that memory holds then); the bucket is
recomputed from the storage's size every call, so a graph never reads past the tensor's
storage. At most `MAX_GRAPHS` are kept (least recently used dropped).

The output is a view of the graph's static buffer: valid until the next draw through the same
graph (the sampler's callers copy or consume the tokens before they sample again).
"""

from __future__ import annotations

import warnings
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch

from dyngen_core.sampling.fused import (
    DEFAULT_TOPK,
    NO_TOP_P,
    FusedColumns,
    TopkChoice,
    fused_columns,
    launch_fused_draw,
)
from dyngen_core.sampling.rows import RowList
from dyngen_core.sampling.upload import Staging

ROW_BUCKET = 32
MAX_GRAPHS = 16

# (storage address, offset, strides, width, dtype, bucket, bound) of the logits a graph
# reads, and its top-k
GraphKey = tuple[int, int, tuple[int, ...], int, torch.dtype, int, int, str]


@dataclass
class _DrawGraph:
    """One captured draw and its static tensors (``keys`` [bucket, 2], ``columns`` [bucket]
    each, ``out`` [bucket]); ``loaded``: the columns object last copied in."""

    graph: torch.cuda.CUDAGraph
    keys: torch.Tensor
    columns: FusedColumns
    out: torch.Tensor
    loaded: FusedColumns | None = None


class DrawGraphs:
    """Captured fused draws on one CUDA device (module docstring). ``max_graphs``: how many
    are kept at once. ``failure``: why a capture failed (graphs are then no longer used)."""

    def __init__(self, device: torch.device, max_graphs: int = MAX_GRAPHS) -> None:
        if device.type != "cuda":
            raise ValueError(f"draw graphs need a CUDA device, not {device}")
        self.device = device
        self.max_graphs = max_graphs
        self._graphs: OrderedDict[GraphKey, _DrawGraph] = OrderedDict()
        self._pool: Any = None  # a graph memory pool handle
        self.failure: str | None = None

    def draw(self, x: torch.Tensor, rows: RowList, staging: Staging, bound: int,
             topk: TopkChoice = DEFAULT_TOPK) -> torch.Tensor | None:
        """`fused.draw_fused` of ``x`` [rows, vocab] by replaying its graph (captured on the
        first call for this buffer, bucket, bound and ``topk``): int64 [rows], a view of the
        graph's output (valid until the graph's next replay). None, with nothing launched,
        once a capture has failed (``failure`` says why; the caller draws eagerly from then
        on)."""
        if self.failure is not None:
            return None
        count = x.shape[0]
        bucket = _bucket(x)
        key: GraphKey = (x.untyped_storage().data_ptr(), int(x.storage_offset()),
                         tuple(x.stride()), x.shape[1], x.dtype, bucket, bound, topk)
        entry = self._graphs.get(key)
        if entry is None:
            try:
                entry = self._capture(_rows_view(x, bucket), bound, topk)
            except RuntimeError as exc:  # a torch build whose top-k cannot be captured
                self.failure = f"capturing the fused draw failed: {exc}"
                warnings.warn(f"{self.failure}; drawing without CUDA graphs", RuntimeWarning,
                              stacklevel=2)
                return None
            self._graphs[key] = entry
            while len(self._graphs) > self.max_graphs:
                self._graphs.popitem(last=False)
        else:
            self._graphs.move_to_end(key)
        columns = fused_columns(rows, staging, bound)
        if entry.loaded is not columns:
            for static, fresh in zip(entry.columns, columns, strict=True):
                static[:count].copy_(fresh)
            entry.loaded = columns
        staging.send_ints_into(rows.keys(), entry.keys[:count])
        entry.graph.replay()
        return entry.out[:count]

    def __len__(self) -> int:
        return len(self._graphs)

    def _capture(self, x: torch.Tensor, bound: int, topk: TopkChoice) -> _DrawGraph:
        rows, device = x.shape[0], x.device
        keys = torch.zeros(rows, 2, dtype=torch.int64, device=device)
        columns = FusedColumns(torch.ones(rows, dtype=torch.float32, device=device),
                               torch.ones(rows, dtype=torch.int64, device=device),
                               torch.full((rows,), NO_TOP_P, dtype=torch.float32,
                                          device=device))
        out = torch.empty(rows, dtype=torch.int64, device=device)
        # Warm up on a side stream (compiles the kernel, sizes the top-k's workspace), as
        # torch's capture recipe asks.
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            launch_fused_draw(x, keys, columns, bound, out, topk=topk)
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            launch_fused_draw(x, keys, columns, bound, out, topk=topk)
        if self._pool is None:
            self._pool = graph.pool()  # later graphs share its memory: never run concurrently
        return _DrawGraph(graph, keys, columns, out)


def _bucket(x: torch.Tensor) -> int:
    """The rows a graph for ``x`` reads: its row count rounded up to `ROW_BUCKET`, at most
    the rows its storage holds from its offset."""
    count = x.shape[0]
    held = _rows_held(x)
    return min(max(held, count), -(-count // ROW_BUCKET) * ROW_BUCKET)


def _rows_held(x: torch.Tensor) -> int:
    """How many rows of ``x``'s layout fit in its storage from its offset."""
    elements = x.untyped_storage().nbytes() // x.element_size()
    room = elements - x.storage_offset() - (x.shape[1] - 1) * x.stride(1)
    return max(0, (room - 1) // x.stride(0) + 1) if x.stride(0) > 0 else x.shape[0]


def _rows_view(x: torch.Tensor, rows: int) -> torch.Tensor:
    """``x`` with ``rows`` rows of the same layout over the same storage."""
    return x.as_strided((rows, x.shape[1]), x.stride(), x.storage_offset())


def graphable(x: torch.Tensor) -> bool:
    """Whether `DrawGraphs` takes ``x``: 2-D on CUDA, rows apart by a positive stride, and
    not being captured into another graph already."""
    return (x.is_cuda and x.ndim == 2 and x.shape[0] > 0 and x.stride(0) > 0
            and not torch.cuda.is_current_stream_capturing())
