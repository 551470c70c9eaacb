"""Which write the unquantized storage uses (`fp16.storage`), and the torch write that is the
CPU path and the oracle of the Triton one (tests/gpu/test_fp16_write_triton.py)."""

from __future__ import annotations

import pytest
import torch

from dyngen_core.config import ModelConfig
from dyngen_core.kv.fp16 import FP16Storage
from dyngen_core.ops.triton_support import triton_by_default

CONFIG = ModelConfig(architecture="LlamaForCausalLM", vocab_size=32, hidden_size=48,
                     intermediate_size=64, num_layers=2, num_heads=3, num_kv_heads=3,
                     head_dim=16)
CPU = torch.device("cpu")


def test_torch_write_puts_each_row_at_its_page_and_offset() -> None:
    storage = FP16Storage(CONFIG, 4, 8, torch.bfloat16, [CPU] * 2)
    qkv = torch.randn(3, 3 * 48)
    key = torch.randn(3, 3, 16)
    value = qkv[:, 96:].view(3, 3, 16)  # strided, as the fused projection leaves it
    storage.write(1, key, value, torch.tensor([8 * 2 + 5, 0, 31]))
    for row, (page, offset) in enumerate([(2, 5), (0, 0), (3, 7)]):
        assert torch.equal(storage.keys[1][page, offset], key[row].to(torch.bfloat16))
        assert torch.equal(storage.values[1][page, offset], value[row].to(torch.bfloat16))
    assert storage.keys[0].count_nonzero() == 0
    assert storage.keys[1].count_nonzero() == 3 * 48


def test_cpu_storage_writes_with_torch_by_default() -> None:
    """The torch write raises on a slot outside the cache (the Triton one would skip it)."""
    assert not triton_by_default(CPU)
    storage = FP16Storage(CONFIG, 4, 8, torch.float32, [CPU] * 2)
    rows = torch.zeros(1, 3, 16)
    with pytest.raises(IndexError):
        storage.write(0, rows, rows, torch.tensor([-1]))


def test_triton_write_refused_where_it_cannot_run(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="triton_write=True"):
        FP16Storage(CONFIG, 4, 8, torch.float32, [CPU] * 2, triton_write=True)
