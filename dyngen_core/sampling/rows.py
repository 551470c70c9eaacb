"""Per-row bookkeeping shared by the stages, and the row list kept across calls.

A `RowList` holds one `Row` per logits row (its request, its place in that request, its
settings, seed and counter) and what the stages ask about the rows, found in the one pass that
builds them (`expand_rows`); `rows_using` and `on_rows` run a stage on the rows that use it
(the others are left untouched).

`RowCache` keeps a sampler's `RowList` from one call to the next while its requests keep their
settings, seeds and outputs: only the counters (and which requests carry a constraint mask) are
refreshed, and what the stages derived from the rows (`RowList.memo`) is reused. When a few of
those requests are gone and new ones follow the rest (jobs ending and starting), the list is
carried over (`carry_rows`): only the new requests are expanded, and the memo is carried by the
cache's ``carry_memo`` (`draw.carry_memo`: the draws' host columns cut and extended rather than
rebuilt).
"""

from __future__ import annotations

import random
from bisect import bisect_left
from collections import Counter
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass
from itertools import compress, count, repeat
from operator import is_, is_not, sub
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


# The row list kept across calls. Its passes over requests are list comprehensions and plain
# loops, not ``map(operator.attrgetter(...))``, whose attribute loads CPython does not
# specialize (BENCHMARKS.md, "5. Host overhead").

# Fills a carried list's memo from its previous list's: (previous, rows, dropped, start), as
# `carry_rows` calls it (`draw.carry_memo`).
MemoCarry = Callable[[RowList, RowList, Sequence[int], int], None]


class RowCache:
    """The last `RowList` of single-row, seeded requests, and what it was built from.
    ``carry_memo`` fills the memo of a list carried over (`carry_rows`)."""

    def __init__(self, carry_memo: MemoCarry) -> None:
        self._carry_memo = carry_memo
        self._rows: RowList | None = None
        self._signature: list[tuple[Any, ...]] = []
        self._requests: list[SampleRequest] = []
        # `bound_counts` of ``_requests`` once a list was carried (built on the first carry).
        self._bounds: BoundCounts | None = None

    def rows(self, requests: Sequence[SampleRequest], seeds: random.Random, *,
             kept: bool = False) -> RowList:
        """`expand_rows(requests, seeds)`, or the previous call's list with its counters and
        ``any_mask`` updated when every request has the same settings (the same object, or an
        equal one), seed, draft ids and output options as then. Requests without a seed (a
        fresh one each call) or with drafts are never kept.

        kept: the caller's promise that no request object it passed before has had its
            settings, seed, draft ids or output options changed since (it builds a new request
            instead). Then the same request objects as last time, in the same order, reuse the
            list after an identity check, without reading those fields; and when some of them
            are gone and new ones (single-row, seeded) follow the rest, the list is carried
            over (`carry_rows`): only the new ones are expanded. Anything else (a reorder, an
            old request after a new one) builds the list afresh.

        A list returned is valid until the next call (which may refresh or reuse its rows)."""
        rows = self._rows
        if kept and rows is not None:
            if len(requests) == len(self._requests) and all(map(is_, requests, self._requests)):
                _refresh(rows, requests)
                return rows
            dropped = self._dropped(requests)
            if dropped is not None:
                return self._carry(rows, dropped, requests, seeds)
        signature = _signature(requests)
        if rows is not None and signature == self._signature and not _any_drafts(requests):
            _refresh(rows, requests)
            self._requests = list(requests)
            return rows
        rows = expand_rows(requests, seeds)
        self._bounds = None
        if rows.single and all(entry[1] is not None for entry in signature):
            self._rows, self._signature = rows, signature
            self._requests = list(requests)
        else:
            self._rows, self._signature, self._requests = None, [], []
        return rows

    def _dropped(self, requests: Sequence[SampleRequest]) -> list[int] | None:
        """The indices (ascending) of the last call's requests that are gone, when
        ``requests`` is that list with those removed (the rest in their order) and new
        single-row, seeded ones appended, at least one request surviving; None for any other
        change (a reorder, a request of the last call after a new one, drafts or no seed among
        the new ones)."""
        previous = self._requests
        dropped: list[int] = []
        i = j = 0
        # Runs of the same objects, found by C-level scans (a step drops a few requests).
        while i < len(requests) and j < len(previous):
            run = next(compress(count(), map(is_not, requests[i:], previous[j:])),
                       min(len(requests) - i, len(previous) - j))
            i, j = i + run, j + run
            if i == len(requests) or j == len(previous):
                break
            found = next(compress(count(j + 1), map(is_, repeat(requests[i]), previous[j + 1:])),
                         -1)
            if found < 0:  # a new request: the rest must be new
                break
            dropped.extend(range(j, found))
            j = found
        dropped.extend(range(j, len(previous)))
        appended = requests[i:]
        if len(dropped) == len(previous) or _any_drafts(appended) \
                or any(r.seed is None for r in appended) or _any_among(appended, previous):
            return None
        return dropped

    def _carry(self, rows: RowList, dropped: list[int], requests: Sequence[SampleRequest],
               seeds: random.Random) -> RowList:
        """`carry_rows`, remembered as the new kept list (with its signature and bounds)."""
        previous = self._requests
        bounds = self._bounds
        if bounds is None:
            bounds = bound_counts(previous)
        bounds.subtract(bound_key(previous[i]) for i in dropped)
        rows = carry_rows(rows, dropped, requests, seeds, bounds, self._carry_memo)
        _refresh(rows, requests)
        signature = list(self._signature)
        for i in reversed(dropped):
            del signature[i]
        signature.extend(_signature(requests[len(signature):]))
        self._rows, self._requests, self._bounds = rows, list(requests), bounds
        self._signature = signature
        return rows


