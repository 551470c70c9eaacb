"""The fused compact draw (one Triton kernel after the top-k) against the torch draw it
replaces, on the same device: the same hashed uniforms bit for bit, and the same tokens for
every row and step over mixes of temperature, top_k, top_p and logit edits; rows with no
allowed token (or a NaN) reported as the torch draw reports them. On CUDA the noise itself is
bit-identical too (both use the CUDA math library's ``logf``); under ``TRITON_INTERPRET=1``
the kernel's ``log`` is numpy's, so the noise is compared to the uniforms' numpy logarithm.
"""

from __future__ import annotations

import copy
import random

import numpy as np
import pytest
import torch

from dyngen_core import SamplerSettings
from dyngen_core.engine.record import SampleRequest
from dyngen_core.sampling import sampler as sampler_module
from dyngen_core.sampling.draw import DrawGraphs
from dyngen_core.sampling.rng import _log_neg_log_uniform, _mix32, open_uniform, row_keys
from dyngen_core.sampling.sampler import Sampler, SamplingError

pytestmark = [pytest.mark.gpu, pytest.mark.filterwarnings("ignore::RuntimeWarning")]

VOCAB = 2048
FUSABLE = [
    SamplerSettings(temperature=0.8, top_p=0.9, top_k=50),
    SamplerSettings(temperature=1.3, top_k=7),
    SamplerSettings(top_k=40, top_p=0.5),
    SamplerSettings(temperature=0.6, top_k=50, token_repetition_penalty=1.3),
    SamplerSettings(temperature=2.0, top_k=33, top_p=0.95, token_bias={3: 4.0},
                    banned_tokens=[5]),
]


