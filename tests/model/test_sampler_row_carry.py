"""A kept `RowList` is carried over when some requests end and new ones join at the end
(`rows.carry_rows`): the carried list holds exactly what `expand_rows` builds for the new
requests, samples the same tokens as a fresh sampler, and any other change of the request list
(a reorder, an old request after a new one, drafts or no seed among the new ones) builds the
list afresh."""

from __future__ import annotations

import copy
import random

import pytest
import torch

from dyngen_core import SamplerSettings
from dyngen_core.engine.record import SampleRequest
from dyngen_core.sampling import fused
from dyngen_core.sampling.draw import _columns, _keys_and_columns, carry_memo
from dyngen_core.sampling.rows import RowCache, RowList, expand_rows
from dyngen_core.sampling.sampler import Sampler
from dyngen_core.sampling.upload import Staging

VOCAB = 512
BOUNDS = (50, 16)  # compact draw bounds: top_k 7, 20 and 30 are cut below both or one

SETTINGS = [
    SamplerSettings(temperature=0.8, top_p=0.9, top_k=50),
    SamplerSettings(temperature=1.3, top_k=7, min_p=0.05),
    SamplerSettings(temperature=1.0, top_k=400, xtc_probability=0.6, xtc_threshold=0.05),
    SamplerSettings(temperature=1.0, top_k=30, mirostat=True, mirostat_tau=3.0),
    SamplerSettings(temperature=0.7, top_k=20, token_repetition_penalty=1.3),
    SamplerSettings(temperature=0.9, top_p=0.8),
    SamplerSettings.greedy(),
    SamplerSettings(min_temp=0.5, max_temp=1.5, top_k=40),
]


def _request(rng: random.Random, settings: list[SamplerSettings], i: int) -> SampleRequest:
    return SampleRequest(settings=settings[rng.randrange(len(settings))],
                         seed=rng.getrandbits(63), counter=rng.randrange(100),
                         history=[rng.randrange(VOCAB) for _ in range(8)],
                         return_probs=i % 7 == 3, return_top_tokens=2 if i % 11 == 5 else 0,
                         return_logits=i % 13 == 6)


def _contents(rows: RowList) -> dict[str, object]:
    """Everything a `RowList` holds but its memo, with `groups` in order."""
    return {
        "rows": [(r.request, r.offset, id(r.settings), r.seed, r.counter, r.stages)
                 for r in rows],
        "groups": list(rows.groups.items()), "sampled": rows.sampled,
        "seed_keys": rows.seed_keys, "counters": rows.counters, "prob_rows": rows.prob_rows,
        "extra_requests": rows.extra_requests, "flags": (
            rows.single, rows.any_mask, rows.any_top_tokens, rows.any_logits,
            rows.top_k_bound, rows.any_early_dynamic_temperature),
    }


def _columns_contents(rows: RowList, bound: int) -> list[object]:
    """The compact draw's host columns of ``rows`` (from its memo), comparable."""
    columns = rows.memo[("compact", bound)]
    arrays = [(a.dtype.str, a.shape, a.tolist()) for a in (*columns.ints, *columns.floats)]
    return [columns.temperature, columns.cut, columns.k_max, type(columns.k_max),
            columns.tail, arrays]


def _churn(rng: random.Random, requests: list[SampleRequest],
           settings: list[SamplerSettings], serial: int) -> list[SampleRequest]:
    """``requests`` with 0-4 random ones ended and 0-4 new ones appended."""
    ended = set(rng.sample(range(len(requests)), rng.randrange(min(5, len(requests)))))
    survivors = [r for i, r in enumerate(requests) if i not in ended]
    return survivors + [_request(rng, settings, serial + j) for j in range(rng.randrange(5))]


@pytest.mark.parametrize("settings", [SETTINGS[:1], SETTINGS[:2], SETTINGS],
                         ids=["top_p", "two", "mixed"])
def test_carried_rows_hold_what_a_fresh_build_holds(settings: list[SamplerSettings]) -> None:
    rng = random.Random(len(settings))
    cache, seeds = RowCache(carry_memo), random.Random(0)
    staging = Staging(torch.device("cpu"))
    requests = [_request(rng, settings, i) for i in range(20)]
    cache.rows(requests, seeds, kept=True)
    carried = 0
    for step in range(40):
        previous = cache.rows(requests, seeds, kept=True)
        by_request = {id(q): row for q, row in zip(requests, previous, strict=True)}
        requests = _churn(rng, requests, settings, 100 * step)
        for bound in BOUNDS:  # what the compact and fused draws leave in the memo
            _keys_and_columns(previous, staging, bound)
            fused._keys_and_columns(previous, staging, bound)
        rows = cache.rows(requests, seeds, kept=True)
        # Carried: each surviving request keeps its row object.
        survived = [by_request.get(id(q)) for q in requests]
        assert all(row is None or row is mine for row, mine in zip(survived, rows))
        carried += rows is not previous and any(row is not None for row in survived)
        fresh = expand_rows(requests, random.Random(0))
        assert _contents(rows) == _contents(fresh), step
        for bound in BOUNDS if rows is not previous else ():
            # The compact draw's host columns are carried; their device copies are not.
            assert ("compact-sent", bound) not in rows.memo
            fresh.memo[("compact", bound)] = _columns(fresh, bound)
            assert _columns_contents(rows, bound) == _columns_contents(fresh, bound), step
            assert ("fused", bound) not in rows.memo
            carried_host = rows.memo[("fused-host", bound)]
            for mine, theirs in zip(carried_host, fused.host_columns(fresh, bound), strict=True):
                assert mine.dtype == theirs.dtype and mine.tolist() == theirs.tolist(), step
            # The fused draw sends the carried host columns with the keys.
            _, sent = fused._keys_and_columns(rows, staging, bound)
            assert [t.tolist() for t in sent] == [a.tolist() for a in carried_host]
        # Kept: the next call with the same objects reuses the carried list.
        assert cache.rows(requests, seeds, kept=True) is rows
    assert carried