def _any_among(requests: Sequence[SampleRequest], others: Sequence[SampleRequest]) -> bool:
    """Whether one of ``requests`` is (the same object as) one of ``others``."""
    if len(requests) > 8:
        ids = set(map(id, others))
        return any(id(r) in ids for r in requests)
    return any(any(map(is_, repeat(r), others)) for r in requests)


def _signature(requests: Sequence[SampleRequest]) -> list[tuple[Any, ...]]:
    """Everything `expand_rows` reads of a request but its counter, allowed_tokens and
    draft_ids (kept lists have none; the first two may be arrays, whose == is elementwise:
    never compared)."""
    return [(r.settings, r.seed, r.return_probs, r.return_top_tokens, r.return_logits)
            for r in requests]


def _refresh(rows: RowList, requests: Sequence[SampleRequest]) -> None:
    """What changes from step to step in a kept list: counters and constraint masks."""
    counters = [r.counter for r in requests]
    for row, counter in zip(rows, counters, strict=True):
        row.counter = counter
    sampled = rows.sampled
    rows.counters = counters if len(sampled) == len(rows) else [counters[i] for i in sampled]
    any_mask = False
    for r in requests:
        # `is not None`, never `==`: a mask is an array, whose comparison is elementwise.
        if r.allowed_tokens is not None:
            any_mask = True
            break
    rows.any_mask = any_mask


def _any_drafts(requests: Sequence[SampleRequest]) -> bool:
    for r in requests:
        if r.draft_ids:
            return True
    return False


# Requests by `bound_key`: what a list's top_k bound is derived from, kept up to date as
# requests end and join (a few counts instead of a pass over every request).
BoundCounts = Counter[tuple[int, bool] | None]


