"""The quantized storage's per-layer decode write (`quant.write`: one Triton launch per layer,
which also stores a decode-only step's window rows) against its torch twin (the CPU path run on
the GPU: ``triton_write=False``), Llama-3-8B's KV shape (8 KV heads x 128 dims, bf16, 256-slot
pages), key offsets set (as `Cache` sets them).

Per layer the backend calls ``storage.write`` (with the step's decode window), then
(attention's exact operands) ``storage.exact_rows``, then ``storage.write_recent``; each figure
is a CUDA graph of those calls for all 32 layers (every layer's pages apart, as in a step),
replayed, median over the replays, divided by 32: ``triton_us`` / ``torch_us`` per layer, with
the recent window (``w16``, the q4 default, sequences reserved as the runner does) and without
(``w0``). Rows are views as the model leaves them (keys of the rotary output, values of the
fused qkv projection); each sequence writes at a random position of its own page run; batch 1
lands on a page head. ``code_diff``: the fraction of code bytes the two writes store
differently (the butterfly and the matrix product round differently on boundaries).

Floors (H200: 4.25 TB/s copy, bytes read + written; FLOPs negligible): batch 256 moves about
1 MB of rows in, 0.3 MB of codes and scales out, 1 MB of exact rows and 2 MB through the window
per layer, about 1 us; batch 1 and 32 move under 150 kB: a launch's latency (2-3 us per kernel
in a graph) is the floor.

    python benchmarks/kernels/quant_write.py [--batch 1 32 256] [--modes q4] [--windows 16 0]
                                             [--repeats 30]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks._common import cuda_seconds, device_name, report  # noqa: E402
from dyngen_core.config import ModelConfig  # noqa: E402
from dyngen_core.kv.quant.storage import QuantStorage  # noqa: E402

HEADS, KV_HEADS, DIM, LAYERS, PAGE = 32, 8, 128, 32, 256
PAGES_PER_SEQ = 2


def _storage(mode: str, batch: int, window: int, triton_write: bool,
             device: torch.device) -> QuantStorage:
    config = ModelConfig(architecture="LlamaForCausalLM", vocab_size=128256, hidden_size=4096,
                         intermediate_size=14336, num_layers=LAYERS, num_heads=HEADS,
                         num_kv_heads=KV_HEADS, head_dim=DIM)
    storage = QuantStorage(config, batch * PAGES_PER_SEQ, PAGE, torch.bfloat16,
                           [device] * LAYERS, mode, recent_window=window,
                           triton_write=triton_write)
    gen = torch.Generator(device=device).manual_seed(1)
    storage.set_key_offsets([torch.randn(KV_HEADS, DIM, device=device, generator=gen)
                             for _ in range(LAYERS)])
    storage.reserve_sequences(batch)
    return storage


def _inputs(batch: int, device: torch.device) -> dict[str, torch.Tensor]:
    """Key/value views as the model makes them, slots, positions and sequence slots."""
    gen = torch.Generator(device=device).manual_seed(batch)
    rotary = torch.randn(batch, HEADS + KV_HEADS, DIM, device=device, dtype=torch.bfloat16,
                         generator=gen) * 3
    qkv = torch.randn(batch, (HEADS + 2 * KV_HEADS) * DIM, device=device,
                      dtype=torch.bfloat16, generator=gen)
    positions = torch.randint(0, PAGES_PER_SEQ * PAGE, (batch,), device=device, generator=gen)
    if batch == 1:
        positions.fill_(PAGE)  # a page head
    seqs = torch.arange(batch, device=device)
    slots = (seqs * PAGES_PER_SEQ + positions // PAGE) * PAGE + positions % PAGE
    return {"key": rotary[:, HEADS:],
            "value": qkv[:, (HEADS + KV_HEADS) * DIM:].view(batch, KV_HEADS, DIM),
            "slots": slots, "positions": positions.to(torch.int32),
            "seq_slots": seqs.to(torch.int32)}


def _step(storage: QuantStorage, rows: dict[str, torch.Tensor]) -> None:
    """Every layer's write as a decode-only step's backend calls it."""
    key, value = rows["key"], rows["value"]
    for layer in range(LAYERS):
        storage.write(layer, key, value, rows["slots"],
                      decode_window=(rows["positions"], rows["seq_slots"]))
        storage.exact_rows(layer, key, value)
        storage.write_recent(layer, key, value, rows["positions"], rows["seq_slots"])


def _graph_us(storage: QuantStorage, rows: dict[str, torch.Tensor], repeats: int) -> float:
    _step(storage, rows)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        _step(storage, rows)
    return cuda_seconds(graph.replay, repeats, warmup=3) * 1e6 / LAYERS


def _code_diff(a: QuantStorage, b: QuantStorage) -> float:
    """Fraction of code bytes of layer 0 that differ between two storages."""
    pairs = ((a.layers[0].key_codes, b.layers[0].key_codes),
             (a.layers[0].value_codes, b.layers[0].value_codes))
    differ = sum(int((x.view(torch.uint8) != y.view(torch.uint8)).sum()) for x, y in pairs)
    return differ / sum(x.numel() for x, _ in pairs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 32, 256])
    parser.add_argument("--modes", nargs="+", default=["q4"])
    parser.add_argument("--windows", type=int, nargs="+", default=[16, 0])
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    device = torch.device("cuda", torch.cuda.current_device())
    print(f"{'mode':5} {'window':>6} {'batch':>6} {'triton us':>10} {'torch us':>9} "
          f"{'code_diff':>10}")
    for mode in args.modes:
        for window in args.windows:
            for batch in args.batch:
                rows = _inputs(batch, device)
                fast = _storage(mode, batch, window, True, device)
                twin = _storage(mode, batch, window, False, device)
                triton_us, torch_us = _graph_us(fast, rows, args.repeats), _graph_us(
                    twin, rows, args.repeats)
                diff = _code_diff(fast, twin)
                report("quant_write", device=device_name(), mode=mode, window=window,
                       batch=batch, triton_us=triton_us, torch_us=torch_us, code_diff=diff)
                print(f"{mode:5} {window:>6} {batch:>6} {triton_us:>10.2f} {torch_us:>9.2f} "
                      f"{diff:>10.1e}")
                del fast, twin
                torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
