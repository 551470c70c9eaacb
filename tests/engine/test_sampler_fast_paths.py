"""The sampler's per-step shortcuts give exactly what the per-row reference computations give.

- `row_keys` (numpy, all rows at once) equals `row_key` (exact Python integers) row by row.
- `RowList`'s stage index answers `rows_using` as a scan of the rows does.
- `Sampler.sample_tokens` (no result object per request) equals `Sampler.sample`, including
  probabilities, top tokens, logits, masks and mirostat state updates.
- `Sampler.launch_tokens` leaves `sample_tokens`'s ids on the device (-1 for rows without an
  allowed token), and declines requests that need more than their token back.
"""

from __future__ import annotations

import copy
import random
from typing import Any

import numpy as np
import pytest
import torch

from dyngen_core import SamplerSettings
from dyngen_core.engine.record import SampleRequest
from dyngen_core.engine.settings import STAGE_ORDER
from dyngen_core.sampling.rng import row_key, row_keys, seed_key
from dyngen_core.sampling.rows import RowList, expand_rows, rows_using
from dyngen_core.sampling.sampler import Sampler

VOCAB = 96


def test_row_keys_equal_row_key() -> None:
    rng = random.Random(0)
    seeds = [rng.getrandbits(64) for _ in range(200)] + [0, 1, -1, -(2**63), 2**63, 2**64 - 1]
    counters = [rng.randrange(2**40) for _ in seeds[:-3]] + [0, 1, 2**62]
    keys = row_keys([seed_key(s) for s in seeds], counters)
    assert keys.dtype == np.int64 and keys.shape == (len(seeds), 2)
    assert [tuple(k) for k in keys.tolist()] == [row_key(s, c) for s, c in zip(seeds, counters)]


def _settings() -> list[SamplerSettings]:
    return [
        SamplerSettings.greedy(),
        SamplerSettings(temperature=0.8, top_p=0.9, top_k=50),
        SamplerSettings(temperature=1.3, top_k=5, min_p=0.05),
        SamplerSettings(temperature=0.7, token_repetition_penalty=1.2),
        SamplerSettings(temperature=0.9, top_p=0.8, temperature_last=True),
        SamplerSettings(temperature=1.0, mirostat=True, mirostat_tau=3.0),
        SamplerSettings(temperature=0.0, token_bias={3: 2.0}),
        SamplerSettings(temperature=1.0, min_temp=0.5, max_temp=1.5),
        SamplerSettings(temperature=0.6, typical=0.9, top_k=40),
    ]