def carry_rows(previous: RowList, dropped: Sequence[int], requests: Sequence[SampleRequest],
               seeds: random.Random, bounds: BoundCounts, carry_memo: MemoCarry) -> RowList:
    """The rows of ``requests``: the single-row list ``previous`` without its rows ``dropped``
    (ascending indices of the requests that ended; the others are the leading requests of
    ``requests``, in their order), then the expanded rest of ``requests`` (single-row, seeded).

    bounds: `bound_counts` of the surviving requests (those that ended already taken out);
        the new requests are added to it.
    The surviving `Row` objects move to the new list (their ``request`` index is rewritten):
    ``previous`` must not be used afterwards. Its ``memo`` is carried by ``carry_memo``
    (called with ``previous``, the new list, ``dropped`` and the index of the first new row);
    the stages rebuild what that leaves out."""
    rows = RowList()
    rows.extend(previous)
    for i in reversed(dropped):
        del rows[i]
    first = dropped[0] if dropped else len(rows)
    for k in range(first, len(rows)):  # the rows before the first dropped one keep their index
        rows[k].request = k
    for stages, group in previous.groups.items():
        kept_group, _ = without(group, dropped)
        if kept_group:
            rows.groups[stages] = kept_group
    rows.sampled, removed = without(previous.sampled, dropped)
    rows.seed_keys = list(previous.seed_keys)
    for position in reversed(removed):
        del rows.seed_keys[position]
    rows.prob_rows = without(previous.prob_rows, dropped)[0]
    rows.extra_requests = without(previous.extra_requests, dropped)[0]
    extras = [requests[i] for i in rows.extra_requests]
    rows.any_top_tokens = any(r.return_top_tokens > 0 for r in extras)
    rows.any_logits = any(r.return_logits for r in extras)
    start = len(rows)
    if start < len(requests):
        appended = requests[start:]
        _append_rows(rows, expand_rows(appended, seeds))
        bounds.update(bound_key(r) for r in appended)
    if len(rows.groups) > 1:  # `expand_rows` order: by first row
        rows.groups = dict(sorted(rows.groups.items(), key=lambda item: item[1][0]))
    _settle_bounds(rows, bounds)
    carry_memo(previous, rows, dropped, start)
    return rows


def _append_rows(rows: RowList, tail: RowList) -> None:
    """``tail`` (the new requests' rows, numbered from 0) after ``rows``."""
    start = len(rows)
    for row in tail:
        row.request += start
    rows.extend(tail)
    groups = rows.groups
    for stages, group in tail.groups.items():
        shifted = [start + i for i in group]
        if stages in groups:
            groups[stages].extend(shifted)
        else:
            groups[stages] = shifted
    rows.sampled.extend(start + i for i in tail.sampled)
    rows.seed_keys.extend(tail.seed_keys)
    rows.prob_rows.extend(start + i for i in tail.prob_rows)
    rows.extra_requests.extend(start + i for i in tail.extra_requests)
    rows.any_top_tokens = rows.any_top_tokens or tail.any_top_tokens
    rows.any_logits = rows.any_logits or tail.any_logits


def bound_key(request: SampleRequest) -> tuple[int, bool] | None:
    """What a request adds to its list's ``top_k_bound`` and ``any_early_dynamic_temperature``
    (None: greedy, nothing): its top_k, and whether it takes a dynamic temperature before
    top_k."""
    traits = request.traits()
    if traits.is_greedy:
        return None
    return traits.top_k, traits.dynamic_temperature and "temperature" in traits.stages


def bound_counts(requests: Iterable[SampleRequest]) -> BoundCounts:
    """How many of ``requests`` have each `bound_key`."""
    return Counter(bound_key(r) for r in requests)


def _settle_bounds(rows: RowList, bounds: BoundCounts) -> None:
    """``top_k_bound`` and ``any_early_dynamic_temperature`` from the sampled rows' few
    distinct `bound_key` values (a dropped row may have held the largest top_k)."""
    live = [key for key, count in bounds.items() if count > 0 and key is not None]
    rows.top_k_bound = 0
    if live and all(top_k > 1 for top_k, _ in live):
        rows.top_k_bound = max(top_k for top_k, _ in live)
    rows.any_early_dynamic_temperature = any(early for _, early in live)
