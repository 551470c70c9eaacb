"""The sampler keeps a call's rows (and the columns derived from them) for the next call while
the requests keep their settings (`RowCache`): a sampler stepping the same requests gives the
tokens, probabilities and mirostat states of a fresh sampler at every step, and the rows are
rebuilt whenever anything but the counters and masks changed."""

from __future__ import annotations

import copy
import random

import numpy as np
import pytest
import torch

from dyngen_core import SamplerSettings
from dyngen_core.engine.record import SampleRequest
from dyngen_core.sampling.draw import carry_memo
from dyngen_core.sampling.rows import RowCache
from dyngen_core.sampling.sampler import Sampler

VOCAB = 512

SETTINGS = [
    SamplerSettings(temperature=0.8, top_p=0.9, top_k=50),
    SamplerSettings(temperature=1.3, top_k=7, min_p=0.05),
    SamplerSettings(temperature=1.0, top_k=40, xtc_probability=0.6, xtc_threshold=0.05),
    SamplerSettings(temperature=1.0, top_k=30, mirostat=True, mirostat_tau=3.0),
    SamplerSettings(temperature=0.7, top_k=20, token_repetition_penalty=1.3),
    SamplerSettings(temperature=0.9, top_p=0.8),
    SamplerSettings.greedy(),
]


def _requests(settings: list[SamplerSettings], n: int, seed: int) -> list[SampleRequest]:
    rng = random.Random(seed)
    return [SampleRequest(settings=settings[i % len(settings)], seed=rng.getrandbits(63),
                          history=[rng.randrange(VOCAB) for _ in range(8)],
                          return_probs=i % 5 == 0) for i in range(n)]


