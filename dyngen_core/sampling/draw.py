"""The final draw and what crosses back to the host: the draw over whole rows (`choose`), the
compact draw over each row's top candidates (`draw_compact`), the fused draw replayed from CUDA
graphs (`DrawGraphs`), and the one transfer of the chosen tokens (`fetch_choices`,
`fetch_compact`; `fetch_top_k` for top tokens).

Greedy rows take the argmax of their edited logits. Other rows take
``argmax(logit + gumbel(seed, counter, token))`` (`dyngen_core.sampling.rng`) over their
candidates: the noise of a token does not depend on which other tokens are looked at, so the
draw may be restricted to a superset of the surviving tokens (the top-k when every row has a
top_k; on the CPU, where a host sync is free, the largest number of surviving tokens).

Where the logits are drawn from in place, the fused draw (`fused`) replays from a CUDA graph:
one launch instead of the top-k's, the output's and the kernel's (BENCHMARKS.md, "5. Host
overhead"); `DrawGraphs` says what a graph holds and how long its output stays valid.
"""

from __future__ import annotations

import warnings
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np
import torch

from dyngen_core.engine.record import SampleRequest
from dyngen_core.ops.graph_capture import capture
from dyngen_core.sampling import shaping as filters
from dyngen_core.sampling.fused import (
    DEFAULT_TOPK,
    NO_TOP_P,
    FusedColumns,
    TopkChoice,
    carry_host_columns,
    fused_columns,
    launch_fused_draw,
)
from dyngen_core.sampling.rng import perturb
from dyngen_core.sampling.rows import RowList, on_rows, positions_of, rows_using, without
from dyngen_core.sampling.shaping import (
    COLUMN_STAGES,
    TemperatureRows,
    column_values,
    shape_tail,
    temperature_rows,
    temperature_stage,
)
from dyngen_core.sampling.upload import Staging

if TYPE_CHECKING:
    from dyngen_core.sampling.sampler import VocabTables

# A draw graph's rows: a multiple of this (`DrawGraphs`).
ROW_BUCKET = 32
# Draw graphs kept at once (least recently used dropped).
MAX_GRAPHS = 16


def _rows_of(x: torch.Tensor, rows: Sequence[int]) -> tuple[torch.Tensor | None, torch.Tensor]:
    if len(rows) == x.shape[0]:
        return None, x
    index = torch.tensor(list(rows), dtype=torch.int64, device=x.device)
    return index, x.index_select(0, index)


def _candidates(sub: torch.Tensor, bound: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits, token ids) of a superset of every row's surviving tokens."""
    width = sub.shape[1]
    if sub.device.type == "cpu" and bound == width:
        bound = max(int(torch.isfinite(sub).sum(-1).max()), 1)
    if bound < width // 2:
        return torch.topk(sub, bound, dim=-1)
    return sub, torch.arange(width, device=sub.device).expand_as(sub)


def choose(
    x: torch.Tensor,
    sampled_rows: Sequence[int],
    keys: torch.Tensor | None,
    candidate_bound: int,
) -> torch.Tensor:
    """Chosen token per row, int64 ``[rows]`` on the device.

    sampled_rows: the non-greedy rows, ascending; every other row takes its argmax.
    keys: int64 ``[len(sampled_rows), 2]`` on the device, those rows' `row_key` words (None
        when no row is sampled).
    candidate_bound: most candidates any non-greedy row can have (the width when unknown).
    """
    if not sampled_rows:
        return x.argmax(-1)
    assert keys is not None
    choice = torch.empty(x.shape[0], dtype=torch.int64, device=x.device)
    if len(sampled_rows) < x.shape[0]:
        sampled = set(sampled_rows)
        index, sub = _rows_of(x, [i for i in range(x.shape[0]) if i not in sampled])
        assert index is not None
        choice.index_copy_(0, index, sub.argmax(-1))
    index, sub = _rows_of(x, sampled_rows)
    values, tokens = _candidates(sub, candidate_bound)
    pick = perturb(values, keys, tokens).argmax(-1, keepdim=True)
    picked = tokens.gather(1, pick).squeeze(1)
    if index is None:
        return picked
    choice.index_copy_(0, index, picked)
    return choice


