"""The one-copy parameter upload (`Staging`) and the compact draw's cheaper arithmetic: same
values, same tokens, as the per-column copies and the plain formulas."""

from __future__ import annotations

import numpy as np
import torch

from dyngen_core.engine.record import SampleRequest
from dyngen_core.engine.settings import SamplerSettings
from dyngen_core.sampling.rng import gumbel_noise, open_uniform, perturb, row_keys
from dyngen_core.sampling.sampler import Sampler, SamplingError
from dyngen_core.sampling.upload import Staging


def test_staging_returns_each_column_with_its_values_dtype_and_shape() -> None:
    keys = row_keys([11, 12, 13], [0, 5, 2**40])
    ks = np.array([[3], [7], [1]], dtype=np.int64)
    temps = np.array([[0.8], [1.3], [0.1]], dtype=np.float32)
    top_p = np.array([0.9, 0.95], dtype=np.float32)
    (k_out, ks_out), (t_out, p_out) = Staging(torch.device("cpu")).send([keys, ks],
                                                                        [temps, top_p])
    assert k_out.dtype == torch.int64 and k_out.shape == (3, 2)
    assert torch.equal(k_out, torch.from_numpy(keys))
    assert torch.equal(ks_out, torch.from_numpy(ks))
    assert t_out.dtype == torch.float32 and t_out.shape == (3, 1)
    assert torch.equal(t_out, torch.tensor([0.8, 1.3, 0.1], dtype=torch.float32).unsqueeze(1))
    assert torch.equal(p_out, torch.tensor([0.9, 0.95], dtype=torch.float32))


def test_staging_with_no_float_columns() -> None:
    keys = row_keys([1], [2])
    (out,), floats = Staging(torch.device("cpu")).send([keys], [])
    assert floats == [] and torch.equal(out, torch.from_numpy(keys))


def test_send_ints_gives_what_send_gives_for_one_int_column() -> None:
    staging = Staging(torch.device("cpu"))
    for keys in (row_keys([11, 12, 13], [0, 5, 2**40]), row_keys([7], [1])):
        out = staging.send_ints(keys)
        (expected,), _ = staging.send([keys], [])
        assert out.dtype == torch.int64 and out.shape == keys.shape
        assert torch.equal(out, expected)


def test_row_keys_words_are_the_low_and_high_halves_of_the_splitmix_output() -> None:
    from dyngen_core.sampling.rng import seed_key, splitmix64

    seeds, counters = [0, 1, 2**63 - 1, 12345], [0, 7, 2**40, 2**62]
    keys = row_keys(np.array([seed_key(s) for s in seeds], dtype=np.uint64), counters)
    for (a, b), s, c in zip(keys.tolist(), seeds, counters, strict=True):
        k = splitmix64(seed_key(s) ^ c)
        assert (a, b) == (k & 0xFFFFFFFF, k >> 32)


def test_open_uniform_matches_the_half_offset_formula_bit_for_bit() -> None:
    h = torch.cat([torch.tensor([0, 1, 255, 256, 511, 512, 2**31, 2**32 - 1]),
                   torch.randint(0, 2**32, (10_000,), generator=torch.Generator().manual_seed(0))])
    plain = (h >> 9).to(torch.float32).add_(0.5).mul_(1.0 / (1 << 23))
    assert torch.equal(open_uniform(h).view(torch.int32), plain.view(torch.int32))


def test_perturb_is_values_plus_gumbel_noise_bit_for_bit() -> None:
    keys = torch.from_numpy(row_keys([3, 4, 5, 6], [0, 1, 2, 3]))
    values = torch.randn(4, 64, generator=torch.Generator().manual_seed(2))
    values[0, :10] = float("-inf")
    tokens = torch.arange(64).expand(4, 64)
    plain = values + gumbel_noise(keys, tokens)
    assert torch.equal(perturb(values, keys, tokens).view(torch.int32), plain.view(torch.int32))


def _requests(settings: list[SamplerSettings], n: int) -> list[SampleRequest]:
    return [SampleRequest(settings=settings[i % len(settings)], seed=i, counter=4)
            for i in range(n)]


def test_compact_draw_with_mixed_top_k_cuts_only_the_smaller_ones() -> None:
    # Rows of top_k 2..41 share a bound of 41: the draw must stay within each row's own top_k.
    logits = torch.randn(40, 512, generator=torch.Generator().manual_seed(3))
    settings = [SamplerSettings(temperature=5.0, top_k=k) for k in range(2, 42)]
    sampler = Sampler(512)
    for counter in range(5):
        requests = [SampleRequest(settings=s, seed=counter, counter=counter) for s in settings]
        ids, _ = sampler.sample_tokens(logits, requests)
        for row, (token, s) in enumerate(zip(ids, settings, strict=True)):
            allowed = set(torch.topk(logits[row], s.top_k).indices.tolist())
            assert token in allowed


def test_compact_draw_reports_rows_without_an_allowed_token() -> None:
    logits = torch.randn(4, 512, generator=torch.Generator().manual_seed(4))
    logits[2] = float("-inf")
    requests = _requests([SamplerSettings(temperature=0.8, top_p=0.9, top_k=50)], 4)
    try:
        Sampler(512).sample_tokens(logits, requests)
    except SamplingError as exc:
        assert exc.request_indices == [2]
    else:
        raise AssertionError("a row with every logit -inf was sampled")


def test_send_ints_into_fills_the_target_in_place() -> None:
    staging = Staging(torch.device("cpu"))
    target = torch.full((4, 2), -7, dtype=torch.int64)
    keys = row_keys([11, 12, 13], [0, 5, 2**40])
    staging.send_ints_into(keys, target[:3])
    assert torch.equal(target[:3], torch.from_numpy(keys))
    assert target[3].tolist() == [-7, -7]
