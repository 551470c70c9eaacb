"""The one-launch Triton write of the unquantized storage (`fp16.storage`) stores exactly
what the torch write (two ``index_copy_``) stores: any token count, head shapes that are not
powers of two, dtype conversion, value rows strided as the fused qkv projection leaves them,
int32 slots, repeated slots (CUDA-graph padding rows), and slots outside the cache (written
nowhere). On CUDA it is also captured in a CUDA graph and replayed with new rows and slots."""

from __future__ import annotations

import pytest
import torch

from dyngen_core.config import ModelConfig
from dyngen_core.kv.fp16 import FP16Storage

pytestmark = pytest.mark.gpu

PAGES, PAGE = 8, 16
SLOTS = PAGES * PAGE


def _storages(heads: int, dim: int, dtype: torch.dtype,
              device: torch.device) -> tuple[FP16Storage, FP16Storage]:
    """(Triton-written, torch-written) storages of 2 layers, equally filled with noise."""
    config = ModelConfig(architecture="LlamaForCausalLM", vocab_size=32,
                         hidden_size=heads * dim, intermediate_size=64, num_layers=2,
                         num_heads=heads, num_kv_heads=heads, head_dim=dim)
    pair = (FP16Storage(config, PAGES, PAGE, dtype, [device] * 2, triton_write=True),
            FP16Storage(config, PAGES, PAGE, dtype, [device] * 2, triton_write=False))
    gen = torch.Generator().manual_seed(heads * dim)
    for layer in range(2):
        for tensors in (pair[0].keys, pair[0].values):
            tensors[layer].copy_(torch.randn(tensors[layer].shape, generator=gen))
        pair[1].keys[layer].copy_(pair[0].keys[layer])
        pair[1].values[layer].copy_(pair[0].values[layer])
    return pair


def _rows(tokens: int, heads: int, dim: int, dtype: torch.dtype, device: torch.device,
          seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Key and value rows [T, H, D] as strided views: values as the fused qkv projection
    leaves them, keys with padding between heads too (only the last dimension contiguous)."""
    gen = torch.Generator().manual_seed(seed)
    qkv = torch.randn(tokens, 3 * heads * dim, generator=gen, dtype=dtype).to(device)
    padded = torch.randn(tokens, heads + 1, dim + 8, generator=gen, dtype=dtype).to(device)
    return padded[:, 1:, :dim], qkv[:, 2 * heads * dim:].view(tokens, heads, dim)


def _assert_same(triton_written: FP16Storage, torch_written: FP16Storage) -> None:
    for layer in range(2):
        assert torch.equal(triton_written.keys[layer], torch_written.keys[layer])
        assert torch.equal(triton_written.values[layer], torch_written.values[layer])


@pytest.mark.parametrize(("tokens", "heads", "dim", "row_dtype", "cache_dtype"), [
    (1, 2, 64, torch.float32, torch.float32),
    (5, 3, 40, torch.float32, torch.bfloat16),
    (37, 2, 64, torch.float16, torch.float16),
    (SLOTS, 1, 16, torch.float32, torch.float16),
])
def test_write_matches_torch(device: torch.device, tokens: int, heads: int, dim: int,
                             row_dtype: torch.dtype, cache_dtype: torch.dtype) -> None:
    fast, oracle = _storages(heads, dim, cache_dtype, device)
    gen = torch.Generator().manual_seed(tokens)
    slots = torch.randperm(SLOTS, generator=gen)[:tokens].to(device)
    for layer in range(2):
        key, value = _rows(tokens, heads, dim, row_dtype, device, seed=layer)
        assert tokens == 1 or value.stride(0) == 3 * heads * dim  # strided, like the qkv output
        fast.write(layer, key, value, slots)
        oracle.write(layer, key, value, slots)
    _assert_same(fast, oracle)


def test_int32_and_repeated_slots(device: torch.device) -> None:
    """Padding rows of a CUDA-graph bucket repeat the last row (same data, same slot)."""
    fast, oracle = _storages(2, 32, torch.float32, device)
    key, value = _rows(4, 2, 32, torch.float32, device, seed=3)
    pad = torch.tensor([0, 1, 2, 3, 3, 3])
    key, value = key[pad], value[pad]
    slots = torch.tensor([17, 3, 100, 64, 64, 64])
    fast.write(1, key, value, slots.to(device, torch.int32))
    oracle.write(1, key, value, slots.to(device))
    _assert_same(fast, oracle)


def test_slots_outside_the_cache_write_nothing(device: torch.device) -> None:
    fast, oracle = _storages(2, 32, torch.float32, device)
    key, value = _rows(5, 2, 32, torch.float32, device, seed=4)
    slots = torch.tensor([-1, 9, SLOTS, 2**40, 70], device=device)
    fast.write(0, key, value, slots)
    keep = torch.tensor([1, 4], device=device)
    oracle.write(0, key[keep], value[keep], slots[keep])
    _assert_same(fast, oracle)


def test_write_in_a_cuda_graph(cuda_device: torch.device) -> None:
    """Captured once, replayed with new rows and slots copied into the static inputs."""
    fast, oracle = _storages(8, 128, torch.bfloat16, cuda_device)
    key, value = _rows(4, 8, 128, torch.bfloat16, cuda_device, seed=5)
    slots = torch.tensor([0, 1, 2, 3], device=cuda_device)
    fast.write(0, key, value, slots)  # compile the kernel before capturing
    oracle.write(0, key, value, slots)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fast.write(0, key, value, slots)
    for seed in (6, 7):
        new_key, new_value = _rows(4, 8, 128, torch.bfloat16, cuda_device, seed=seed)
        new_slots = torch.randperm(SLOTS, device=cuda_device)[:4]
        key.copy_(new_key)
        value.copy_(new_value)
        slots.copy_(new_slots)
        graph.replay()
        oracle.write(0, new_key, new_value, new_slots)
    torch.cuda.synchronize(cuda_device)
    _assert_same(fast, oracle)
