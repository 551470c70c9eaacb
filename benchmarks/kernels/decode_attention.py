"""Per-layer decode attention of the Triton paged backend over fp16 pages (`attend`: the step's
key/value write, attention, split merge), timed the way a decode step runs it: 32 layer calls
captured in one CUDA graph (launch gaps included), us per call = replay time / 32, median of
replays.

Variants (``--variants``; each a set of kernel constants, `constants.MODULES`):

- ``default``: the backend as the engine runs it (write and merge in the attention kernel up to
  `decode.IN_KERNEL_MAX_SEQS` sequences, page ids `decode.PAGE_WINDOW` pages ahead);
- ``two-launch``: at every batch size, the storage's write launch, attention and a merge
  launch (`merge.combine_splits_kernel`);
- ``in-kernel``: at every batch size, write and merge inside the attention kernel (one launch
  a layer): with ``two-launch``, the two sides of `decode.IN_KERNEL_MAX_SEQS`;
- ``per-tile``: each key tile loads its page ids inside the loop (``decode.PAGE_WINDOW=0``).

Llama-3-8B shape (32 query heads, 8 KV heads, head_dim 128), bf16 256-token pages, every
sequence decoding at the same context; batches 1, 4, 32, 256 x contexts 640, 4k, 16k. The calls
cycle over enough distinct layers that the pages they read exceed the 50 MB L2 three times over.

Floors (H200: 4.25 TB/s copy, 780 TFLOP/s bf16): KV bytes per call = batch x context x 4096
(keys and values, 8 heads x 128 x 2 bytes each); FLOPs = batch x context x 16384.

    batch  ctx 640    ctx 4k     ctx 16k     (bytes floor; the FLOPs floor is ~45x lower)
    1      0.62 us    3.9 us     15.8 us
    4      2.5 us     15.8 us    63 us
    32     19.7 us    126 us     505 us
    256    158 us     1010 us    4040 us

    python benchmarks/kernels/decode_attention.py [--variants default,two-launch,...]
        [--batches 1,4,32,256] [--contexts 640,4096,16384] [--set MODULE.NAME=VALUE]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks._common import cuda_seconds, device_name, report  # noqa: E402
from benchmarks.kernels import constants  # noqa: E402
from dyngen_core.config import ModelConfig  # noqa: E402
from dyngen_core.engine.plan import SequenceSlice, StepPlan  # noqa: E402
from dyngen_core.kv.attention.base import ForwardBatch, build_forward_batch  # noqa: E402
from dyngen_core.kv.attention.triton.decode import decode_splits  # noqa: E402
from dyngen_core.kv.attention.triton.paged import TritonPagedBackend  # noqa: E402
from dyngen_core.kv.fp16 import FP16Storage  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, PAGE = 32, 8, 128, 256
CALLS = 32  # layer calls per captured graph
L2_BYTES = 50 << 20
COPY_RATE, MATMUL_RATE = 4.25e12, 780e12
# Variant name -> kernel constants it sets (`constants.patched`); the first is the baseline.
VARIANTS: dict[str, list[str]] = {
    "default": [],
    "two-launch": ["decode.IN_KERNEL_MAX_SEQS=0"],
    "in-kernel": ["decode.IN_KERNEL_MAX_SEQS=1048576"],
    "per-tile": ["decode.PAGE_WINDOW=0"],
}


def kv_bytes(batch: int, context: int) -> int:
    return batch * context * KV_HEADS * HEAD_DIM * 2 * 2


def make_case(batch: int, context: int, device: torch.device
              ) -> tuple[FP16Storage, ForwardBatch, torch.Tensor, int]:
    """Random pages for ``layers`` distinct layers, the decode batch, the queries."""
    layers = max(1, min(CALLS, -(-3 * L2_BYTES // kv_bytes(batch, context))))
    pages_per_seq = -(-context // PAGE)
    config = ModelConfig(architecture="LlamaForCausalLM", vocab_size=32,
                         hidden_size=HEADS * HEAD_DIM, intermediate_size=64, num_layers=layers,
                         num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM)
    storage = FP16Storage(config, batch * pages_per_seq, PAGE, torch.bfloat16,
                          [device] * layers)
    for layer in range(layers):
        storage.keys[layer].normal_()
        storage.values[layer].normal_()
    slices = [SequenceSlice(i, [1], context - 1,
                            list(range(i * pages_per_seq, (i + 1) * pages_per_seq)), True)
              for i in range(batch)]
    forward = build_forward_batch(StepPlan(slices), PAGE, device)
    q = torch.randn(batch, HEADS + 2 * KV_HEADS, HEAD_DIM, device=device, dtype=torch.bfloat16)
    return storage, forward, q, layers


def graph_us_per_call(backend: TritonPagedBackend, storage: FP16Storage, batch: ForwardBatch,
                      q: torch.Tensor, layers: int, replays: int = 10
                      ) -> tuple[float, torch.Tensor]:
    """Median us per call over replays of a graph of CALLS calls; and layer 0's output.
    ``q``: a fused projection [T, H + 2 Hkv, D], whose key and value columns are written."""
    scale = HEAD_DIM ** -0.5
    query, k, v = q[:, :HEADS], q[:, HEADS:HEADS + KV_HEADS], q[:, HEADS + KV_HEADS:]

    def calls() -> list[torch.Tensor]:
        return [backend.attend(i % layers, query, k, v, storage, batch, scale)
                for i in range(CALLS)]

    calls()  # compiles, allocates the merge counters
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = calls()
    us = cuda_seconds(graph.replay, replays, warmup=2) * 1e6 / CALLS
    del graph
    return us, outs[0].clone()


def run_case(names: list[str], batch: int, context: int, device: torch.device
             ) -> dict[str, Any]:
    storage, forward, q, layers = make_case(batch, context, device)
    row: dict[str, Any] = {"batch": batch, "context": context,
                           "splits": decode_splits(batch * KV_HEADS, device),
                           "floor_us": max(kv_bytes(batch, context) / COPY_RATE,
                                           batch * context * 16384 / MATMUL_RATE) * 1e6,
                           "counters_zero": True}
    outputs: dict[str, torch.Tensor] = {}
    for name in names:
        with constants.patched(VARIANTS[name]):
            backend = TritonPagedBackend(cascade_min_saved_keys=None)
            row[name], outputs[name] = graph_us_per_call(backend, storage, forward, q, layers)
        row["counters_zero"] = row["counters_zero"] and all(
            int(c.abs().sum()) == 0 for c in backend.split_counters.held(device))
    ref = outputs[names[0]].float()
    row["max_rel_diff"] = max(float((outputs[name].float() - ref).norm() / ref.norm())
                              for name in names)
    report("decode_attention", device=device_name(), layers=layers, **row)
    del storage
    torch.cuda.empty_cache()
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--batches", default="1,4,32,256")
    parser.add_argument("--contexts", default="640,4096,16384")
    constants.add_argument(parser)
    args = parser.parse_args()
    constants.apply(args.set)
    names = args.variants.split(",")
    unknown = [name for name in names if name not in VARIANTS]
    if unknown:
        raise SystemExit(f"unknown variants {unknown}; choose from {', '.join(VARIANTS)}")
    device = torch.device("cuda", torch.cuda.current_device())
    rows = [run_case(names, b, c, device) for b in map(int, args.batches.split(","))
            for c in map(int, args.contexts.split(","))]
    print_table(rows, names)


def print_table(rows: list[dict[str, Any]], names: list[str]) -> None:
    """The compact table: us per call of every variant, the first's bandwidth (KV bytes /
    time)."""
    width = max(11, *(len(n) + 1 for n in names))
    print(f"\n{'batch':>5} {'ctx':>6} {'splits':>6} {'floor':>8}"
          + "".join(f"{n:>{width}}" for n in names)
          + f" {'TB/s':>6} {'rel diff':>9} counters0")
    for r in rows:
        rate = kv_bytes(r["batch"], r["context"]) / (r[names[0]] * 1e-6) / 1e12
        print(f"{r['batch']:>5} {r['context']:>6} {r['splits']:>6} {r['floor_us']:>8.2f}"
              + "".join(f"{r[n]:>{width}.2f}" for n in names)
              + f" {rate:>6.2f} {r['max_rel_diff']:>9.1e} {r['counters_zero']}")
    print(f"(us per layer call (write + attention + merge) inside a 32-call CUDA graph; floor: "
          f"KV bytes at 4.25 TB/s; TB/s: KV bytes / {names[0]}'s time)")


if __name__ == "__main__":
    main()