def fetch_choices(
    x: torch.Tensor, choice: torch.Tensor, prob_rows: Sequence[int]
) -> tuple[list[int], list[bool], dict[int, float]]:
    """One device-to-host transfer: the chosen ids, whether each row had any allowed token
    (its chosen logit is finite), and the chosen tokens' probabilities for ``prob_rows``."""
    chosen_logit = x.gather(1, choice.unsqueeze(1)).squeeze(1)
    parts = [choice.to(torch.float64), torch.isfinite(chosen_logit).to(torch.float64)]
    if prob_rows:
        index, sub = _rows_of(x, prob_rows)
        chosen = choice if index is None else choice.index_select(0, index)
        probs = torch.softmax(sub, dim=-1)
        parts.append(probs.gather(1, chosen.unsqueeze(1)).squeeze(1).to(torch.float64))
    flat = torch.cat(parts).tolist()
    n = x.shape[0]
    ids = [int(v) for v in flat[:n]]
    valid = [v > 0 for v in flat[n: 2 * n]]
    return ids, valid, dict(zip(prob_rows, flat[2 * n:], strict=True))


def fetch_top_k(x: torch.Tensor, rows: Sequence[int], k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k token ids (int64) and probabilities (float32) of ``rows``, on the CPU, in one
    transfer."""
    _, sub = _rows_of(x, rows)
    probs = torch.softmax(sub, dim=-1)
    values, tokens = torch.topk(probs, min(k, x.shape[1]), dim=-1)
    packed = torch.cat([tokens.to(torch.float64), values.to(torch.float64)], dim=1).cpu()
    width = values.shape[1]
    return packed[:, :width].to(torch.int64), packed[:, width:].to(torch.float32)


def compact_bound(rows: RowList, width: int, vocab_size: int) -> int:
    """The candidate count of the compact draw, or 0 when it does not apply: some row is greedy,
    has no top_k or takes a dynamic temperature before top_k (it reads the whole row's
    entropy), or the bound is not much below the width."""
    bound = min(rows.top_k_bound, vocab_size)
    if not bound or len(rows.sampled) != len(rows) or bound >= width // 4 \
            or rows.any_early_dynamic_temperature:
        return 0
    return bound


class CompactDraw(NamedTuple):
    """What `draw_compact` chose: the shaped candidate logits ``values`` ``[rows, bound]``
    float32 (removed ones ``-inf``), their ``token_ids``, the column drawn in each row
    ``pick`` ``[rows, 1]``, and ``best``, the drawn column's perturbed logit (finite exactly
    when its logit is: the Gumbel noise is always finite)."""

    values: torch.Tensor
    token_ids: torch.Tensor
    pick: torch.Tensor
    best: torch.Tensor


class _Columns(NamedTuple):
    """What `draw_compact` derives from its rows alone (kept in ``rows.memo``): the
    temperature split, the rows cut below the bound by their top_k (with the largest such
    top_k), the tail stages' parameter columns by stage name, and the host arrays to send."""

    temperature: TemperatureRows
    cut: list[int]
    k_max: int
    tail: list[str]
    ints: list[np.ndarray]
    floats: list[np.ndarray]


def _columns(rows: RowList, bound: int) -> _Columns:
    temperature = temperature_rows(rows, "temperature")
    # A row whose top_k is the bound keeps all of its top `bound` values: no work to do.
    cut = [i for i in rows_using(rows, "top_k") if rows[i].settings.top_k < bound]
    tail = column_values(rows)
    ints = []
    if cut:
        ints.append(np.array([rows[i].settings.top_k for i in cut], np.int64).reshape(-1, 1))
    floats = [np.array(values, np.float32).reshape(-1, 1) for values in tail.values()]
    if temperature.fixed:
        floats.append(np.array(temperature.temps, np.float32).reshape(-1, 1))
    k_max = max((rows[i].settings.top_k for i in cut), default=0)
    return _Columns(temperature, cut, k_max, list(tail), ints, floats)


