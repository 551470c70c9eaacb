"""`RowCache`: a sampler's `RowList` kept from one call to the next while its requests keep
their settings, seeds and outputs; only the counters (and which requests carry a constraint
mask) are refreshed.

Why: while decoding, the same jobs are sampled step after step with the same settings and only
their counters move. Building a `Row` per request, the stage index and the per-row parameter
columns is Python per row and step; checking that nothing else changed is a few passes over
the requests, and a caller that promises never to change those fields of a request it passed
(``kept``: the generator's requests, one per job) saves even that: its same request objects
are checked by identity. The columns the stages derive from the rows (`RowList.memo`) are then
reused as well. When a few of those requests are gone and new ones follow the rest (jobs
ending and starting: most steps of a busy server), the list is carried over (`carry_rows`):
only the new requests are expanded, and the draws' host columns in the memo are cut and
extended rather than rebuilt.

The passes are list comprehensions and plain loops, not ``map(operator.attrgetter(...))``,
whose attribute loads CPython does not specialize. Figures: BENCHMARKS.md, "5. Host overhead".
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Iterable, Sequence
from itertools import compress, count, repeat
from operator import is_, is_not
from typing import Any

from dyngen_core.engine.record import SampleRequest
from dyngen_core.sampling.draw import carry_columns
from dyngen_core.sampling.fused import carry_host_columns
from dyngen_core.sampling.rows import RowList, expand_rows, without


class RowCache:
    """The last `RowList` of single-row, seeded requests, and what it was built from."""

    def __init__(self) -> None:
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
        rows = carry_rows(rows, dropped, requests, seeds, bounds)
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
               seeds: random.Random, bounds: BoundCounts) -> RowList:
    """The rows of ``requests``: the single-row list ``previous`` without its rows ``dropped``
    (ascending indices of the requests that ended; the others are the leading requests of
    ``requests``, in their order), then the expanded rest of ``requests`` (single-row, seeded).

    bounds: `bound_counts` of the surviving requests (those that ended already taken out);
        the new requests are added to it.
    The surviving `Row` objects move to the new list (their ``request`` index is rewritten):
    ``previous`` must not be used afterwards. Of its ``memo``, the draws' host columns are
    carried (`_carry_memo`); the stages rebuild the rest."""
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
    _carry_memo(previous, rows, dropped, start)
    return rows


def _carry_memo(previous: RowList, rows: RowList, dropped: Sequence[int], start: int) -> None:
    """Of ``previous.memo``, the draws' host columns cut and extended for ``rows``
    (`draw.carry_columns`, `fused.carry_host_columns`): their Python is most of a
    memo's rebuild. Device copies are not carried: the first draw sends them again with that
    step's keys (one copy either way). Other entries are cheap to rebuild."""
    memo = rows.memo
    for key, value in previous.memo.items():
        if not isinstance(key, tuple):
            continue
        if key[0] == "compact":
            memo[key] = carry_columns(value, previous, rows, dropped, start, key[1])
        elif key[0] == "fused-host":
            memo[key] = carry_host_columns(value, rows, dropped, start, key[1])


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
