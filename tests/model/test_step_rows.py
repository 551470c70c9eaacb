"""The quantized storage prepares a layer's rows once and its row indices once per forward
(`quant.storage.StepMemo`), keeps the arithmetic of preparing them one by one, and never hands back
a result whose inputs changed."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
import torch

from dyngen_core.config import ModelConfig
from dyngen_core.engine.plan import SequenceSlice, StepPlan
from dyngen_core.kv.attention.base import build_forward_batch
from dyngen_core.kv.attention.triton.decode import exact_operands
from dyngen_core.kv.quant import storage as quant
from dyngen_core.kv.quant import window as recent
from dyngen_core.kv.quant.format import hadamard_matrix, rotate
from dyngen_core.kv.quant.storage import QuantStorage, StepMemo

PAGE, KV_HEADS, DIM, LAYERS, WINDOW = 8, 2, 64, 3, 4
ROTATION = hadamard_matrix(32)


def _storage(dtype: torch.dtype, mode: str = "q4") -> QuantStorage:
    config = ModelConfig(architecture="LlamaForCausalLM", vocab_size=32,
                         hidden_size=4 * DIM, intermediate_size=64, num_layers=LAYERS,
                         num_heads=4, num_kv_heads=KV_HEADS, head_dim=DIM)
    storage = QuantStorage(config, 9, PAGE, dtype, ["cpu"] * LAYERS, mode,
                           recent_window=WINDOW)
    storage.reserve_sequences(3)
    gen = torch.Generator().manual_seed(1)
    storage.set_key_offsets([torch.randn(KV_HEADS, DIM, generator=gen) for _ in range(LAYERS)])
    return storage


def _rows(tokens: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values as views into one projection output, as the model leaves them."""
    gen = torch.Generator().manual_seed(seed)
    fused = (torch.randn(tokens, 6, DIM, generator=gen) * 3).to(dtype)
    return fused[:, 2:4], fused[:, 4:6]


def _decode(positions: list[int], slots: list[int]) -> Any:
    """A decode step: sequence i at ``positions[i]`` on pages 3i .. 3i+2, window slot
    ``slots[i]``."""
    plan = StepPlan([SequenceSlice(i, [1], p, [3 * i, 3 * i + 1, 3 * i + 2], True)
                     for i, p in enumerate(positions)])
    return build_forward_batch(plan, PAGE, "cpu", seq_slots=slots)


