"""Layer split (`Model.load(..., device_map=...)`): how layers are shared out over devices, and
a model split over two "devices" of the CPU computing the same logits as the whole model
(through the paged cache, whose pages follow each layer's device)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dyngen_core.engine.plan import SequenceSlice, StepPlan
from dyngen_core.kv.attention import SdpaBackend
from dyngen_core.kv.attention.base import build_forward_batch
from dyngen_core.kv.cache import Cache
from dyngen_core.model import Model
from dyngen_core.model.layer_split import resolve_device_map, split_layers

GIB = 2**30


def test_layers_follow_free_memory_after_the_head() -> None:
    # 28 GiB left on device 0 after a 2 GiB head, 10 GiB on device 1: 8 layers go 6 and 2.
    assert split_layers(8, [30 * GIB, 10 * GIB], layer_bytes=GIB, head_bytes=2 * GIB) == [
        0, 0, 0, 0, 0, 0, 1, 1]
    # A first device the head fills gets no layer.
    assert split_layers(3, [2 * GIB, 5 * GIB], layer_bytes=GIB, head_bytes=2 * GIB) == [1, 1, 1]
    # Devices of unknown free memory (the CPU) count as equals; the first gets the remainder.
    assert split_layers(5, [None, None], layer_bytes=1, head_bytes=1) == [0, 0, 0, 1, 1]


def test_layer_split_refuses_what_cannot_fit_or_mix() -> None:
    with pytest.raises(ValueError, match="do not fit"):
        split_layers(8, [4 * GIB, 4 * GIB], layer_bytes=GIB, head_bytes=2 * GIB)
    with pytest.raises(ValueError, match="mixes"):
        split_layers(2, [GIB, None], layer_bytes=1, head_bytes=1)
    with pytest.raises(ValueError, match="device_map='everywhere'"):
        resolve_device_map("everywhere")
    with pytest.raises(ValueError, match="empty"):
        resolve_device_map([])


def run_steps(model: Model) -> list[torch.Tensor]:
    """Logits of a 21-token prefill then two decode steps over 8-slot pages."""
    cache = Cache(model, max_tokens=64, page_size=8)
    ids = [(7 * i + 3) % model.config.vocab_size for i in range(23)]
    pieces = [(0, 21), (21, 22), (22, 23)]
    out = []
    for start, end in pieces:
        plan = StepPlan(slices=[SequenceSlice(job_id=0, token_ids=ids[start:end],
                                              start_pos=start, page_table=[5, 2, 7],
                                              sample=True)])
        out.append(model.forward(build_forward_batch(plan, 8, model.device), cache.storage,
                                 SdpaBackend()))
    return out


def test_layer_split_over_two_cpu_devices_keeps_logits(tiny_model_factory) -> None:
    # "cpu" and "cpu:0" are the same memory but compare as two devices, so the map is seen.
    folder: Path = tiny_model_factory("llama", num_hidden_layers=3)
    first, second = torch.device("cpu"), torch.device("cpu", 0)
    split = Model.load(folder, device_map=[first, second])
    assert split.device == first
    assert split.layer_devices == [first, first, second]
    assert len({id(layer.input_norm.weight) for layer in split.layers}) == 3
    whole = run_steps(Model.load(folder))
    for ours, ref in zip(run_steps(split), whole, strict=True):
        assert torch.equal(ours, ref)
    with pytest.raises(ValueError, match="neither device nor tensor_parallel"):
        Model.load(folder, device="cpu", device_map=[first, second])
