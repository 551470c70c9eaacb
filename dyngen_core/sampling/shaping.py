"""Stages 4-13: temperature and the truncation filters, XTC, mirostat (see `filters` for the
definitions). Greedy rows never reach these stages (their settings switch them off)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from dyngen_core.sampling import filters
from dyngen_core.sampling.request import SampleRequest
from dyngen_core.sampling.rng import host_uniform
from dyngen_core.sampling.rows import Row, column, on_rows, rows_using
from dyngen_core.sampling.vocab import VocabTables
from dyngen_core.settings import SamplerSettings

_XTC_STREAM = 0xFFFFFFFF  # host-uniform stream of XTC's coin; never a token id

StageFn = Callable[[torch.Tensor, list[SamplerSettings]], torch.Tensor]


def candidate_bound(settings: Sequence[SamplerSettings], vocab_size: int) -> int:
    """Most candidates any of these rows can have after top_k (the vocab size when a row has
    no top_k)."""
    if settings and all(s.top_k > 1 for s in settings):
        return min(max(s.top_k for s in settings), vocab_size)
    return vocab_size


def shape_distribution(
    x: torch.Tensor, rows: Sequence[Row], requests: Sequence[SampleRequest], vocab: VocabTables
) -> None:
    """Stages 4-13 in place on logits ``x``."""
    dev = x.device
    size = vocab.vocab_size

    def stage(name: str, fn: StageFn, picked: list[int] | None = None) -> None:
        chosen = rows_using(rows, name) if picked is None else picked
        settings = [rows[i].settings for i in chosen]
        on_rows(x, chosen, lambda sub: fn(sub, settings))

    def col(values: list[float], dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return column(values, dev, dtype)

    _temperature(x, rows, "temperature")
    stage("top_k", lambda sub, ss: filters.top_k(
        sub, col([s.top_k for s in ss], torch.int64), max(s.top_k for s in ss)))
    stage("top_p", lambda sub, ss: filters.top_p(
        sub, col([s.top_p for s in ss]), candidate_bound(ss, size)))
    stage("min_p", lambda sub, ss: filters.min_p(sub, col([s.min_p for s in ss])))
    stage("typical", lambda sub, ss: filters.typical(sub, col([s.typical for s in ss])))
    stage("tfs", lambda sub, ss: filters.tail_free(
        sub, col([s.tfs for s in ss]), candidate_bound(ss, size)))
    stage("top_a", lambda sub, ss: filters.top_a(sub, col([s.top_a for s in ss])))
    fired = [i for i in rows_using(rows, "xtc") if host_uniform(
        rows[i].seed, rows[i].counter, _XTC_STREAM) < rows[i].settings.xtc_probability]
    stage("xtc", lambda sub, ss: filters.xtc(
        sub, col([s.xtc_threshold for s in ss]), vocab.xtc_protected(dev)), fired)
    _temperature(x, rows, "temperature_last")
    mirostat_rows = rows_using(rows, "mirostat")
    mus = [requests[rows[i].request].state.current_mu(rows[i].settings) for i in mirostat_rows]
    on_rows(x, mirostat_rows, lambda sub: filters.mirostat(sub, col(mus)))


def _temperature(x: torch.Tensor, rows: Sequence[Row], name: str) -> None:
    dev = x.device
    picked = rows_using(rows, name)
    fixed = [i for i in picked if not rows[i].settings.uses_dynamic_temperature]
    dynamic = [i for i in picked if rows[i].settings.uses_dynamic_temperature]
    temps = [rows[i].settings.temperature for i in fixed]
    on_rows(x, fixed, lambda sub: filters.temperature(sub, column(temps, dev)))
    ss = [rows[i].settings for i in dynamic]
    on_rows(x, dynamic, lambda sub: filters.dynamic_temperature(
        sub, column([s.min_temp for s in ss], dev), column([s.max_temp for s in ss], dev),
        column([s.temp_exponent for s in ss], dev)))
