"""The unquantized storage's write: two ``index_copy_`` (torch) against one Triton launch, per
layer, for Llama-3-8B's KV shape (8 KV heads x 128 dims, bf16, 256-slot pages).

Rows are laid out as the model leaves them: keys a view of the rotary output ([T, 40, 128],
heads 32..39), values a view of the fused qkv projection ([T, 6144], columns 5120..6143). Slots
fill randomly chosen pages in order, as a prefill does (T=1: one random slot, as a decode).
Each figure writes all 32 layers once (a step's worth, every layer's pages cold in L2) and
divides by 32:

- ``graph_us``: GPU time per write, replaying a CUDA graph of the 32 writes (what a captured
  decode step pays);
- ``eager_us``: wall time per write, launched one by one (host launch cost included).

``max_abs_diff`` compares every key and value the two writes stored (0 expected: a copy).

    python benchmarks/kernels/fp16_write.py [--tokens 1 256 16384] [--repeats 20]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks._common import cuda_seconds, device_name, report  # noqa: E402
from dyngen_core.config import ModelConfig  # noqa: E402
from dyngen_core.kv.fp16 import FP16Storage  # noqa: E402

HEADS, KV_HEADS, DIM, LAYERS, PAGE = 32, 8, 128, 32, 256


def _storage(pages: int, triton_write: bool, device: torch.device) -> FP16Storage:
    config = ModelConfig(architecture="LlamaForCausalLM", vocab_size=128256, hidden_size=4096,
                         intermediate_size=14336, num_layers=LAYERS, num_heads=HEADS,
                         num_kv_heads=KV_HEADS, head_dim=DIM)
    return FP16Storage(config, pages, PAGE, torch.bfloat16, [device] * LAYERS,
                       triton_write=triton_write)


def _rows(tokens: int, pages: int, device: torch.device
          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Key and value views as the model makes them, and their slots."""
    rotary = torch.randn(tokens, HEADS + KV_HEADS, DIM, device=device, dtype=torch.bfloat16)
    qkv = torch.randn(tokens, (HEADS + 2 * KV_HEADS) * DIM, device=device,
                      dtype=torch.bfloat16)
    key = rotary[:, HEADS:]
    value = qkv[:, (HEADS + KV_HEADS) * DIM:].view(tokens, KV_HEADS, DIM)
    order = torch.randperm(pages, device=device)
    positions = torch.arange(tokens, device=device)
    if tokens == 1:
        positions += int(torch.randint(PAGE, ()))
    slots = order[positions // PAGE] * PAGE + positions % PAGE
    return key, value, slots


def _write_all(storage: FP16Storage, key: torch.Tensor, value: torch.Tensor,
               slots: torch.Tensor) -> None:
    for layer in range(LAYERS):
        storage.write(layer, key, value, slots)


def _graph_us(storage: FP16Storage, rows: tuple[torch.Tensor, ...], repeats: int) -> float:
    _write_all(storage, *rows)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        _write_all(storage, *rows)
    return cuda_seconds(graph.replay, repeats, warmup=1) * 1e6 / LAYERS


def _eager_us(storage: FP16Storage, rows: tuple[torch.Tensor, ...], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        _write_all(storage, *rows)
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e6 / LAYERS)
    return sorted(times)[len(times) // 2]


def _max_abs_diff(a: FP16Storage, b: FP16Storage) -> float:
    return max(float((x.float() - y.float()).abs().max())
               for x, y in zip((*a.keys, *a.values), (*b.keys, *b.values), strict=True))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 256, 16384])
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    device = torch.device("cuda")
    pages = -(-max(args.tokens) // PAGE) * 2
    old, new = _storage(pages, False, device), _storage(pages, True, device)
    for tokens in args.tokens:
        rows = _rows(tokens, pages, device)
        figures = {}
        for name, storage in (("torch", old), ("triton", new)):
            figures[f"{name}_graph_us"] = round(_graph_us(storage, rows, args.repeats), 2)
            figures[f"{name}_eager_us"] = round(_eager_us(storage, rows, args.repeats), 2)
        report("fp16_write", device=device_name(), tokens=tokens, **figures,
               max_abs_diff=_max_abs_diff(old, new))
        torch.cuda.synchronize()


if __name__ == "__main__":
    main()
