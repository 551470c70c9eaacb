"""The sampler's distribution stages against hand computations, and its draws.

Deterministic stages are read back exactly: ``return_top_tokens=V`` returns the final
(filtered, renormalized) distribution the token is drawn from. Sampled behaviour is checked with
chi-square tests over 2000 rows drawn in one batched call with fixed seeds.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest
import torch

from dyngen_core.sampling import Sampler, SampleRequest, SamplerSettings, SamplingError

P = [0.01, 0.04, 0.05, 0.10, 0.12, 0.18, 0.22, 0.28]
V = len(P)
LOGITS = torch.tensor(P, dtype=torch.float64).log().to(torch.float32)


def final_distribution(settings: SamplerSettings, sampler: Sampler | None = None,
                       logits: torch.Tensor = LOGITS, **request: Any) -> np.ndarray:
    """The distribution one request's token is drawn from, in vocab order."""
    sampler = sampler or Sampler(V)
    req = SampleRequest(settings, seed=1, return_top_tokens=logits.shape[-1], **request)
    result = sampler.sample(logits[None], [req])[0]
    assert result.top_k_tokens is not None and result.top_k_probs is not None
    out = np.zeros(logits.shape[-1])
    out[result.top_k_tokens[0].numpy()] = result.top_k_probs[0].numpy()
    return out


def keep(tokens: Sequence[int], probs: Sequence[float] = P) -> np.ndarray:
    """``probs`` restricted to ``tokens`` and renormalized."""
    out = np.zeros(len(probs))
    out[list(tokens)] = [probs[t] for t in tokens]
    return out / out.sum()


def draw_counts(settings: SamplerSettings, n: int = 2000, sampler: Sampler | None = None,
                logits: torch.Tensor = LOGITS) -> np.ndarray:
    sampler = sampler or Sampler(logits.shape[-1])
    requests = [SampleRequest(settings, seed=12345, counter=c) for c in range(n)]
    results = sampler.sample(logits.expand(n, -1), requests)
    return np.bincount([r.token_id for r in results], minlength=logits.shape[-1])


def assert_chi_square(counts: np.ndarray, expected_probs: np.ndarray) -> None:
    """Counts fit the distribution (p > 0.001); tokens of probability 0 never appear."""
    assert counts[expected_probs == 0].sum() == 0
    support = expected_probs > 0
    expected = expected_probs[support] * counts.sum()
    stat = float((((counts[support] - expected) ** 2) / expected).sum())
    df = int(support.sum()) - 1
    if df == 0:
        return
    z = 3.09  # one-sided 0.1% normal quantile; Wilson-Hilferty chi-square approximation
    critical = df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3
    assert stat < critical, f"chi-square {stat:.1f} >= {critical:.1f} (df {df})"


def softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x[np.isfinite(x)].max())
    return e / e.sum()


# ---- exact stages ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("settings", "kept"),
    [
        (SamplerSettings(top_k=3), [5, 6, 7]),
        (SamplerSettings(top_p=0.45), [6, 7]),
        (SamplerSettings(top_p=0.6), [5, 6, 7]),
        (SamplerSettings(min_p=0.5), [5, 6, 7]),
        (SamplerSettings(min_p=0.4), [4, 5, 6, 7]),
        (SamplerSettings(top_a=1.0), [3, 4, 5, 6, 7]),
        (SamplerSettings(top_k=4, min_p=0.7), [6, 7]),
        (SamplerSettings(), list(range(V))),
    ],
)
def test_truncation_filters_match_hand_computation(settings: SamplerSettings,
                                                   kept: list[int]) -> None:
    np.testing.assert_allclose(final_distribution(settings), keep(kept), atol=1e-6)


def reference_typical(p: Sequence[float], mass: float) -> list[int]:
    entropy = -sum(x * math.log(x) for x in p)
    order = sorted(range(len(p)), key=lambda i: abs(-math.log(p[i]) - entropy))
    kept, total = [], 0.0
    for i in order:
        kept.append(i)
        total += p[i]
        if total >= mass:
            break
    return kept


