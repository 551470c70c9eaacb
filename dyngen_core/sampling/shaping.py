"""Stages 4-13: temperature and the truncation filters, XTC, mirostat, and the filters' own
definitions over logits rows (removed tokens are ``-inf``). Greedy rows never reach these stages
(their settings switch them off). Ties at the k-th logit are kept by top_k but may be cut when
rows are compacted to their top_k columns."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, NamedTuple

import torch

from dyngen_core.engine.record import SampleRequest
from dyngen_core.engine.settings import SamplerSettings
from dyngen_core.sampling import shaping as filters
from dyngen_core.sampling.rng import host_uniform
from dyngen_core.sampling.rows import Row, RowList, column, on_rows, rows_using, rows_using_any

if TYPE_CHECKING:
    from dyngen_core.sampling.sampler import VocabTables

_XTC_STREAM = 0xFFFFFFFF  # host-uniform stream of XTC's coin; never a token id

def candidate_bound(settings: Sequence[SamplerSettings], vocab_size: int) -> int:
    """Most candidates any of these rows can have after top_k (the vocab size when a row has
    no top_k)."""
    if settings and all(s.top_k > 1 for s in settings):
        return min(max(s.top_k for s in settings), vocab_size)
    return vocab_size


_TAIL = frozenset({"top_p", "min_p", "typical", "tfs", "top_a", "xtc", "temperature_last",
                   "mirostat"})


def shape_distribution(
    x: torch.Tensor, rows: Sequence[Row], requests: Sequence[SampleRequest], vocab: VocabTables
) -> None:
    """Stages 4-13 in place on logits ``x``.

    When every row that uses a stage after top_k has a top_k, those rows are cut down to their
    ``max(top_k)`` best columns for the remaining stages (each then costs O(k), not O(vocab)),
    and written back afterwards.
    """
    temperature_stage(x, rows, "temperature")
    picked = rows_using(rows, "top_k")
    ks = [rows[i].settings.top_k for i in picked]
    on_rows(x, picked, lambda sub: filters.top_k(
        sub, column(ks, x.device, torch.int64), max(ks)))
    tail = rows_using_any(rows, _TAIL)
    if not tail:
        return
    if isinstance(rows, RowList) and len(tail) == len(rows.sampled):
        # Only sampled rows have tail stages: these are all of them, whose bound is known.
        bound = min(rows.top_k_bound or vocab.vocab_size, vocab.vocab_size)
    else:
        bound = candidate_bound([rows[i].settings for i in tail], vocab.vocab_size)
    if bound >= x.shape[1] // 4:
        shape_tail(x, rows, requests, vocab, None)
        return
    tail_rows = rows if len(tail) == len(rows) else [rows[i] for i in tail]

    def compact_tail(sub: torch.Tensor) -> torch.Tensor:
        values, token_ids = torch.topk(sub, bound, dim=-1)
        shape_tail(values, tail_rows, requests, vocab, token_ids)
        return sub.fill_(float("-inf")).scatter_(1, token_ids, values)

    on_rows(x, tail, compact_tail)


# Tail stages whose only per-row parameter is the settings attribute of the same name.
COLUMN_STAGES = ("top_p", "min_p", "typical", "tfs", "top_a")


def shape_tail(
    x: torch.Tensor,
    rows: Sequence[Row],
    requests: Sequence[SampleRequest],
    vocab: VocabTables,
    token_ids: torch.Tensor | None,
    columns: Mapping[str, torch.Tensor] | None = None,
) -> None:
    """Stages 6-13 on ``x``, whose columns are ``token_ids`` (None: the whole vocabulary).

    columns: the parameter columns of `COLUMN_STAGES` already on the device (see
        `column_values`), by stage name; the missing ones are copied here.
    """
    dev = x.device
    width = x.shape[1]

    def col(values: list[float]) -> torch.Tensor:
        return column(values, dev)

    def stage(name: str, fn: Callable[[torch.Tensor, int, torch.Tensor], torch.Tensor]) -> None:
        chosen, bound, values = _stage_rows(rows, name, width)
        if not chosen:
            return
        param = columns.get(name) if columns else None
        if param is None:
            param = col(values)
        on_rows(x, chosen, lambda sub: fn(sub, bound, param))

    stage("top_p", lambda sub, bound, p: filters.top_p(sub, p, bound))
    stage("min_p", lambda sub, bound, p: filters.min_p(sub, p))
    stage("typical", lambda sub, bound, p: filters.typical(sub, p, bound))
    stage("tfs", lambda sub, bound, p: filters.tail_free(sub, p, bound))
    stage("top_a", lambda sub, bound, p: filters.top_a(sub, p))
    fired = [i for i in rows_using(rows, "xtc") if host_uniform(
        rows[i].seed, rows[i].counter, _XTC_STREAM) < rows[i].settings.xtc_probability]
    if fired:
        protected = vocab.xtc_protected(dev)
        if token_ids is not None:
            index = torch.tensor(fired, dtype=torch.int64, device=dev)
            protected = protected[token_ids.index_select(0, index)]
        thresholds = col([rows[i].settings.xtc_threshold for i in fired])
        on_rows(x, fired, lambda sub: filters.xtc(sub, thresholds, protected))
    temperature_stage(x, rows, "temperature_last")
    mirostat_rows = rows_using(rows, "mirostat")
    mus = [requests[rows[i].request].state.current_mu(rows[i].settings) for i in mirostat_rows]
    on_rows(x, mirostat_rows, lambda sub: filters.mirostat(sub, col(mus)))


def _stage_rows(rows: Sequence[Row], name: str, width: int) -> tuple[list[int], int, list[float]]:
    """The rows using column stage ``name``, the `candidate_bound` of their settings for
    ``width`` columns, and their parameter values; kept in ``rows.memo`` for a `RowList` (it
    depends on the rows' settings alone)."""
    memo = rows.memo if isinstance(rows, RowList) else None
    found = memo.get(("stage", name, width)) if memo is not None else None
    if found is None:
        chosen = rows_using(rows, name)
        settings = [rows[i].settings for i in chosen]
        found = (chosen, candidate_bound(settings, width),
                 [getattr(s, name) for s in settings])
        if memo is not None:
            memo[("stage", name, width)] = found
    return found


def column_values(rows: Sequence[Row]) -> dict[str, list[float]]:
    """The parameter of each of `COLUMN_STAGES` that some row uses, for the rows using it (in
    `rows_using` order): what `shape_tail` would copy to the device one stage at a time."""
    values: dict[str, list[float]] = {}
    for name in COLUMN_STAGES:
        picked = rows_using(rows, name)
        if picked:
            values[name] = [getattr(rows[i].settings, name) for i in picked]
    return values


class TemperatureRows(NamedTuple):
    """The rows of a temperature stage: ``fixed`` ones with their ``temps``, and ``dynamic``
    ones (dynamic temperature)."""

    fixed: list[int]
    temps: list[float]
    dynamic: list[int]


def temperature_rows(rows: Sequence[Row], name: str) -> TemperatureRows:
    """The rows using temperature stage ``name``, fixed or dynamic."""
    split = TemperatureRows([], [], [])
    seen: dict[int, tuple[bool, float]] = {}  # by settings object: their attributes are slow
    last: object = None  # neighbouring rows mostly share one: no look-up for them
    known = (False, 1.0)
    for i in rows_using(rows, name):
        settings = rows[i].settings
        if settings is not last:
            last = settings
            found = seen.get(id(settings))
            if found is None:
                found = seen[id(settings)] = (settings.uses_dynamic_temperature,
                                              settings.temperature)
            known = found
        if known[0]:
            split.dynamic.append(i)
        else:
            split.fixed.append(i)
            split.temps.append(known[1])
    return split


def temperature_stage(
    x: torch.Tensor,
    rows: Sequence[Row],
    name: str,
    split: TemperatureRows | None = None,
    fixed_temps: torch.Tensor | None = None,
) -> None:
    """Temperature stage ``name`` ("temperature" or "temperature_last") in place on ``x``.

    split: `temperature_rows` of ``rows``, when already known.
    fixed_temps: ``split.temps`` as a ``[rows, 1]`` float32 column on the device, when already
        there.
    """
    dev = x.device
    fixed, temps, dynamic = split if split is not None else temperature_rows(rows, name)
    if fixed:
        temp = fixed_temps if fixed_temps is not None else column(temps, dev)
        on_rows(x, fixed, lambda sub: filters.temperature(sub, temp))
    ss = [rows[i].settings for i in dynamic]
    on_rows(x, dynamic, lambda sub: filters.dynamic_temperature(
        sub, column([s.min_temp for s in ss], dev), column([s.max_temp for s in ss], dev),
        column([s.temp_exponent for s in ss], dev)))


_NEG_INF = float("-inf")


def _probs(x: torch.Tensor) -> torch.Tensor:
    return torch.softmax(x, dim=-1)


def _drop(x: torch.Tensor, remove: torch.Tensor) -> torch.Tensor:
    return x.masked_fill_(remove, _NEG_INF)


def surviving_bound(x: torch.Tensor, bound: int) -> int:
    """A bound on any row's surviving tokens: ``bound`` when it is known (top_k ran); on the
    CPU, where a host sync is free, the largest count of finite logits."""
    if bound >= x.shape[-1] and x.device.type == "cpu":
        return max(int(torch.isfinite(x).sum(-1).max()), 1)
    return bound


def descending(values: torch.Tensor, bound: int) -> torch.Tensor:
    """The ``bound`` largest values per row, largest first (a top-k when it is cheaper than a
    full sort)."""
    if bound < values.shape[-1] // 4:
        return torch.topk(values, bound, dim=-1, sorted=True).values
    return torch.sort(values, dim=-1, descending=True).values[:, :bound]


def temperature(x: torch.Tensor, temp: torch.Tensor) -> torch.Tensor:
    return x.div_(temp)


def dynamic_temperature(
    x: torch.Tensor, min_temp: torch.Tensor, max_temp: torch.Tensor, exponent: torch.Tensor
) -> torch.Tensor:
    logp = torch.log_softmax(x, dim=-1)
    p = logp.exp()
    entropy = -torch.where(p > 0, p * logp, torch.zeros_like(p)).sum(-1, keepdim=True)
    candidates = torch.isfinite(x).sum(-1, keepdim=True).float()
    max_entropy = candidates.log().clamp_min(1e-6)
    normalized = (entropy / max_entropy).clamp(0.0, 1.0)
    temp = min_temp + (max_temp - min_temp) * normalized.pow(exponent)
    return x.div_(temp.clamp_min(1e-4))


def top_k(x: torch.Tensor, k: torch.Tensor, k_max: int) -> torch.Tensor:
    """k: int64 ``[rows, 1]`` (each at most ``k_max``)."""
    k_max = min(k_max, x.shape[-1])
    kth = descending(x, k_max).gather(1, (k.clamp(1, k_max) - 1))
    return _drop(x, x < kth)


def top_p(x: torch.Tensor, p_target: torch.Tensor, bound: int) -> torch.Tensor:
    """bound: an upper bound on any row's candidate count (vocab size when unknown)."""
    p = _probs(x)
    if bound >= x.shape[-1] and x.device.type == "cpu":
        # A token with p < (1 - top_p) / vocab always has more than top_p of the mass ahead
        # of it, so it is cut: only the rest need sorting (a host sync, free on the CPU).
        floor = (1.0 - p_target) / x.shape[-1]
        bound = max(int((p >= floor).sum(-1).max()), 1)
    sorted_p = descending(p, bound)
    before = sorted_p.cumsum(-1) - sorted_p
    keep = (before < p_target).sum(-1, keepdim=True).clamp_min(1)
    cut = sorted_p.gather(1, keep - 1)
    return _drop(x, p < cut)


def min_p(x: torch.Tensor, ratio: torch.Tensor) -> torch.Tensor:
    p = _probs(x)
    return _drop(x, p < ratio * p.amax(-1, keepdim=True))


def top_a(x: torch.Tensor, ratio: torch.Tensor) -> torch.Tensor:
    p = _probs(x)
    p_max = p.amax(-1, keepdim=True)
    return _drop(x, (p < ratio * p_max * p_max) & (p < p_max))


def typical(x: torch.Tensor, mass: torch.Tensor, bound: int) -> torch.Tensor:
    """bound: an upper bound on any row's candidate count (only those are sorted)."""
    logp = torch.log_softmax(x, dim=-1)
    p = logp.exp()
    entropy = -torch.where(p > 0, p * logp, torch.zeros_like(p)).sum(-1, keepdim=True)
    deviation = (-logp - entropy).abs()  # inf for removed tokens
    bound = surviving_bound(x, bound)
    if bound < x.shape[-1] // 4:
        candidates = torch.topk(x, bound, dim=-1).indices
        sorted_dev, order = torch.sort(deviation.gather(1, candidates), dim=-1)
        order = candidates.gather(1, order)
    else:
        sorted_dev, order = torch.sort(deviation, dim=-1)
    cumulative = p.gather(1, order).cumsum(-1)
    last = (cumulative < mass).sum(-1, keepdim=True).clamp_max(sorted_dev.shape[-1] - 1)
    return _drop(x, deviation > sorted_dev.gather(1, last))


def tail_free(x: torch.Tensor, z: torch.Tensor, bound: int) -> torch.Tensor:
    p = _probs(x)
    sorted_p = descending(p, surviving_bound(x, bound))
    n = (sorted_p > 0).sum(-1, keepdim=True)
    if sorted_p.shape[-1] < 3:
        return x
    d2 = (sorted_p[:, :-2] - 2 * sorted_p[:, 1:-1] + sorted_p[:, 2:]).abs()
    index = torch.arange(d2.shape[-1], device=x.device).unsqueeze(0)
    d2 = torch.where(index < n - 2, d2, torch.zeros_like(d2))
    total = d2.sum(-1, keepdim=True)
    cdf = (d2 / total.clamp_min(1e-30)).cumsum(-1)
    below = ((cdf <= z) & (index < n - 2)).sum(-1, keepdim=True)
    keep = torch.minimum(below + 1, n - 1).clamp_min(1)
    cut = sorted_p.gather(1, keep - 1)
    applies = (n >= 3) & (total > 0)
    return _drop(x, (p < cut) & applies)


def xtc(x: torch.Tensor, threshold: torch.Tensor, protected: torch.Tensor) -> torch.Tensor:
    """protected: bool ``[vocab]``, tokens XTC never removes (newlines, EOS)."""
    p = _probs(x)
    above = (p >= threshold) & ~protected
    count = above.sum(-1, keepdim=True)
    least = torch.where(above, p, torch.full_like(p, math.inf)).amin(-1, keepdim=True)
    return _drop(x, above & (p > least) & (count >= 2))


def mirostat(x: torch.Tensor, mu: torch.Tensor) -> torch.Tensor:
    p = _probs(x)
    target = torch.exp2(-mu)
    return _drop(x, (p < target) & (p < p.amax(-1, keepdim=True)))