def _requests(seed: int, n: int = 24, *, drafts: bool = False) -> list[SampleRequest]:
    rng = random.Random(seed)
    pool = _settings()
    out = []
    for i in range(n):
        settings = rng.choice(pool)
        mask = None
        if rng.random() < 0.2:
            mask = np.full(VOCAB // 32, -1, dtype=np.int32)
            mask[0] = 0x0F0F0F0F
        out.append(SampleRequest(
            settings=settings, seed=rng.getrandbits(63), counter=rng.randrange(100),
            history=[rng.randrange(VOCAB) for _ in range(rng.randrange(1, 12))],
            allowed_tokens=mask, return_probs=rng.random() < 0.3,
            return_top_tokens=rng.choice([0, 0, 3]), return_logits=rng.random() < 0.15,
            draft_ids=[rng.randrange(VOCAB)] if drafts and not settings.mirostat
            and mask is None and i % 3 == 0 else (),
        ))
    return out


@pytest.mark.parametrize("seed", range(3))
def test_stage_index_answers_like_a_scan(seed: int) -> None:
    rows = expand_rows(_requests(seed, drafts=True), random.Random(0))
    assert isinstance(rows, RowList) and not rows.single
    plain = list(rows)
    for stage in STAGE_ORDER:
        assert rows_using(rows, stage) == rows_using(plain, stage)
    assert rows.sampled == [i for i, r in enumerate(rows) if not r.settings.is_greedy]
    assert rows.counters == [rows[i].counter for i in rows.sampled]


@pytest.mark.parametrize("seed", range(4))
def test_sample_tokens_equals_sample(seed: int) -> None:
    sampler = Sampler(VOCAB)
    logits = torch.randn(24, VOCAB + 4, generator=torch.Generator().manual_seed(seed))
    general = _requests(seed)
    fast = copy.deepcopy(general)  # separate mirostat states
    expected = sampler.sample(logits, general)
    ids, full = sampler.sample_tokens(logits, fast)
    assert ids == [r.token_ids[0] for r in expected]
    wants = [i for i, q in enumerate(general)
             if q.return_probs or q.return_top_tokens or q.return_logits]
    assert sorted(full) == wants
    for i in wants:
        for name in ("token_probs", "top_k_tokens", "top_k_probs", "logits"):
            a, b = getattr(full[i], name), getattr(expected[i], name)
            assert (a is None) == (b is None)
            if a is not None:
                assert torch.equal(a, b)
    assert [q.state.mirostat_mu for q in fast] == [q.state.mirostat_mu for q in general]
    assert any(q.state.mirostat_mu is not None for q in fast)


def test_sample_tokens_refuses_drafts() -> None:
    requests = [SampleRequest(settings=SamplerSettings.greedy(), draft_ids=[1])]
    with pytest.raises(ValueError, match="one row per request"):
        Sampler(VOCAB).sample_tokens(torch.zeros(2, VOCAB), requests)


def _top_k_settings() -> list[SamplerSettings]:
    return [
        SamplerSettings(temperature=0.8, top_p=0.9, top_k=50),
        SamplerSettings(temperature=1.3, top_k=7, min_p=0.05),
        SamplerSettings(temperature=0.7, top_k=20, token_repetition_penalty=1.3),
        SamplerSettings(temperature=0.9, top_p=0.8, top_k=30, temperature_last=True),
        SamplerSettings(temperature=1.0, top_k=40, mirostat=True, mirostat_tau=3.0),
        SamplerSettings(temperature=1.1, top_k=25, typical=0.9, tfs=0.95, top_a=0.1),
        SamplerSettings(temperature=1.0, top_k=50, xtc_probability=0.7, xtc_threshold=0.05),
        SamplerSettings(temperature=0.9, top_k=12, token_bias={5: 3.0}, banned_tokens=[7]),
        SamplerSettings(temperature=0.5, top_k=50, min_temp=0.5, max_temp=1.5,
                        temperature_last=True),
    ]


def _top_k_requests(seed: int, n: int, vocab: int, *, masks: bool) -> list[SampleRequest]:
    rng = random.Random(seed)
    pool = _top_k_settings()
    out = []
    for _ in range(n):
        mask = None
        if masks and rng.random() < 0.3:
            mask = np.full(vocab // 32, -1, dtype=np.int32)
            mask[: vocab // 64] = 0  # the first half of the vocabulary is forbidden
        out.append(SampleRequest(
            settings=rng.choice(pool), seed=rng.getrandbits(63), counter=rng.randrange(100),
            history=[rng.randrange(vocab) for _ in range(rng.randrange(1, 12))],
            allowed_tokens=mask, return_probs=rng.random() < 0.3,
            return_top_tokens=rng.choice([0, 0, 3]), return_logits=rng.random() < 0.1))
    return out


@pytest.mark.parametrize(("seed", "masks", "extra_columns"),
                         [(0, False, 0), (1, True, 0), (2, False, 13), (3, True, 13)])
def test_compact_draw_equals_the_full_width_path(monkeypatch: pytest.MonkeyPatch, seed: int,
                                                 masks: bool, extra_columns: int) -> None:
    """Every row sampled with a top_k: the compact draw (one top-k, stages on [rows, k]) picks
    what the full-width stages pick, with the same probabilities and mirostat updates."""
    from dyngen_core.sampling import sampler as sampler_module

    vocab = 1024
    sampler = Sampler(vocab)
    logits = torch.randn(40, vocab + extra_columns,
                         generator=torch.Generator().manual_seed(seed)) * 3
    compact = _top_k_requests(seed, 40, vocab, masks=masks)
    full = copy.deepcopy(compact)
    calls = []
    draw_compact = sampler_module.draw_compact

    def counted(*args: object) -> object:
        calls.append(1)
        return draw_compact(*args)  # type: ignore[arg-type]

    with monkeypatch.context() as patch:
        patch.setattr(sampler_module, "draw_compact", counted)
        ids, results = sampler.sample_tokens(logits, compact)
        listed = sampler.sample(logits, copy.deepcopy(full))
    assert len(calls) == 2
    with monkeypatch.context() as patch:
        patch.setattr(sampler_module, "compact_bound", lambda *args: 0)
        expected_ids, expected = sampler.sample_tokens(logits, full)
    assert ids == expected_ids == [r.token_ids[0] for r in listed]
    assert sorted(results) == sorted(expected)
    for i, result in results.items():
        for name in ("token_probs", "top_k_tokens", "top_k_probs", "logits"):
            a, b = getattr(result, name), getattr(expected[i], name)
            assert (a is None) == (b is None)
            if a is not None:
                assert torch.equal(a, b), (i, name)
    assert [q.state.mirostat_mu for q in compact] == [q.state.mirostat_mu for q in full]


def test_compact_draw_is_skipped_when_a_row_needs_the_whole_vocabulary() -> None:
    from dyngen_core.sampling.draw import compact_bound

    def bound(settings: list[SamplerSettings], width: int = 1024) -> int:
        rows = expand_rows([SampleRequest(settings=s, seed=1) for s in settings],
                           random.Random(0))
        return compact_bound(rows, width, 1024)

    top_p = SamplerSettings(temperature=0.8, top_p=0.9, top_k=50)
    assert bound([top_p]) == 50
    assert bound([top_p, SamplerSettings.greedy()]) == 0
    assert bound([top_p, SamplerSettings(temperature=0.8, top_p=0.9)]) == 0  # no top_k
    assert bound([SamplerSettings(temperature=1.0, top_k=50, min_temp=0.5, max_temp=1.5)]) == 0
    assert bound([top_p], width=150) == 0  # 50 is not much below 150


@pytest.mark.parametrize("seed", range(3))
def test_launch_tokens_are_the_sample_tokens_left_on_the_device(seed: int) -> None:
    """Greedy, full-width and compact draws: the ids `launch_tokens` leaves on the device are
    `sample_tokens`'s, with -1 where sample_tokens reports a row without an allowed token."""
    sampler = Sampler(1024)
    logits = torch.randn(40, 1024, generator=torch.Generator().manual_seed(seed)) * 3
    pools = {0: _settings(), 1: _top_k_settings()[:3], 2: _top_k_settings()[:1]}
    rng = random.Random(seed)
    requests = [SampleRequest(settings=rng.choice(pools[seed]), seed=rng.getrandbits(63),
                              counter=rng.randrange(100), history=[1, 2, 3])
                for _ in range(40)]
    requests = [r for r in requests if not r.settings.mirostat]
    logits = logits[: len(requests)]
    launched = sampler.launch_tokens(logits, requests)
    assert launched is not None and launched.dtype == torch.int64
    ids, extras = sampler.sample_tokens(logits, copy.deepcopy(requests))
    assert launched.tolist() == ids and not extras
    logits[3] = float("-inf")
    launched = sampler.launch_tokens(logits, requests)
    assert launched is not None and launched[3] == -1
    assert launched[:3].tolist() == ids[:3]


@pytest.mark.parametrize("extra", ["probs", "top_tokens", "logits", "mirostat", "drafts"])
def test_launch_tokens_declines_requests_that_need_more_than_a_token(extra: str) -> None:
    requests = [SampleRequest(settings=SamplerSettings(temperature=0.8, top_k=50), seed=i)
                for i in range(4)]
    target = requests[2]
    if extra == "probs":
        target.return_probs = True
    elif extra == "top_tokens":
        target.return_top_tokens = 2
    elif extra == "logits":
        target.return_logits = True
    elif extra == "mirostat":
        target.settings = SamplerSettings(temperature=1.0, mirostat=True)
    else:
        target.draft_ids = [1]
    assert Sampler(VOCAB).launch_tokens(torch.randn(4, VOCAB), requests) is None


def test_a_launched_step_gives_the_tokens_a_host_step_gives(make_generator: Any) -> None:
    """`StepSampler.start` with ``overlap`` draws on the device what it draws on the host for
    the same jobs and counters, and samples on the host a batch holding a job with banned
    strings."""
    from dyngen_core import Job

    generator = make_generator()
    settings = [SamplerSettings(temperature=0.8, top_p=0.9, top_k=50),
                SamplerSettings(temperature=0.7, token_repetition_penalty=1.2)]
    generator.enqueue([Job(input_ids=[5 + i, 6, 7], max_new_tokens=8, seed=i,
                           gen_settings=settings[i % 2]) for i in range(6)])
    generator.iterate()
    sampler, records = generator._sampler, list(generator._records.values())
    vocab = sampler.vocab_size
    logits = torch.randn(len(records), vocab, generator=torch.Generator().manual_seed(0)) * 3
    launched = sampler.start(logits, records, overlap=True)
    assert launched.ids is not None
    assert launched.tokens() == sampler.start(logits, records).tokens()
    generator.enqueue(Job(input_ids=[9, 9, 9], max_new_tokens=8, banned_strings=["xyz"]))
    generator.iterate()
    records = list(generator._records.values())
    assert sampler.start(torch.zeros(len(records), vocab), records, overlap=True).ids is None


@pytest.mark.parametrize("seed", range(3))
def test_temperature_rows_split_mixed_rows_as_each_row_alone(seed: int) -> None:
    """Runs of shared settings objects, equal copies and dynamic rows: each row lands where
    its own settings put it (`temperature_rows` reads each settings object once)."""
    from dyngen_core.sampling.shaping import temperature_rows

    rng = random.Random(seed)
    pool = _settings()
    settings = []
    for _ in range(40):
        pick = rng.choice(pool)
        settings.extend([pick if rng.random() < 0.7 else pick.model_copy()] * rng.randint(1, 3))
    rows = expand_rows([SampleRequest(settings=s, seed=i) for i, s in enumerate(settings)],
                       random.Random(0))
    for name in ("temperature", "temperature_last"):
        split = temperature_rows(rows, name)
        used = [i for i, r in enumerate(rows) if name in r.stages]
        assert split.dynamic == [i for i in used if rows[i].settings.uses_dynamic_temperature]
        assert split.fixed == [i for i in used if not rows[i].settings.uses_dynamic_temperature]
        assert split.temps == [rows[i].settings.temperature for i in split.fixed]