def reference_tail_free(p: Sequence[float], z: float) -> list[int]:
    order = sorted(range(len(p)), key=lambda i: -p[i])
    s = [p[i] for i in order]
    d2 = [abs(s[i] - 2 * s[i + 1] + s[i + 2]) for i in range(len(s) - 2)]
    cdf = np.cumsum(np.array(d2) / sum(d2))
    count = min(1 + int((cdf <= z).sum()), len(s) - 1)
    return order[:count]


@pytest.mark.parametrize("mass", [0.2, 0.5, 0.9])
def test_typical_matches_reference(mass: float) -> None:
    expected = keep(reference_typical(P, mass))
    np.testing.assert_allclose(final_distribution(SamplerSettings(typical=mass)), expected,
                               atol=1e-6)


@pytest.mark.parametrize("z", [0.3, 0.6, 0.95])
def test_tail_free_matches_reference(z: float) -> None:
    expected = keep(reference_tail_free(P, z))
    assert 0 < np.count_nonzero(expected) < V
    np.testing.assert_allclose(final_distribution(SamplerSettings(tfs=z)), expected, atol=1e-6)


WIDE = torch.cat([LOGITS, torch.full((56,), math.log(1e-4))])  # 64 columns, 8 that matter


@pytest.mark.parametrize(
    ("settings", "kept"),
    [
        (SamplerSettings(top_k=8, top_p=0.45), [6, 7]),
        (SamplerSettings(top_k=8, min_p=0.4), [4, 5, 6, 7]),
        (SamplerSettings(top_k=8, typical=0.5), reference_typical(P, 0.5)),
        (SamplerSettings(top_k=8, tfs=0.6), reference_tail_free(P, 0.6)),
        (SamplerSettings(top_k=8, top_a=1.0), [3, 4, 5, 6, 7]),
        (SamplerSettings(top_k=8, xtc_probability=1.0, xtc_threshold=0.15),
         [0, 1, 2, 3, 4, 5, 7]),
        (SamplerSettings(top_k=8, mirostat=True, mirostat_tau=1.5), [5, 6, 7]),
    ],
)
def test_stages_after_top_k_on_compacted_rows(settings: SamplerSettings,
                                              kept: list[int]) -> None:
    """top_k 8 of 64 columns: later stages run on the 8 compacted columns."""
    got = final_distribution(settings, Sampler(64, eos_token_ids=[7]), logits=WIDE)
    np.testing.assert_allclose(got[:V], keep(kept), atol=1e-6)
    assert not got[V:].any()


def test_temperature_scales_logits() -> None:
    expected = np.array(P) ** 2 / (np.array(P) ** 2).sum()
    np.testing.assert_allclose(final_distribution(SamplerSettings(temperature=0.5)), expected,
                               atol=1e-6)


def test_temperature_first_or_last_changes_what_top_p_keeps() -> None:
    first = SamplerSettings(temperature=4.0, top_p=0.45)
    flat = np.array(P) ** 0.25 / (np.array(P) ** 0.25).sum()  # 0.167 + 0.157 + 0.149 > 0.45
    np.testing.assert_allclose(final_distribution(first), keep([5, 6, 7], flat), atol=1e-6)
    last = SamplerSettings(temperature=4.0, top_p=0.45, temperature_last=True)
    np.testing.assert_allclose(final_distribution(last), keep([6, 7], flat), atol=1e-6)


def test_dynamic_temperature_uses_normalized_entropy() -> None:
    settings = SamplerSettings(min_temp=0.5, max_temp=2.0, temp_exponent=2.0, top_k=4)
    p4 = keep([4, 5, 6, 7])[4:]
    entropy = -(p4 * np.log(p4)).sum()
    temp = 0.5 + 1.5 * (entropy / math.log(4)) ** 2
    expected = np.zeros(V)
    expected[4:] = p4 ** (1 / temp) / (p4 ** (1 / temp)).sum()
    settings_last = settings.model_copy(update={"temperature_last": True})
    np.testing.assert_allclose(final_distribution(settings_last), expected, atol=1e-5)


