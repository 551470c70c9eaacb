"""The compact draw: every row sampled with a top_k, so only each row's top ``max(top_k)``
logits can ever be drawn. One top-k over the (edited) logits, then temperature, top_k, the tail
stages and the Gumbel draw all run on ``[rows, bound]`` values, never on the full vocabulary.

The full-width path (`shaping.shape_distribution` then `draw.choose`) divides every logit by the
temperature, masks the vocabulary below the k-th value, writes the compacted tail back and takes
another top-k to draw: about eight passes over ``[rows, vocab]``. Here it is one top-k. The
distribution is the same: temperature scales a row without reordering it, so the top ``bound``
of ``x / T`` are the top ``bound`` of ``x`` divided by ``T`` (bit for bit: the same division),
and the other tokens are removed by top_k anyway. The only difference is which of several
tokens tied at the ``bound``-th place is kept, as when the full-width path compacts (see
`shaping`), here before dividing instead of after.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import torch

from dyngen_core.engine.record import SampleRequest
from dyngen_core.sampling import filters
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
from dyngen_core.sampling.vocab import VocabTables


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
    (`row_carry.carry_rows`): the survivors' entries are cut out of the old lists and arrays,
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


def _shifted(indices: list[int], start: int) -> list[int]:
    return [start + i for i in indices]


def _deleted(values: list[float], positions: list[int]) -> list[float]:
    out = list(values)
    for position in reversed(positions):
        del out[position]
    return out
