"""The decode-only window write folded into `QuantStorage.write` on its torch path (the CPU,
no Triton): `write(..., decode_window=...)` stores the window rows itself and the
`write_recent` of the same tensors does nothing, leaving the storage as `write` without the
window then `write_recent` do; the sdpa backend's decode step is unchanged by it; `ForwardBatch`
offers the window only for decode-only batches with sequence slots. (The Triton path:
tests/gpu/test_decode_window_fold.py.)
"""

from __future__ import annotations

import pytest
import torch

from dyngen_core.config import ModelConfig
from dyngen_core.kv.attention.sdpa import SdpaBackend
from dyngen_core.kv.quant.storage import QuantStorage
from dyngen_core.kv.quant.window import RecentWindow
from tests.model.test_recent_window import CASES, DIM, HEADS, _setup

LAYERS, WINDOW, SEQS, KV, D = 2, 4, 3, 2, 32
# (sequence slot, first position) per token of a decode step; slot 3 is out of range.
TOKENS = [(0, 9), (2, 3), (-1, 20), (1, 30), (3, 2)]


class UnfoldedStorage(QuantStorage):
    """A quantized storage whose `write` is never given the decode window: its window rows
    always come from `write_recent` (the path of steps that are not decode-only)."""

    def write(self, layer: int, key: torch.Tensor, value: torch.Tensor,
              slot_mapping: torch.Tensor, *,
              decode_window: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        super().write(layer, key, value, slot_mapping)


def _storage(fold: bool) -> QuantStorage:
    config = ModelConfig(architecture="LlamaForCausalLM", vocab_size=32, hidden_size=KV * D,
                         intermediate_size=64, num_layers=LAYERS, num_heads=KV,
                         num_kv_heads=KV, head_dim=D)
    kind = QuantStorage if fold else UnfoldedStorage
    storage = kind(config, 16, 16, torch.float32, ["cpu"] * LAYERS, "q4",
                   recent_window=WINDOW, triton_write=False)
    storage.reserve_sequences(SEQS)
    return storage


def _state(storage: QuantStorage) -> list[torch.Tensor]:
    assert storage.recent is not None
    spare = SEQS * WINDOW
    return [t for layer, ring in zip(storage.layers, storage.recent.layers, strict=True)
            for t in (*layer.tensors(), layer.head_rows, ring.rows[:, :spare], ring.positions)]


def test_torch_fold_matches_write_then_write_recent(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    original = RecentWindow.write_rows

    def counted(self: RecentWindow, *args: object) -> None:
        calls.append(1)
        original(self, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(RecentWindow, "write_rows", counted)
    folded, plain = _storage(True), _storage(False)
    for step in range(2 * WINDOW + 1):  # positions wrap the window twice
        gen = torch.Generator().manual_seed(step)
        key = torch.randn(len(TOKENS), KV, D, generator=gen)
        value = torch.randn(len(TOKENS), KV, D, generator=gen)
        positions = torch.tensor([p + step for _, p in TOKENS])
        seq_slots = torch.tensor([s for s, _ in TOKENS])
        slots = torch.arange(len(TOKENS)) * 32 + positions % 32
        for storage in (plain, folded):
            calls.clear()
            for layer in range(LAYERS):
                storage.write(layer, key, value, slots, decode_window=(positions, seq_slots))
                if storage is folded:  # the window is written before attention would run
                    assert storage.recent is not None
                    assert storage.recent.layers[layer].positions[(9 + step) % WINDOW] == 9 + step
                storage.write_recent(layer, key, value, positions, seq_slots)
            assert len(calls) == LAYERS  # once per layer: by write, or by write_recent
        for new, old in zip(_state(folded), _state(plain), strict=True):
            assert torch.equal(new, old)


def test_sdpa_decode_same_with_fold() -> None:
    outputs, states = [], []
    for fold in (False, True):
        storage, batch, rows = _setup("decodes", QuantStorage if fold else UnfoldedStorage)
        step_k = torch.cat([k[c - 1:c] for (k, _), (_, c, _) in zip(rows, CASES["decodes"],
                                                                    strict=True)])
        step_v = torch.cat([v[c - 1:c] for (_, v), (_, c, _) in zip(rows, CASES["decodes"],
                                                                    strict=True)])
        q = torch.randn(batch.num_tokens, HEADS, DIM, generator=torch.Generator().manual_seed(1))
        outputs.append(SdpaBackend().attend(0, q, step_k, step_v, storage, batch, DIM ** -0.5))
        assert storage.recent is not None
        states.append([*storage.layers[0].tensors(), storage.recent.layers[0].positions,
                       storage.recent.layers[0].rows[:, :-1]])
    assert torch.equal(outputs[1], outputs[0])
    for new, old in zip(*states, strict=True):
        assert torch.equal(new, old)


def test_batch_offers_the_window_to_decode_only_steps() -> None:
    _, decodes, _ = _setup("decodes")
    assert decodes.decode_window is not None
    assert decodes.decode_window[0] is decodes.positions
    assert decodes.decode_window[1] is decodes.token_seq_slots
    _, mixed, _ = _setup("mixed")
    assert mixed.decode_window is None
    decodes.token_seq_slots = None
    assert decodes.decode_window is None