def _keys_and_columns(
    rows: RowList, staging: Staging, bound: int
) -> tuple[_Columns, torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
    """The rows' columns, this step's RNG keys on the device, and the columns' device copies
    (top_k values of the cut rows; tail and temperature columns): sent with the keys in one
    copy the first time, then kept in ``rows.memo`` while the rows are reused."""
    keys = rows.keys()
    columns = rows.memo.get(("compact", bound))
    if columns is None:
        columns = rows.memo[("compact", bound)] = _columns(rows, bound)
    sent = rows.memo.get(("compact-sent", bound))
    if sent is None:
        (keys_on, *ks), floats = staging.send([keys, *columns.ints], columns.floats)
        rows.memo[("compact-sent", bound)] = (ks, floats)
        return columns, keys_on, ks, floats
    return columns, staging.send_ints(keys), *sent


def draw_compact(
    x: torch.Tensor,
    rows: RowList,
    requests: Sequence[SampleRequest],
    vocab: VocabTables,
    staging: Staging,
    bound: int,
) -> CompactDraw:
    """Stages 4-14 on the top ``bound`` columns of the edited logits ``x`` ``[rows, vocab]``
    (not modified). Every per-row parameter (RNG keys, temperatures, top_k, the tail stages'
    columns) reaches the device through ``staging``: all in one copy on the rows' first call,
    then only the keys (the rest stays on the device with the rows, see `RowList.memo`)."""
    columns, keys, ks, floats = _keys_and_columns(rows, staging, bound)
    temperature, cut = columns.temperature, columns.cut
    values, token_ids = torch.topk(x, bound, dim=-1)
    values = values.to(torch.float32)
    temperature_stage(values, rows, "temperature", temperature,
                      floats[-1] if temperature.fixed else None)
    if cut:
        on_rows(values, cut, lambda sub: filters.top_k(sub, ks[0], columns.k_max))
    shape_tail(values, rows, requests, vocab, token_ids, dict(zip(columns.tail, floats)))
    best, pick = perturb(values, keys, token_ids).max(-1, keepdim=True)
    return CompactDraw(values, token_ids, pick, best)


def full_rows(values: torch.Tensor, token_ids: torch.Tensor, width: int) -> torch.Tensor:
    """The ``[rows, width]`` logits the full-width path would end with: ``values`` at their
    tokens, ``-inf`` elsewhere (for probabilities and top tokens, which read whole rows)."""
    full = torch.full((values.shape[0], width), float("-inf"), dtype=values.dtype,
                      device=values.device)
    return full.scatter_(1, token_ids, values)


def fetch_compact(best: torch.Tensor, choice: torch.Tensor) -> tuple[list[int], list[bool]]:
    """One transfer: each row's chosen token (``choice``) and whether its chosen logit is
    finite (``best`` is), as `draw.fetch_choices` reports them."""
    # abs(v) < inf is False for NaN and +-inf: invalid rows come back as -1.
    ids = torch.where(best.squeeze(1).abs() < float("inf"), choice, -1).tolist()
    return ids, [token >= 0 for token in ids]


def carry_columns(columns: _Columns, previous: RowList, rows: RowList, dropped: Sequence[int],
                  start: int, bound: int) -> _Columns:
    """`_columns(rows, bound)` from ``columns``, those of ``previous``, when ``rows`` is
    ``previous`` without its rows ``dropped`` (ascending), then new rows from ``start`` on
    (`rows.carry_rows`): the survivors' entries are cut out of the old lists and arrays,
    only the new rows' are computed. The same lists and values as a fresh `_columns`."""
    new = list(rows[start:])
    fixed, temps_removed = without(columns.temperature.fixed, dropped)
    temps = _deleted(columns.temperature.temps, temps_removed)
    dynamic = without(columns.temperature.dynamic, dropped)[0]
    added = temperature_rows(new, "temperature")
    temperature = TemperatureRows(fixed + _shifted(added.fixed, start), temps + added.temps,
                                  dynamic + _shifted(added.dynamic, start))
    cut, removed = without(columns.cut, dropped)
    new_cut = [i for i in rows_using(new, "top_k") if new[i].settings.top_k < bound]
    kept_k = np.delete(columns.ints[0].ravel(), removed) if columns.cut else np.zeros(0, np.int64)
    cut_k = np.concatenate([kept_k, np.array([new[i].settings.top_k for i in new_cut], np.int64)])
    cut += _shifted(new_cut, start)
    ints = [cut_k.reshape(-1, 1)] if cut else []
    old_tail = dict(zip(columns.tail, columns.floats, strict=False))
    new_tail = column_values(new)
    floats, tail = [], []
    for name in COLUMN_STAGES:
        values = np.zeros(0, np.float32)
        if name in old_tail:
            removed = positions_of(rows_using(previous, name), dropped)
            values = np.delete(old_tail[name].ravel(), removed)
        if name in new_tail:
            values = np.concatenate([values, np.array(new_tail[name], np.float32)])
        if values.size:
            tail.append(name)
            floats.append(values.reshape(-1, 1))
    if temperature.fixed:
        kept_temps = (np.delete(columns.floats[-1].ravel(), temps_removed)
                      if columns.temperature.fixed else np.zeros(0, np.float32))
        floats.append(np.concatenate([kept_temps, np.array(added.temps, np.float32)])
                      .reshape(-1, 1))
    return _Columns(temperature, cut, int(cut_k.max()) if cut else 0, tail, ints, floats)


def carry_memo(previous: RowList, rows: RowList, dropped: Sequence[int], start: int) -> None:
    """The sampler's `rows.MemoCarry`: of ``previous.memo``, the draws' host columns cut and
    extended for ``rows`` (`carry_columns`, `fused.carry_host_columns`; the arguments as
    there): their Python is most of a memo's rebuild. Device copies are not carried: the first
    draw sends them again with that step's keys (one copy either way). Other entries are cheap
    to rebuild."""
    memo = rows.memo
    for key, value in previous.memo.items():
        if not isinstance(key, tuple):
            continue
        if key[0] == "compact":
            memo[key] = carry_columns(value, previous, rows, dropped, start, key[1])
        elif key[0] == "fused-host":
            memo[key] = carry_host_columns(value, rows, dropped, start, key[1])


def _shifted(indices: list[int], start: int) -> list[int]:
    return [start + i for i in indices]


def _deleted(values: list[float], positions: list[int]) -> list[float]:
    out = list(values)
    for position in reversed(positions):
        del out[position]
    return out


# The fused draw replayed from CUDA graphs.

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
    """Captured fused draws on one CUDA device. ``max_graphs``: how many are kept at once
    (least recently used dropped). ``failure``: why a capture failed (graphs are then no
    longer used).

    What a graph holds: for one logits buffer (``x``'s storage, offset, strides and dtype), a
    row bucket, a candidate bound and a top-k (`fused.TOPK_CHOICES`), that top-k of the
    bucket's rows of that buffer and the kernel over them, writing tokens into a static
    output. Its inputs are static tensors: the RNG keys (copied in every call) and the rows'
    columns (temperature, top_k, top_p: copied when the sampler's rows change,
    `fused.fused_columns`). Rows past the call's count are padding: computed from whatever the
    buffer and the static inputs hold there, and dropped. Buckets are multiples of
    `ROW_BUCKET` rows, capped at the rows the buffer's storage holds, so a batch that loses
    or gains a job keeps its graph.

    Keyed by address: the decode graphs return logits as views of their static outputs, so
    one address serves every step of a bucket. Another tensor at an address a graph knows,
    with the same layout, is read correctly (a replay reads whatever that memory holds then);
    the bucket is recomputed from the storage's size every call, so a graph never reads past
    the tensor's storage.

    The output is a view of the graph's static buffer: valid until the next draw through the
    same graph (the sampler's callers copy or consume the tokens before they sample again).
    """

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
        with capture(graph, self._pool):
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