def test_xtc_removes_top_choices_but_the_least_likely_and_protected() -> None:
    always = SamplerSettings(xtc_probability=1.0, xtc_threshold=0.15)
    np.testing.assert_allclose(final_distribution(always), keep([0, 1, 2, 3, 4, 5]), atol=1e-6)
    protected = Sampler(V, eos_token_ids=[7])
    np.testing.assert_allclose(final_distribution(always, protected),
                               keep([0, 1, 2, 3, 4, 5, 7]), atol=1e-6)
    newline = Sampler(V, token_pieces=["a", "b", "c", "d", "e", "f", "\n", "g"])
    np.testing.assert_allclose(final_distribution(always, newline),
                               keep([0, 1, 2, 3, 4, 5, 6]), atol=1e-6)
    one_above = SamplerSettings(xtc_probability=1.0, xtc_threshold=0.25)
    np.testing.assert_allclose(final_distribution(one_above), keep(range(V)), atol=1e-6)


def test_bias_bans_and_masks() -> None:
    bias = SamplerSettings(token_bias={0: math.log(10.0)}, banned_tokens=(7,))
    expected = np.array(P) * [10, 1, 1, 1, 1, 1, 1, 0]
    np.testing.assert_allclose(final_distribution(bias), expected / expected.sum(), atol=1e-6)
    packed = np.array([0b01101001], dtype=np.int32)  # tokens 0, 3, 5, 6
    np.testing.assert_allclose(final_distribution(SamplerSettings(), allowed_tokens=packed),
                               keep([0, 3, 5, 6]), atol=1e-6)
    as_bool = torch.tensor([False, True, True] + [False] * 5)
    np.testing.assert_allclose(final_distribution(SamplerSettings(), allowed_tokens=as_bool),
                               keep([1, 2]), atol=1e-6)


def test_greedy_takes_argmax_of_edited_logits() -> None:
    greedy = SamplerSettings.greedy(banned_tokens=(7,), top_p=0.1)
    sampler = Sampler(V)
    result = sampler.sample(LOGITS[None], [SampleRequest(greedy, return_probs=True)])[0]
    assert result.token_ids == [6]
    assert result.token_probs is not None
    assert float(result.token_probs[0]) == pytest.approx(0.22 / 0.72, abs=1e-6)


def test_rows_without_a_stage_are_untouched() -> None:
    sampler = Sampler(V)
    requests = [SampleRequest(s, seed=3, return_top_tokens=V) for s in
                (SamplerSettings(top_k=2, temperature=0.5), SamplerSettings())]
    plain = sampler.sample(LOGITS.expand(2, -1), requests)[1]
    assert plain.top_k_probs is not None
    np.testing.assert_allclose(plain.top_k_probs[0].numpy(), sorted(P, reverse=True), atol=1e-7)


def test_unused_stages_are_never_run(monkeypatch: pytest.MonkeyPatch) -> None:
    from dyngen_core.sampling import shaping as filters

    def fail(*args: object) -> None:
        raise AssertionError("a stage no row uses ran")

    for name in ("top_k", "top_p", "min_p", "typical", "tail_free", "top_a", "xtc",
                 "mirostat", "temperature", "dynamic_temperature"):
        monkeypatch.setattr(filters, name, fail)
    settings = [SamplerSettings(), SamplerSettings.greedy(token_repetition_penalty=1.2)]
    Sampler(V).sample(LOGITS.expand(2, -1), [SampleRequest(s, history=[1]) for s in settings])


# ---- sampled stages ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("settings", "expected"),
    [
        (SamplerSettings(), np.array(P)),
        (SamplerSettings(top_k=3), keep([5, 6, 7])),
        (SamplerSettings(min_p=0.4, temperature=0.5),  # 0.12**2 < 0.4 * 0.28**2
         keep([5, 6, 7], list(np.array(P) ** 2))),
        (SamplerSettings(xtc_probability=0.5, xtc_threshold=0.15),
         0.5 * np.array(P) + 0.5 * keep([0, 1, 2, 3, 4, 5])),
        (SamplerSettings(mirostat=True, mirostat_tau=1.5), keep([5, 6, 7])),
    ],
)
def test_draws_follow_the_final_distribution(settings: SamplerSettings,
                                             expected: np.ndarray) -> None:
    assert_chi_square(draw_counts(settings), expected)