def _hash(keys: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    h = _mix32((tokens + keys[:, :1]).bitwise_and_(0xFFFFFFFF))
    return _mix32(h.bitwise_xor_(keys[:, 1:]))


def _keys_and_tokens(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    rng = random.Random(0)
    keys = torch.from_numpy(row_keys([rng.getrandbits(64) for _ in range(6)],
                                     [rng.randrange(2**40) for _ in range(6)])).to(device)
    tokens = torch.randint(0, 2**31 - 1, (6, 300), generator=torch.Generator().manual_seed(1))
    tokens[0, :4] = torch.tensor([0, 1, 2**31 - 2, 128255])
    return keys, tokens.to(device)


def test_kernel_uniforms_are_the_torch_uniforms_bit_for_bit(device: torch.device) -> None:
    from dyngen_core.sampling.fused import hashed_uniforms

    keys, tokens = _keys_and_tokens(device)
    fused = hashed_uniforms(keys, tokens)
    assert torch.equal(fused.view(torch.int32), open_uniform(_hash(keys, tokens)).view(
        torch.int32))


def test_kernel_noise_matches_the_torch_noise(device: torch.device) -> None:
    from dyngen_core.sampling.fused import hashed_uniforms

    keys, tokens = _keys_and_tokens(device)
    noise = hashed_uniforms(keys, tokens, noise=True)
    if device.type == "cuda":
        expected = _log_neg_log_uniform(keys, tokens)
    else:  # the interpreter's log is numpy's
        u = open_uniform(_hash(keys, tokens)).numpy()
        expected = torch.from_numpy(np.log(-np.log(u)))
    assert torch.equal(noise.view(torch.int32), expected.view(torch.int32))


def _requests(settings: list[SamplerSettings], rows: int, step: int) -> list[SampleRequest]:
    rng = random.Random(step)
    return [SampleRequest(settings=settings[i % len(settings)], seed=1000 + i, counter=step,
                          history=[rng.randrange(VOCAB) for _ in range(6)])
            for i in range(rows)]


def _count_fused(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts fused draws, eager (`draw_fused`) or replayed (`DrawGraphs.draw`, on CUDA)."""
    calls: list[int] = []
    original = sampler_module.draw_fused
    original_graph = DrawGraphs.draw

    def counted(*args: object) -> torch.Tensor:
        calls.append(1)
        return original(*args)  # type: ignore[arg-type]

    def counted_graph(*args: object) -> torch.Tensor | None:
        calls.append(1)
        return original_graph(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(sampler_module, "draw_fused", counted)
    monkeypatch.setattr(DrawGraphs, "draw", counted_graph)
    return calls


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_draw_picks_what_the_torch_draw_picks(device: torch.device, dtype: torch.dtype,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _count_fused(monkeypatch)
    rows = 48 if device.type == "cuda" else 20
    fused, torch_draw = Sampler(VOCAB, device, fused_draw=True), Sampler(VOCAB, device,
                                                                        fused_draw=False)
    for step in range(4 if device.type == "cuda" else 2):
        # Wider than the vocabulary: the padding columns are never drawn.
        logits = (torch.randn(rows, VOCAB + 7, generator=torch.Generator().manual_seed(step))
                  * 3).to(device, dtype)
        requests = _requests(FUSABLE, rows, step)
        ids, _ = fused.sample_tokens(logits, requests)
        expected, _ = torch_draw.sample_tokens(logits, copy.deepcopy(requests))
        assert ids == expected, step
        assert all(0 <= t < VOCAB for t in ids)
        launched = fused.launch_tokens(logits, requests)
        assert launched is not None and launched.tolist() == ids
    assert len(calls) == 2 * (step + 1)


def test_fused_draw_reports_rows_without_an_allowed_token(device: torch.device) -> None:
    logits = torch.randn(6, VOCAB, generator=torch.Generator().manual_seed(4)).to(device)
    logits[2] = float("-inf")
    logits[4, 100] = float("nan")
    mask = np.zeros(VOCAB // 32, dtype=np.int32)  # the constraint allows nothing
    requests = _requests(FUSABLE[:2], 6, 0)
    requests[5].allowed_tokens = mask
    for fused_draw in (True, False):
        sampler = Sampler(VOCAB, device, fused_draw=fused_draw)
        with pytest.raises(SamplingError) as info:
            sampler.sample_tokens(logits, copy.deepcopy(requests))
        assert info.value.request_indices == [2, 4, 5], fused_draw
        launched = sampler.launch_tokens(logits, copy.deepcopy(requests))
        assert launched is not None
        assert [i for i, t in enumerate(launched.tolist()) if t < 0] == [2, 4, 5]


@pytest.mark.parametrize("other", [
    SamplerSettings(temperature=1.3, top_k=7, min_p=0.05),
    SamplerSettings(temperature=0.9, top_p=0.8, top_k=30, temperature_last=True),
    None,  # return_probs: the final logits are needed
])
def test_rows_the_kernel_cannot_draw_keep_the_torch_draw(
        device: torch.device, other: SamplerSettings | None,
        monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _count_fused(monkeypatch)
    logits = torch.randn(8, VOCAB, generator=torch.Generator().manual_seed(5)).to(device)
    requests = _requests(FUSABLE[:1], 8, 0)
    if other is None:
        requests[3].return_probs = True
    else:
        requests[3].settings = other
    ids, _ = Sampler(VOCAB, device, fused_draw=True).sample_tokens(logits, requests)
    expected, _ = Sampler(VOCAB, device, fused_draw=False).sample_tokens(
        logits, copy.deepcopy(requests))
    assert ids == expected and not calls


def test_staging_send_ints_on_cuda_gives_what_send_gives(cuda_device: torch.device) -> None:
    from dyngen_core.sampling.upload import Staging

    staging = Staging(cuda_device)
    # Sizes that grow the pinned buffer past an odd float tail, then reuse it.
    for rows in (3, 700, 5):
        keys = row_keys(list(range(rows)), list(range(rows, 2 * rows)))
        (expected,), _ = staging.send([keys], [np.ones(rows, np.float32)])
        out = staging.send_ints(keys)
        assert out.device == expected.device and out.shape == keys.shape
        assert torch.equal(out.cpu(), torch.from_numpy(keys)) and torch.equal(out, expected)
