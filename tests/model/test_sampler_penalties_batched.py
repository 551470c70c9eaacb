"""The batched (device) penalties and DRY against a per-row reference: many rows with different
histories, windows and settings in one call must equal running each row alone with the plain
algorithm (numpy, one row at a time, as `edits.apply_penalties` and `edits.apply_dry` describe
it)."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from dyngen_core.engine.settings import SamplerSettings
from dyngen_core.sampling import edits

VOCAB = 24


def reference_penalties(x: np.ndarray, history: list[int], s: SamplerSettings) -> np.ndarray:
    window = edits.penalty_window(s)
    ids = history if window is None else history[max(len(history) - window, 0):]
    sustain = s.token_repetition_range if s.token_repetition_range > 0 else np.inf
    per_step = 1.0 / s.token_repetition_decay if s.token_repetition_decay else 0.0

    def faded(offset: float) -> float:
        return float(np.clip(max(offset - sustain, 0.0) * per_step, 0.0, 1.0))

    out = x.copy()
    newest: dict[int, int] = {}
    frequency: dict[int, float] = {}
    for j, token in enumerate(reversed(ids)):
        newest.setdefault(token, j)
        frequency[token] = frequency.get(token, 0.0) + s.token_frequency_penalty * (1 - faded(j))
    for token, j in newest.items():
        rep = s.token_repetition_penalty + (1 - s.token_repetition_penalty) * faded(j)
        value = out[token] / rep if out[token] > 0 else out[token] * rep
        out[token] = value - s.token_presence_penalty * (1 - faded(j)) - frequency[token]
    return out


def reference_dry(x: np.ndarray, history: list[int], breakers: set[int],
                  s: SamplerSettings) -> np.ndarray:
    h = history[-s.dry_range:] if s.dry_range else history
    out = x.copy()
    n = len(h)
    if n < 2 or h[-1] in breakers:
        return out
    longest: dict[int, int] = {}
    for i in range(n - 1):
        if h[i] != h[-1] or h[i + 1] in breakers:
            continue
        length = 1
        for k in range(1, min(s.dry_max_ngram, n - 1)):
            if h[n - 1 - k] in breakers or i - k < 0 or h[i - k] != h[n - 1 - k]:
                break
            length += 1
        longest[h[i + 1]] = max(longest.get(h[i + 1], 0), length)
    for token, length in longest.items():
        if length >= s.dry_allowed_length:
            out[token] -= s.dry_multiplier * s.dry_base ** (length - s.dry_allowed_length)
    return out


def random_history(rng: random.Random) -> list[int]:
    """Short repetitive histories over a small alphabet, so matches and repeats are common."""
    alphabet = rng.randrange(3, 8)
    pattern = [rng.randrange(alphabet) for _ in range(rng.randrange(1, 6))]
    length = rng.randrange(0, 100)
    return [t if rng.random() > 0.2 else rng.randrange(VOCAB)
            for t in (pattern * 20)[:length]]


def random_penalty_settings(rng: random.Random) -> SamplerSettings:
    return SamplerSettings(
        token_repetition_penalty=rng.choice([1.0, 1.3, 2.0]),
        token_frequency_penalty=rng.choice([0.0, 0.25]),
        token_presence_penalty=rng.choice([0.0, 0.5]),
        token_repetition_range=rng.choice([-1, 1, 3, 10]),
        token_repetition_decay=rng.choice([0, 4]))


def random_dry_settings(rng: random.Random) -> SamplerSettings:
    return SamplerSettings(
        dry_multiplier=0.8, dry_base=rng.choice([1.5, 1.75]),
        dry_allowed_length=rng.choice([1, 2, 3]), dry_range=rng.choice([0, 8, 30, 90]),
        dry_max_ngram=rng.choice([2, 4, 20, 50]), dry_sequence_breakers=(0,))


def devices() -> list[str]:
    return ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("seed", range(4))
def test_batched_penalties_equal_the_per_row_reference(device: str, seed: int) -> None:
    rng = random.Random(seed)
    rows = 16
    logits = np.random.default_rng(seed).normal(size=(rows, VOCAB)).astype(np.float32)
    histories = [random_history(rng) for _ in range(rows)]
    settings = [random_penalty_settings(rng) for _ in range(rows)]
    x = torch.from_numpy(logits.copy()).to(device)
    edits.apply_penalties(x, histories, settings)
    expected = np.stack([reference_penalties(logits[i], histories[i], settings[i])
                         for i in range(rows)])
    np.testing.assert_allclose(x.cpu().numpy(), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("seed", range(4))
def test_batched_dry_equals_the_per_row_reference(device: str, seed: int) -> None:
    rng = random.Random(100 + seed)
    rows = 16
    logits = np.random.default_rng(seed).normal(size=(rows, VOCAB)).astype(np.float32)
    histories = [random_history(rng) for _ in range(rows)]
    settings = [random_dry_settings(rng) for _ in range(rows)]
    breaker_sets = [{0}, {0, 1}]
    which = [rng.randrange(2) for _ in range(rows)]
    tables = torch.zeros(2, VOCAB, dtype=torch.bool)
    for t, ids in enumerate(breaker_sets):
        tables[t, sorted(ids)] = True
    x = torch.from_numpy(logits.copy()).to(device)
    edits.apply_dry(x, histories, settings, tables.to(device),
                        torch.tensor(which, device=device))
    expected = np.stack([reference_dry(logits[i], histories[i], breaker_sets[which[i]],
                                       settings[i]) for i in range(rows)])
    np.testing.assert_allclose(x.cpu().numpy(), expected, rtol=1e-5, atol=1e-5)
    assert any(not np.allclose(expected[i], logits[i]) for i in range(rows))


def test_out_of_vocab_history_ids_are_ignored_and_count_as_breakers() -> None:
    x = torch.zeros(1, 8)
    settings = SamplerSettings(token_presence_penalty=1.0)
    edits.apply_penalties(x, [[3, 50, -1 + 8, 3]], [settings])
    assert x[0].tolist() == [0, 0, 0, -1, 0, 0, 0, -1]
    dry = SamplerSettings(dry_multiplier=1.0, dry_allowed_length=1, dry_sequence_breakers=(0,))
    x = torch.zeros(1, 8)
    tables = torch.zeros(1, 8, dtype=torch.bool)
    edits.apply_dry(x, [[2, 50, 2, 5, 2]], [dry], tables, torch.zeros(1, dtype=torch.int64))
    assert x[0].tolist() == [0, 0, 0, 0, 0, -1.0, 0, 0]  # 50 is no follower: a breaker