def test_draws_over_a_large_vocab_follow_softmax() -> None:
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(64, generator=generator) * 2
    counts = draw_counts(SamplerSettings(top_k=20), n=2000, logits=logits)
    probs = np.zeros(64)
    top = torch.topk(logits, 20).indices.numpy()
    probs[top] = softmax(logits.numpy()[top])
    assert_chi_square(counts, probs)


def test_seeded_rows_do_not_depend_on_batch_composition() -> None:
    generator = torch.Generator().manual_seed(1)
    vocab = 256
    job_logits = torch.randn(vocab, generator=generator) * 3
    job = SamplerSettings(temperature=0.9, top_p=0.9, top_k=50, min_p=0.01)
    neighbours = [SamplerSettings(), SamplerSettings.greedy(), SamplerSettings(top_k=5),
                  SamplerSettings(temperature=1.5, typical=0.8), SamplerSettings(tfs=0.9)]
    sampler = Sampler(vocab)
    outputs = []
    for batch in (1, 5, 64):
        tokens = []
        for counter in range(12):
            position = (counter * 7) % batch
            logits = torch.randn(batch, vocab, generator=generator) * 3
            logits[position] = job_logits
            requests = [SampleRequest(neighbours[i % 5], seed=i + 100, counter=counter)
                        for i in range(batch)]
            requests[position] = SampleRequest(job, seed=42, counter=counter)
            tokens.append(sampler.sample(logits, requests)[position].token_id)
        outputs.append(tokens)
    assert outputs[0] == outputs[1] == outputs[2]
    assert len(set(outputs[0])) > 3  # the counter really changes the draw


def test_extras_only_for_rows_that_ask() -> None:
    width = V + 4  # logits wider than the vocabulary: the extra columns are never sampled
    logits = torch.cat([LOGITS, torch.full((4,), 50.0)]).expand(2, -1).contiguous()
    sampler = Sampler(V)
    asking = SampleRequest(SamplerSettings(top_k=3), seed=5, return_probs=True,
                           return_top_tokens=2, return_logits=True)
    quiet = SampleRequest(SamplerSettings(), seed=6)
    first, second = sampler.sample(logits, [asking, quiet])
    assert first.token_id in (5, 6, 7) and second.token_id < V
    assert first.token_probs is not None and first.top_k_tokens is not None
    assert first.top_k_probs is not None and first.logits is not None
    assert float(first.token_probs[0]) == pytest.approx(P[first.token_id] / 0.68, abs=1e-6)
    assert first.top_k_tokens.tolist() == [[7, 6]]
    np.testing.assert_allclose(first.top_k_probs[0].numpy(), [0.28 / 0.68, 0.22 / 0.68],
                               atol=1e-6)
    assert first.logits.shape == (1, width) and torch.equal(first.logits[0], logits[0])
    assert first.logits.device.type == "cpu"
    assert second.token_probs is None and second.top_k_tokens is None and second.logits is None


def test_errors_name_the_problem() -> None:
    sampler = Sampler(V)
    with pytest.raises(ValueError, match=r"logits must be \[2, >= 8\]"):
        sampler.sample(LOGITS[None], [SampleRequest(SamplerSettings())] * 2)
    banned = SampleRequest(SamplerSettings(), allowed_tokens=np.zeros(1, dtype=np.int32))
    with pytest.raises(SamplingError) as info:
        sampler.sample(LOGITS.expand(2, -1), [SampleRequest(SamplerSettings()), banned])
    assert info.value.request_indices == [1]
    with pytest.raises(ValueError, match="mirostat needs one row"):
        sampler.sample(LOGITS.expand(2, -1),
                       [SampleRequest(SamplerSettings(mirostat=True), draft_ids=[3])])


def test_gumbel_uniforms_stay_strictly_inside_zero_one() -> None:
    from dyngen_core.sampling.rng import open_uniform

    extremes = torch.tensor([0, 1, 2**32 - 2, 2**32 - 1], dtype=torch.int64)
    u = open_uniform(extremes)
    assert bool(((u > 0) & (u < 1)).all())
    assert bool(torch.isfinite(u.log().neg().log().neg()).all())
