"""History-dependent sampling: repetition / frequency / presence penalties and DRY against worked
examples, mirostat's state, and draft rows."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
import torch

from dyngen_core.engine.settings import DEFAULT_DRY_SEQUENCE_BREAKERS
from dyngen_core.sampling import Sampler, SampleRequest, SamplerSettings, SamplerState, edits


def edited_logits(settings: SamplerSettings, logits: torch.Tensor, history: list[int],
                  sampler: Sampler | None = None) -> np.ndarray:
    """The logits after the edit stages, read back (up to a constant) through the greedy
    distribution: greedy rows report the softmax of their edited logits."""
    vocab = logits.shape[-1]
    sampler = sampler or Sampler(vocab)
    greedy = settings.model_copy(update={"temperature": 0.0})
    req = SampleRequest(greedy, history=history, return_top_tokens=vocab)
    result = sampler.sample(logits[None], [req])[0]
    assert result.top_k_tokens is not None and result.top_k_probs is not None
    probs = np.zeros(vocab)
    probs[result.top_k_tokens[0].numpy()] = result.top_k_probs[0].numpy()
    return np.log(probs)


def assert_same_logits(actual: np.ndarray, expected: list[float]) -> None:
    """Equal up to the constant softmax removes."""
    expected_arr = np.array(expected)
    np.testing.assert_allclose(actual - actual.max(), expected_arr - expected_arr.max(),
                               atol=1e-5)


def test_repetition_frequency_and_presence_penalties() -> None:
    logits = torch.tensor([1.0, 2.0, -1.0, 0.5, -0.5, 3.0, 0.0, 1.5])
    settings = SamplerSettings(token_repetition_penalty=1.5, token_frequency_penalty=0.2,
                               token_presence_penalty=0.3)
    # history holds 3 twice, 5 once, 4 once (a negative logit: multiplied)
    expected = [1.0, 2.0, -1.0, 0.5 / 1.5 - 0.3 - 0.4, -0.5 * 1.5 - 0.3 - 0.2,
                3.0 / 1.5 - 0.3 - 0.2, 0.0, 1.5]
    assert_same_logits(edited_logits(settings, logits, [3, 5, 3, 4]), expected)


def test_penalty_range_and_decay_follow_exllamav2() -> None:
    logits = torch.ones(16)
    settings = SamplerSettings(token_repetition_penalty=2.0, token_repetition_range=2,
                               token_repetition_decay=2, token_frequency_penalty=0.4)
    # backward offsets: 14 -> 0, 13 -> 1, 12 -> 2 (full), 11 -> 3 (half-faded), 10 -> outside
    expected = [1.0] * 16
    for token in (14, 13, 12):
        expected[token] = 1.0 / 2.0 - 0.4
    expected[11] = 1.0 / 1.5 - 0.2
    assert_same_logits(edited_logits(settings, logits, [10, 11, 12, 13, 14]), expected)


def test_most_recent_occurrence_sets_the_penalty() -> None:
    logits = torch.ones(8)
    settings = SamplerSettings(token_repetition_penalty=2.0, token_repetition_range=1,
                               token_repetition_decay=4)
    # token 5 is at offsets 0 and 4: the newest (full penalty) wins
    expected = [1.0] * 8
    expected[5] = 0.5
    expected[2] = 1.0 / (2.0 - 1.0 * 2 / 4)  # offset 3: faded by (3 - 1) / 4
    expected[3] = 1.0 / (2.0 - 1.0 * 1 / 4)  # offset 2
    expected[4] = 0.5                         # offset 1: within range + first fade step (0)
    assert_same_logits(edited_logits(settings, logits, [5, 2, 3, 4, 5]), expected)


def dry_settings(**overrides: Any) -> SamplerSettings:
    return SamplerSettings(**{"dry_multiplier": 0.8, "dry_base": 1.75,
                              "dry_allowed_length": 2, "dry_sequence_breakers": (99,),
                              **overrides})


HISTORY = [1, 2, 3, 4, 9, 2, 3, 5, 7, 1, 2, 3]  # ends "1 2 3": followed by 4 after "1 2 3",
                                               # and by 5 after "9 2 3" (match "2 3")


def dry_penalties(history: list[int], breakers: np.ndarray,
                  settings: SamplerSettings) -> tuple[np.ndarray, np.ndarray]:
    """The batched DRY edit on one zero row, read back as (tokens, penalties)."""
    x = torch.zeros(1, len(breakers))
    tables = torch.from_numpy(breakers)[None]
    edits.apply_dry(x, [history], [settings], tables, torch.zeros(1, dtype=torch.int64))
    tokens = np.flatnonzero(x[0].numpy())
    return tokens, -x[0].numpy()[tokens].astype(np.float64)


def test_dry_worked_example() -> None:
    breakers = np.zeros(16, dtype=bool)
    tokens, penalties = dry_penalties(HISTORY, breakers, dry_settings())
    assert dict(zip(tokens.tolist(), penalties.tolist(), strict=True)) == pytest.approx(
        {4: 0.8 * 1.75, 5: 0.8})
    tokens, penalties = dry_penalties(HISTORY, breakers, dry_settings(dry_allowed_length=3))
    assert dict(zip(tokens.tolist(), penalties.tolist(), strict=True)) == pytest.approx({4: 0.8})
    tokens, _ = dry_penalties(HISTORY, breakers, dry_settings(dry_max_ngram=2))
    assert tokens.tolist() == [4, 5]
    tokens, penalties = dry_penalties(HISTORY, breakers, dry_settings(dry_range=6))
    assert dict(zip(tokens.tolist(), penalties.tolist(), strict=True)) == {}


def test_dry_sequence_breakers_stop_matches() -> None:
    breakers = np.zeros(16, dtype=bool)
    breakers[2] = True  # the match "1 2 3" / "2 3" must cross token 2
    tokens, _ = dry_penalties(HISTORY, breakers, dry_settings())
    assert tokens.tolist() == []
    breakers[:] = False
    breakers[5] = True  # a breaker is never penalized as a follower
    tokens, _ = dry_penalties(HISTORY, breakers, dry_settings())
    assert tokens.tolist() == [4]


def test_dry_in_the_sampler_with_string_breakers() -> None:
    pieces = [f"t{i}" for i in range(16)]
    sampler = Sampler(16, token_pieces=pieces)
    logits = torch.zeros(16)
    expected = [0.0] * 16
    expected[4], expected[5] = -0.8 * 1.75, -0.8
    settings = SamplerSettings(dry_multiplier=0.8)  # default string breakers
    assert settings.dry_sequence_breakers == DEFAULT_DRY_SEQUENCE_BREAKERS
    assert_same_logits(edited_logits(settings, logits, HISTORY, sampler), expected)
    pieces[2] = "\n"
    newline_breaks = Sampler(16, token_pieces=pieces)
    assert_same_logits(edited_logits(settings, logits, HISTORY, newline_breaks), [0.0] * 16)
    with pytest.raises(ValueError, match="token_pieces"):
        edited_logits(settings, logits, HISTORY, Sampler(16))


def test_mirostat_truncates_by_mu_and_updates_the_jobs_state() -> None:
    probs = [0.01, 0.04, 0.05, 0.10, 0.12, 0.18, 0.22, 0.28]
    logits = torch.tensor(probs).log()
    settings = SamplerSettings(mirostat=True, mirostat_tau=1.5, mirostat_eta=0.2)
    state = SamplerState()
    sampler = Sampler(8)
    req = SampleRequest(settings, seed=9, state=state, return_probs=True, return_top_tokens=8)
    result = sampler.sample(logits[None], [req])[0]
    assert result.token_id in (5, 6, 7)  # mu = 3: keep p >= 1/8
    assert result.top_k_probs is not None and result.token_probs is not None
    assert float(result.top_k_probs[0, 3]) == 0.0
    chosen = probs[result.token_id] / 0.68
    assert float(result.token_probs[0]) == pytest.approx(chosen, abs=1e-6)
    assert state.mirostat_mu == pytest.approx(3.0 - 0.2 * (-math.log2(chosen) - 1.5), abs=1e-5)
    state.mirostat_mu = 10.0  # 2 ** -10 < 0.01: nothing is cut
    wide = sampler.sample(logits[None], [SampleRequest(settings, seed=9, state=state,
                                                        return_top_tokens=8)])[0]
    assert wide.top_k_probs is not None and float(wide.top_k_probs[0, -1]) > 0.0


def test_draft_rows_extend_history_and_counter() -> None:
    generator = torch.Generator().manual_seed(3)
    logits = torch.randn(3, 32, generator=generator)
    settings = SamplerSettings(token_repetition_penalty=3.0, temperature=0.8)
    sampler = Sampler(32)
    history = [1, 2, 3]
    drafted = sampler.sample(logits, [SampleRequest(settings, seed=4, counter=10,
                                                    history=history, draft_ids=[7, 8],
                                                    return_top_tokens=32)])[0]
    assert len(drafted.token_ids) == 3
    assert drafted.top_k_probs is not None and drafted.top_k_probs.shape == (3, 32)
    for row in range(3):
        single = sampler.sample(logits[row: row + 1], [SampleRequest(
            settings, seed=4, counter=10 + row, history=history + [7, 8][:row],
            return_top_tokens=32)])[0]
        assert single.token_ids[0] == drafted.token_ids[row]
        assert single.top_k_probs is not None
        assert torch.allclose(single.top_k_probs[0], drafted.top_k_probs[row])