def _mask(rng: random.Random) -> np.ndarray:
    mask = np.full(VOCAB // 32, -1, dtype=np.int32)
    mask[: rng.randrange(1, VOCAB // 64)] = 0
    return mask


@pytest.mark.parametrize("promise", [False, True], ids=["checked", "kept"])
@pytest.mark.parametrize("settings", [SETTINGS[:1], SETTINGS[:4], SETTINGS],
                         ids=["top_p", "top_k_only", "mixed"])
def test_kept_rows_sample_like_a_fresh_sampler_every_step(settings: list[SamplerSettings],
                                                          promise: bool) -> None:
    sampler = Sampler(VOCAB)
    requests = _requests(settings, 24, seed=len(settings))
    twins = copy.deepcopy(requests)  # separate mirostat states
    rng = random.Random(0)
    for step in range(6):
        logits = torch.randn(24, VOCAB, generator=torch.Generator().manual_seed(step)) * 3
        masked = {rng.randrange(24) for _ in range(3)} if step in (2, 3) else set()
        for i, (request, twin) in enumerate(zip(requests, twins, strict=True)):
            request.counter = twin.counter = 10 * step + i
            request.allowed_tokens = twin.allowed_tokens = _mask(rng) if i in masked else None
        ids, extras = sampler.sample_tokens(logits, requests, kept=promise)
        fresh_ids, fresh_extras = Sampler(VOCAB).sample_tokens(logits, twins)
        assert ids == fresh_ids, step
        assert sorted(extras) == sorted(fresh_extras)
        for i, result in extras.items():
            probs, fresh_probs = result.token_probs, fresh_extras[i].token_probs
            assert probs is not None and fresh_probs is not None
            assert torch.equal(probs, fresh_probs)
        assert [q.state.mirostat_mu for q in requests] == [q.state.mirostat_mu for q in twins]


def test_same_settings_reuse_the_rows_and_refresh_counters_and_masks() -> None:
    cache, seeds = RowCache(carry_memo), random.Random(0)
    requests = _requests(SETTINGS[:3], 6, seed=1)
    rows = cache.rows(requests, seeds)
    rows.memo["probe"] = 1
    for i, request in enumerate(requests):
        request.counter = 100 + i
    requests[2].allowed_tokens = _mask(random.Random(1))
    again = cache.rows(requests, seeds)
    assert again is rows and again.memo == {"probe": 1}
    assert [r.counter for r in again] == [100 + i for i in range(6)]
    assert again.counters == [100 + i for i in again.sampled]
    assert again.any_mask
    requests[2].allowed_tokens = None
    assert not cache.rows(requests, seeds).any_mask
    # New request objects with the same settings and seeds describe the same rows.
    assert cache.rows(copy.copy(requests), seeds) is rows


def test_kept_promise_reuses_the_same_request_objects_without_reading_their_settings() -> None:
    cache, seeds = RowCache(carry_memo), random.Random(0)
    requests = _requests(SETTINGS[:3], 6, seed=1)
    rows = cache.rows(requests, seeds, kept=True)
    for i, request in enumerate(requests):
        request.counter = 50 + i
    requests[1].allowed_tokens = _mask(random.Random(2))
    # Breaking the promise shows the fields are not read: only counters and masks are.
    requests[0].settings = SETTINGS[4]
    again = cache.rows(requests, seeds, kept=True)
    assert again is rows and again.any_mask
    assert [r.counter for r in again] == [50 + i for i in range(6)]
    assert again.counters == [50 + i for i in again.sampled]
    # Without the promise, or with other objects, the fields are compared again.
    assert cache.rows(requests, seeds) is not rows
    fresh = cache.rows(requests, seeds, kept=True)
    assert fresh is not rows and fresh[0].settings is SETTINGS[4]
    others = copy.copy(requests)
    others[3] = copy.copy(others[3])
    others[3].seed = (others[3].seed or 0) + 1
    assert cache.rows(others, seeds, kept=True) is not fresh
    assert cache.rows(requests[:5], seeds, kept=True) is not fresh


@pytest.mark.parametrize("change", ["settings", "equal_settings", "seed", "return_probs",
                                    "top_tokens", "logits", "drafts", "count"])
def test_anything_but_counters_and_masks_rebuilds_the_rows(change: str) -> None:
    cache, seeds = RowCache(carry_memo), random.Random(0)
    requests = _requests(SETTINGS[:3], 6, seed=2)
    rows = cache.rows(requests, seeds)
    target = requests[3]
    if change == "settings":
        target.settings = SETTINGS[4]
    elif change == "equal_settings":  # an equal copy: the same rows may be kept
        target.settings = target.settings.model_copy()
    elif change == "seed":
        target.seed = (target.seed or 0) + 1
    elif change == "return_probs":
        target.return_probs = not target.return_probs
    elif change == "top_tokens":
        target.return_top_tokens = 3
    elif change == "logits":
        target.return_logits = True
    elif change == "drafts":
        target.draft_ids = [5]
    else:
        requests = requests[:5]
    again = cache.rows(requests, seeds)
    assert (again is rows) == (change == "equal_settings")
    if change == "drafts":
        assert len(again) == 7 and not again.single


def test_requests_without_a_seed_are_never_kept() -> None:
    cache, seeds = RowCache(carry_memo), random.Random(0)
    requests = [SampleRequest(settings=SETTINGS[0], seed=None) for _ in range(3)]
    first = cache.rows(requests, seeds)
    second = cache.rows(requests, seeds)
    assert second is not first
    assert [r.seed for r in first] != [r.seed for r in second]  # a fresh seed per call


def test_a_kept_list_is_dropped_after_rows_that_cannot_be_kept() -> None:
    cache, seeds = RowCache(carry_memo), random.Random(0)
    requests = _requests(SETTINGS[:2], 4, seed=3)
    rows = cache.rows(requests, seeds)
    with_drafts = copy.copy(requests)
    with_drafts[0] = SampleRequest(settings=SETTINGS[0], seed=1, draft_ids=[2, 3])
    cache.rows(with_drafts, seeds)
    assert cache.rows(requests, seeds) is not rows
