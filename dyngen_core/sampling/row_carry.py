"""`carry_rows`: a kept `RowList` turned into the rows of the same requests minus some that
ended, plus new ones appended, without expanding the surviving requests again.

Why: on a busy server a job ends or starts in most steps. The generator's requests keep their
order (ended jobs drop out, new jobs join at the end), so all but a few requests are the ones
the last step expanded. Renumbering their rows and filtering the per-stage index lists costs a
few comprehensions; expanding them again (`expand_rows`) costs about 1.5 us of Python per
request. The result is the list `expand_rows` would build for the new requests, field for
field (the caller refreshes counters and masks as for a kept list).
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Iterable, Sequence

from dyngen_core.engine.record import SampleRequest
from dyngen_core.sampling.compact import carry_columns
from dyngen_core.sampling.fused import carry_host_columns
from dyngen_core.sampling.rows import RowList, expand_rows, without

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
    (`compact.carry_columns`, `fused.carry_host_columns`): their Python is most of a
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
