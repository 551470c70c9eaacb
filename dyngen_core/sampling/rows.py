"""Per-row bookkeeping shared by the stages: which request a logits row belongs to, and helpers
that run a stage on a subset of rows (rows that do not use a stage are left untouched)."""

from __future__ import annotations

import random
from bisect import bisect_left
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from itertools import repeat
from operator import sub
from typing import Any

import numpy as np
import torch

from dyngen_core.engine.record import SampleRequest
from dyngen_core.engine.settings import SamplerSettings
from dyngen_core.sampling.rng import row_keys, seed_key


@dataclass(slots=True)
class Row:
    """One logits row: its request, its place in that request, and what it needs."""

    request: int
    offset: int
    settings: SamplerSettings
    seed: int
    counter: int
    stages: frozenset[str]


class RowList(list[Row]):
    """The rows of one sampling call, with what the stages ask about them, found in the one
    pass that builds them (so a stage no row uses costs a dict scan, not a pass over rows).

    groups: row indices by stage set (rows of one settings object share theirs).
    sampled: non-greedy rows, with ``seed_keys`` and ``counters`` (their `row_keys` inputs).
    prob_rows: rows whose chosen token's probability is needed (return_probs, mirostat).
    extra_requests: requests asking for probabilities, top tokens or logits.
    single: every request owns one row (row ``i`` is request ``i``).
    any_mask / any_top_tokens / any_logits: some request has allowed_tokens / asks for top
        tokens / asks for raw logits.
    top_k_bound: the largest top_k of the sampled rows when every one has a top_k > 1, else 0.
    any_early_dynamic_temperature: some row takes a dynamic temperature before top_k.
    memo: what stages derive from these rows alone (per-row parameter columns, on the host or
        the device), kept with them: a `RowCache` hands the same list to later calls whose
        requests have the same settings, so these are computed once per set of jobs.
    """

    def __init__(self) -> None:
        super().__init__()
        self.groups: dict[frozenset[str], list[int]] = {}
        self.sampled: list[int] = []
        self.seed_keys: list[int] = []
        self.counters: list[int] = []
        self.prob_rows: list[int] = []
        self.extra_requests: list[int] = []
        self.single = True
        self.any_mask = self.any_top_tokens = self.any_logits = False
        self.top_k_bound = 0
        self.any_early_dynamic_temperature = False
        self.memo: dict[Hashable, Any] = {}

    def keys(self) -> np.ndarray:
        """`rng.row_keys` of the sampled rows: int64 ``[len(sampled), 2]`` (their seed keys
        converted once per list, kept in ``memo``)."""
        seed_keys = self.memo.get("seed_keys")
        if seed_keys is None:
            seed_keys = self.memo["seed_keys"] = np.array(self.seed_keys, dtype=np.uint64)
        return row_keys(seed_keys, self.counters)


def expand_rows(requests: Sequence[SampleRequest], seeds: random.Random) -> RowList:
    """One `Row` per logits row; requests without a seed get a fresh one from ``seeds``."""
    rows = RowList()
    groups, sampled, prob_rows = rows.groups, rows.sampled, rows.prob_rows
    seed_keys, counters = rows.seed_keys, rows.counters
    all_top_k, max_top_k, single = True, 0, True
    any_mask = any_top_tokens = any_logits = early_dynamic = False
    append = rows.append
    for i, req in enumerate(requests):
        settings, stages, greedy, top_k, mirostat, dynamic = req.traits()
        num_rows = 1 + len(req.draft_ids) if req.draft_ids else 1
        if num_rows > 1:
            _check_multi_row(i, req)
            single = False
        seed = req.seed
        if seed is None:
            seed = seeds.getrandbits(63)
        counter = req.counter
        group = groups.get(stages)
        if group is None:
            group = groups[stages] = []
        index = len(rows)
        if num_rows == 1:  # the usual request: no inner loops
            append(Row(i, 0, settings, seed, counter, stages))
            group.append(index)
        else:
            for j in range(num_rows):
                append(Row(i, j, settings, seed, counter + j, stages))
                group.append(index + j)
        if not greedy:
            all_top_k = all_top_k and top_k > 1
            early_dynamic = early_dynamic or dynamic and "temperature" in stages
            if top_k > max_top_k:
                max_top_k = top_k
            key = seed_key(seed)
            if num_rows == 1:
                sampled.append(index)
                seed_keys.append(key)
                counters.append(counter)
            else:
                for j in range(num_rows):
                    sampled.append(index + j)
                    seed_keys.append(key)
                    counters.append(counter + j)
        if req.return_probs or mirostat:
            prob_rows.extend(range(index, index + num_rows))
        if req.allowed_tokens is not None:
            any_mask = True
        if req.return_probs or req.return_top_tokens > 0 or req.return_logits:
            rows.extra_requests.append(i)
            any_top_tokens = any_top_tokens or req.return_top_tokens > 0
            any_logits = any_logits or req.return_logits
    rows.single, rows.any_mask = single, any_mask
    rows.any_top_tokens, rows.any_logits = any_top_tokens, any_logits
    rows.top_k_bound = max_top_k if sampled and all_top_k else 0
    rows.any_early_dynamic_temperature = early_dynamic
    return rows


