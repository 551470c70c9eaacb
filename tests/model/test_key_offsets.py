"""Calibrated key offsets of the quantized caches: measured deterministically, subtracted on
write, invisible to attention, and what makes 4-bit keys cheap when keys share a large part."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from dyngen_core import Cache, Model
from dyngen_core.engine.plan import SequenceSlice, StepPlan
from dyngen_core.kv.attention.base import build_forward_batch
from dyngen_core.kv.attention.sdpa import SdpaBackend
from dyngen_core.kv.cache import calibration_ids, measure_key_means
from dyngen_core.kv.quant.storage import QuantStorage
from tests.tiny_models import write_tiny_model

IDS = list(range(3, 200, 3))


@pytest.fixture(scope="module")
def biased_qwen2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Qwen2 (q/k/v biases) whose keys share a large component: a key bias of 4."""
    folder = write_tiny_model(tmp_path_factory.mktemp("offsets"), arch="qwen2", seed=2,
                              hidden_size=128)
    from safetensors.torch import load_file, save_file

    weights = load_file(str(folder / "model.safetensors"))
    for name in weights:
        if name.endswith("k_proj.bias"):
            weights[name] = weights[name] + 4.0
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


def logits(model: Model, cache: Cache) -> torch.Tensor:
    plan = StepPlan([SequenceSlice(0, IDS, 0, [0], True)])
    batch = build_forward_batch(plan, cache.page_size, model.device)
    batch.logits_indices = torch.arange(len(IDS))
    return model.forward(batch, cache.storage, SdpaBackend())


def test_calibration_input_is_fixed() -> None:
    assert calibration_ids(1000, 7) == calibration_ids(1000, 7)
    ids = calibration_ids(1000, 7, length=64)
    assert ids[0] == 7 and len(ids) == 64 and all(0 <= i < 1000 for i in ids)
    assert calibration_ids(1000, None, length=64)[0] != 7


def test_key_means_are_deterministic_per_layer(biased_qwen2: Path) -> None:
    model = Model.load(biased_qwen2, device="cpu")
    first, second = measure_key_means(model), measure_key_means(model)
    assert len(first) == model.config.num_layers
    for a, b in zip(first, second, strict=True):
        assert a.shape == (model.config.num_kv_heads, model.config.head_dim)
        assert torch.equal(a, b)
    assert float(first[0].abs().mean()) > 1.0  # the bias of 4 shows up (after rotary)


def test_quantized_caches_get_offsets_and_subtract_them(biased_qwen2: Path) -> None:
    model = Model.load(biased_qwen2, device="cpu")
    assert not hasattr(Cache(model, max_tokens=256).storage, "key_offsets")
    cache = Cache(model, max_tokens=256, mode="q8")
    storage = cache.storage
    assert isinstance(storage, QuantStorage) and storage.key_offsets is not None
    key = torch.randn(4, model.config.num_kv_heads, model.config.head_dim) + 3.0
    storage.write(0, key, key, torch.arange(4))
    stored, _ = storage.gather(0, torch.zeros(1, 1, dtype=torch.int64))
    expected = key - storage.key_offsets[0]
    torch.testing.assert_close(stored[0, :4], expected, atol=0.05, rtol=0.02)
    with pytest.raises(ValueError, match="tensor per layer"):
        storage.set_key_offsets([torch.zeros(2, 64)])


@pytest.mark.parametrize("mode", ["q6", "q4"])
def test_offsets_shrink_the_error_of_low_bit_keys(biased_qwen2: Path, mode: str) -> None:
    model = Model.load(biased_qwen2, device="cpu")
    exact = logits(model, Cache(model, max_tokens=256))
    with_offsets = Cache(model, max_tokens=256, mode=mode)
    without = Cache(model, max_tokens=256, mode=mode)
    without.storage.set_key_offsets(None)
    error_with = (logits(model, with_offsets) - exact).abs().mean().item()
    error_without = (logits(model, without) - exact).abs().mean().item()
    # Measured (mean error; first token exact as a page head): 0.70x (q4), 0.68x (q6).
    assert error_with < 0.8 * error_without


def two_chunk_logits(model: Model, cache: Cache, offsets: list[list[torch.Tensor] | None]
                     ) -> torch.Tensor:
    """Logits of IDS prefilled in two chunks, with ``offsets[i]`` set before chunk ``i``."""
    half = len(IDS) // 2
    outputs = []
    for chunk, (start, ids) in enumerate(((0, IDS[:half]), (half, IDS[half:]))):
        cache.storage.set_key_offsets(offsets[chunk])
        plan = StepPlan([SequenceSlice(0, ids, start, [0], True)])
        batch = build_forward_batch(plan, cache.page_size, model.device)
        batch.logits_indices = torch.arange(len(ids))
        outputs.append(model.forward(batch, cache.storage, SdpaBackend()))
    return torch.cat(outputs)


def test_one_offset_per_sequence_is_invisible_to_attention(
        tiny_model_factory: Callable[..., Path]) -> None:
    """Softmax ignores one fixed vector subtracted from every key; keys written with different
    offsets (what `set_key_offsets` warns about) do change the output."""
    model = Model.load(tiny_model_factory("llama", seed=4, hidden_size=128), device="cpu")
    shape = (model.config.num_kv_heads, model.config.head_dim)
    shift = [torch.full(shape, 0.5) for _ in range(model.config.num_layers)]
    plain = two_chunk_logits(model, Cache(model, max_tokens=256, mode="q8"), [None, None])
    same = two_chunk_logits(model, Cache(model, max_tokens=256, mode="q8"), [shift, shift])
    mixed = two_chunk_logits(model, Cache(model, max_tokens=256, mode="q8"), [None, shift])
    consistent = (same - plain).abs().max().item()
    inconsistent = (mixed - plain).abs().max().item()
    assert consistent < inconsistent / 4