def _one_by_one(storage: QuantStorage, layer: int, key: torch.Tensor,
                value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Stored keys and exact keys/values the way they were computed before `step_rows`."""
    assert storage.key_offsets is not None
    stored = (key.to(torch.float32) - storage.key_offsets[layer]).to(key.dtype)
    return (stored, rotate(stored, ROTATION).to(storage.dtype),
            rotate(value, ROTATION).to(storage.dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_rows_keep_the_arithmetic_of_preparing_them_one_by_one(dtype: torch.dtype) -> None:
    storage = _storage(dtype)
    batch = _decode([8, 13, 16], [0, 1, 2])  # the first and last start a page: head rows
    key, value = _rows(3, dtype, seed=2)
    storage.write(1, key, value, batch.slot_mapping)
    storage.write_recent(1, key, value, batch.positions, batch.token_seq_slots)
    stored, exact_k, exact_v = _one_by_one(storage, 1, key, value)
    assert torch.equal(storage.stored_keys(1, key), stored)  # offset in float32, rounded once
    got_k, got_v = storage.exact_rows(1, key, value)
    # One rotation of keys and values together: the same products and sums, so at most a
    # float32 rounding apart (then rounded to the compute dtype).
    ulp = {torch.float32: 1e-6, torch.bfloat16: 2 ** -7, torch.float16: 2 ** -10}[dtype]
    torch.testing.assert_close(got_k, exact_k, rtol=ulp, atol=ulp)
    torch.testing.assert_close(got_v, exact_v, rtol=ulp, atol=ulp)
    heads = storage.layers[1]
    assert torch.equal(heads.key_heads[[1, 8]], got_k[[0, 2]])  # pages 1 and 8 begin here
    assert torch.equal(heads.value_heads[[1, 8]], got_v[[0, 2]])
    assert not heads.key_heads[4].any()  # position 13 is no page's first slot
    window = storage.recent
    assert window is not None
    ring_k, ring_v, ring_pos = window.gather(1, torch.tensor([0, 1, 2]))
    assert ring_pos[:, 0].tolist() == [8, -1, 16] and ring_pos[1, 1].item() == 13
    assert torch.equal(ring_k[[0, 1, 2], [0, 1, 0]], got_k)
    assert torch.equal(ring_v[[0, 1, 2], [0, 1, 0]], got_v)


def _counting(monkeypatch: pytest.MonkeyPatch, module: Any, name: str,
              counts: Counter[str]) -> None:
    original: Callable[..., Any] = getattr(module, name)

    def counted(*args: Any, **kwargs: Any) -> Any:
        counts[name] += 1
        return original(*args, **kwargs)

    monkeypatch.setattr(module, name, counted)


@pytest.mark.parametrize("inference", [False, True])
def test_a_step_prepares_rows_once_per_layer_and_indices_once(
        monkeypatch: pytest.MonkeyPatch, inference: bool) -> None:
    counts: Counter[str] = Counter()
    _counting(monkeypatch, quant, "prepare_rows", counts)
    _counting(monkeypatch, quant, "head_index", counts)
    _counting(monkeypatch, recent.RecentWindow, "index", counts)
    storage = _storage(torch.bfloat16)
    with torch.inference_mode(inference):
        for step in range(2):
            batch = _decode([8 + step, 13 + step], [0, 1])
            assert batch.token_seq_slots is not None
            for layer in range(LAYERS):  # the calls of TritonPagedBackend.attend, in order
                key, value = _rows(2, torch.bfloat16, seed=10 * step + layer)
                storage.write(layer, key, value, batch.slot_mapping)
                exact = exact_operands(storage, layer, batch, (key, value))
                assert exact is not None and exact.window == WINDOW
                storage.stored_keys(layer, key)
                storage.write_recent(layer, key, value, batch.positions, batch.token_seq_slots)
    assert counts == {"prepare_rows": 2 * LAYERS, "head_index": 2, "index": 2}


def test_changed_inputs_are_prepared_again() -> None:
    storage = _storage(torch.float32)
    batch = _decode([8], [0])
    key, value = _rows(1, torch.float32, seed=3)
    storage.write(0, key, value, batch.slot_mapping)
    first = storage.exact_rows(0, key, value)[0]
    assert storage.exact_rows(0, key, value)[0].data_ptr() == first.data_ptr()  # reused
    assert storage.exact_rows(1, key, value)[0].data_ptr() != first.data_ptr()  # other layer
    assert storage.exact_rows(0, key.clone(), value)[0].data_ptr() != first.data_ptr()
    key.mul_(2)  # written in place after the write: the next call must see it
    again = storage.exact_rows(0, key, value)[0]
    assert again.data_ptr() != first.data_ptr()
    torch.testing.assert_close(again, _one_by_one(storage, 0, key, value)[1])
    storage.set_key_offsets([torch.zeros(KV_HEADS, DIM)] * LAYERS)
    assert torch.equal(storage.stored_keys(0, key), key)  # the new offsets, not the old rows


def test_a_new_forward_recomputes_indices_of_reused_batch_tensors() -> None:
    """A CUDA graph's static inputs are the same tensors every step, refilled in place (and
    under inference mode their version counters do not move): every forward must derive its
    own indices, never reuse an earlier forward's."""
    storage = _storage(torch.float32)
    with torch.inference_mode():
        batch = _decode([8], [0])
        for page in (2, 6):
            batch.slot_mapping.fill_(page * PAGE)
            for layer in range(LAYERS):
                key, value = _rows(1, torch.float32, seed=page + layer)
                storage.write(layer, key, value, batch.slot_mapping)
                exact_key = storage.exact_rows(layer, key, value)[0]
                assert torch.equal(storage.layers[layer].key_heads[page], exact_key[0])


def test_step_memo_matches_only_the_same_unwritten_tensors() -> None:
    memo = StepMemo()
    slots = torch.arange(4)
    computed: list[int] = []

    def compute() -> int:
        computed.append(1)
        return len(computed)

    assert memo.index("x", 0, slots.device, (slots,), compute) == 1
    assert memo.index("x", 1, slots.device, (slots,), compute) == 1  # a later layer: reused
    assert memo.index("x", 1, slots.device, (slots,), compute) == 2  # not a later layer
    slots.add_(1)
    assert memo.index("x", 2, slots.device, (slots,), compute) == 3  # written in place
    assert memo.index("x", 3, slots.device, (slots.clone(),), compute) == 4  # another tensor