def _check_multi_row(i: int, req: SampleRequest) -> None:
    if req.settings.mirostat:
        raise ValueError(
            f"request {i}: mirostat needs one row per step (its mu depends on the previous "
            "token); do not attach draft tokens to mirostat jobs"
        )
    if req.allowed_tokens is not None and getattr(req.allowed_tokens, "ndim", 1) != 2:
        raise ValueError(
            f"request {i}: with draft tokens, allowed_tokens needs one mask per row "
            f"(shape [{req.num_rows}, words])"
        )


def rows_using(rows: Sequence[Row], stage: str) -> list[int]:
    """Indices of the rows whose settings use ``stage``."""
    return rows_using_any(rows, frozenset((stage,)))


def rows_using_any(rows: Sequence[Row], stages: frozenset[str]) -> list[int]:
    """Indices (ascending) of the rows whose settings use any of ``stages``."""
    if not isinstance(rows, RowList):
        return [i for i, r in enumerate(rows) if r.stages & stages]
    hits = [group for used, group in rows.groups.items() if used & stages]
    if len(hits) <= 1:
        return list(hits[0]) if hits else []
    return sorted(i for group in hits for i in group)


def without(indices: list[int], dropped: Sequence[int]) -> tuple[list[int], list[int]]:
    """Ascending row ``indices`` renumbered for a list without rows ``dropped`` (ascending),
    and the positions in ``indices`` of the dropped ones. A few dropped rows cut ``indices``
    into a few runs, each shifted in one C-level pass."""
    if not dropped:
        return list(indices), []
    out: list[int] = []
    removed: list[int] = []
    start = 0
    for shift, row in enumerate(dropped):
        stop = bisect_left(indices, row, start)
        out.extend(map(sub, indices[start:stop], repeat(shift)) if shift else indices[start:stop])
        start = stop
        if stop < len(indices) and indices[stop] == row:
            removed.append(stop)
            start += 1
    out.extend(map(sub, indices[start:], repeat(len(dropped))))
    return out, removed


def positions_of(indices: list[int], rows: Sequence[int]) -> list[int]:
    """The positions in ascending ``indices`` of those of ``rows`` they hold (``without``'s
    second result, alone)."""
    found = []
    for row in rows:
        position = bisect_left(indices, row)
        if position < len(indices) and indices[position] == row:
            found.append(position)
    return found


def on_rows(
    x: torch.Tensor, picked: Sequence[int], fn: Callable[[torch.Tensor], torch.Tensor]
) -> None:
    """``x[picked] = fn(x[picked])`` in place (no gather when every row is picked)."""
    if not picked:
        return
    if len(picked) == x.shape[0]:
        out = fn(x)
        if out is not x:
            x.copy_(out)
        return
    index = torch.tensor(list(picked), dtype=torch.int64, device=x.device)
    x.index_copy_(0, index, fn(x.index_select(0, index)))


def column(
    values: Sequence[float], device: torch.device, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Per-row parameters as a ``[rows, 1]`` tensor on ``device``."""
    return torch.tensor(list(values), dtype=dtype, device=device).unsqueeze(1)