def test_a_carried_list_reuses_the_survivors_rows_and_expands_only_the_new_requests() -> None:
    rng = random.Random(5)
    cache, seeds = RowCache(carry_memo), random.Random(0)
    requests = [_request(rng, SETTINGS, i) for i in range(8)]
    rows = cache.rows(requests, seeds, kept=True)
    survivors = [rows[i] for i in (0, 2, 3, 6, 7)]
    new = [_request(rng, SETTINGS, 50), _request(rng, SETTINGS, 51)]
    carried = cache.rows([requests[i] for i in (0, 2, 3, 6, 7)] + new, seeds, kept=True)
    assert list(carried[:5]) == survivors and all(a is b for a, b in zip(carried, survivors))
    assert [r.request for r in carried] == list(range(7))
    assert [r.seed for r in carried[5:]] == [q.seed for q in new]
    assert not carried.memo  # nothing to carry: no draw ran on the previous rows


@pytest.mark.parametrize("change", ["reorder", "old_after_new", "duplicate", "drafts",
                                    "no_seed", "all_new", "unkept"])
def test_other_changes_build_the_rows_afresh(change: str) -> None:
    rng = random.Random(7)
    cache, seeds = RowCache(carry_memo), random.Random(0)
    requests = [_request(rng, SETTINGS[:3], i) for i in range(6)]
    rows = cache.rows(requests, seeds, kept=True)
    new = _request(rng, SETTINGS[:3], 9)
    after = {
        "reorder": [requests[i] for i in (0, 2, 1, 3, 4, 5)],
        "old_after_new": requests[:3] + [new] + requests[4:],
        "duplicate": requests[:4] + [requests[1]],
        "drafts": requests[:4] + [SampleRequest(settings=SETTINGS[0], seed=3, draft_ids=[1])],
        "no_seed": requests[:4] + [SampleRequest(settings=SETTINGS[0])],
        "all_new": copy.deepcopy(requests[:4]),
        "unkept": requests[:4] + [new],
    }[change]
    olds = [(r.request, r.counter) for r in rows]
    again = cache.rows(after, seeds, kept=change != "unkept")
    assert again is not rows
    # Built afresh: the previous list's rows are neither moved nor renumbered.
    assert not any(a is b for a in again for b in rows)
    assert [(r.request, r.counter) for r in rows] == olds
    assert len(again) == len(after) + (change == "drafts")
    if change != "no_seed":  # a fresh seed each call otherwise
        fresh = expand_rows(after, random.Random(0))
        assert _contents(again) == _contents(fresh)


@pytest.mark.parametrize("settings", [SETTINGS[:1], [*SETTINGS[:2], *SETTINGS[3:5]], SETTINGS],
                         ids=["top_p", "compact_mixed", "mixed"])
def test_a_sampler_with_jobs_ending_and_joining_samples_like_a_fresh_one(
        settings: list[SamplerSettings]) -> None:
    rng = random.Random(11)
    sampler = Sampler(VOCAB)
    requests = [_request(rng, settings, i) for i in range(24)]
    for step in range(12):
        if step:
            requests = _churn(rng, requests, settings, 100 * step)
        for request in requests:
            request.counter += 1
        twins = copy.deepcopy(requests)  # separate mirostat states
        logits = torch.randn(len(requests), VOCAB,
                             generator=torch.Generator().manual_seed(step)) * 3
        ids, extras = sampler.sample_tokens(logits, requests, kept=True)
        fresh_ids, fresh_extras = Sampler(VOCAB).sample_tokens(logits, twins)
        assert ids == fresh_ids, step
        assert sorted(extras) == sorted(fresh_extras)
        for i, result in extras.items():
            fresh = fresh_extras[i]
            for name in ("token_probs", "top_k_tokens", "top_k_probs", "logits"):
                mine, theirs = getattr(result, name), getattr(fresh, name)
                assert (mine is None) == (theirs is None), name
                if mine is not None:
                    assert torch.equal(mine, theirs), name
        assert [q.state.mirostat_mu for q in requests] == [q.state.mirostat_mu for q in twins]
