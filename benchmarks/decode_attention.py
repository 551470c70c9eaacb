"""Per-layer decode attention of the Triton paged backend (`attend`: the step's key/value write,
attention, split merge), timed the way a decode step runs it: 32 layer calls captured in one
CUDA graph (launch gaps included), us per call = replay time / 32, median of replays.

Two studies (``--study``):

- ``loop`` (default): the decode key loop (`DecodeOptions`), the backend's defaults
  otherwise. "old": each tile loads its page ids inside the loop (Triton 3.6 then waits for
  every tile copy each step, ``async_wait {num = 0}``: a batch-1 16k decode read 67 MB at
  2.2 TB/s); "pwN": the page ids of N pages loaded ahead of their tiles, so the tile copies
  pipeline (``page_window=N``); "pwN s4": that at 4 pipeline stages (one more tile in flight,
  ~33 KB more shared memory a program); "pw4 s4 64sp": that with ``max_splits=64`` (batch 1
  only). Goal: batch 1 at 16k toward its 15.8 us floor, no loss at batch 32 / 256.
- ``merge``: the launches of a layer, at every batch size (``in_kernel_max_seqs`` unbounded):
  the storage's write launch, attention and a merge launch ("two-launch",
  `combine_splits_kernel`); the merge inside the attention kernel ("merged"); the write
  inside it too ("merged+write", one launch per layer); that with ``merge_rows=128``
  ("+w r128": the merge reads 32 splits in one round of loads, not two).

Llama-3-8B shape (32 query heads, 8 KV heads, head_dim 128), bf16 256-token pages, every
sequence decoding at the same context; batches 1, 4, 32, 256 x contexts 640, 4k, 16k. The
calls cycle over enough distinct layers that the pages they read exceed the 50 MB L2 three
times over (a batch-1 640-token layer is 2.6 MB: the cache would otherwise serve it).

Floors (H200: 4.25 TB/s copy, 780 TFLOP/s bf16): KV bytes per call = batch x context x 4096
(keys and values, 8 heads x 128 x 2 bytes each); FLOPs = batch x context x 16384.

    batch  ctx 640    ctx 4k     ctx 16k     (bytes floor; the FLOPs floor is ~45x lower)
    1      0.62 us    3.9 us     15.8 us
    4      2.5 us     15.8 us    63 us
    32     19.7 us    126 us     505 us
    256    158 us     1010 us    4040 us

At batch 1-8 the call is latency bound (a few microseconds of launch and merge).

    python benchmarks/decode_attention.py [--study loop|merge] [--batches 1,4,32,256]
                                          [--contexts 640,4096,16384]
"""

from __future__ import annotations

import argparse
from typing import Any

import torch
from _common import cuda_seconds, device_name, report

from dyngen_core.config import ModelConfig
from dyngen_core.engine.plan import SequenceSlice, StepPlan
from dyngen_core.kv.attention.base import ForwardBatch, build_forward_batch
from dyngen_core.kv.attention.triton.decode_options import DecodeOptions
from dyngen_core.kv.attention.triton.paged import TritonPagedBackend
from dyngen_core.kv.fp16.storage import FP16Storage

HEADS, KV_HEADS, HEAD_DIM, PAGE = 32, 8, 128, 256
CALLS = 32  # layer calls per captured graph
L2_BYTES = 50 << 20
COPY_RATE, MATMUL_RATE = 4.25e12, 780e12
Variants = dict[str, tuple[dict[str, Any], tuple[str, int] | None]]
# Per study: name -> (backend options, the variant it equals when the batch's split count is
# at most the number given: its launches are then the very same, so it is not timed again).
# The first variant is the baseline the others are compared with.
STUDIES: dict[str, Variants] = {
    "loop": {
        "old": ({}, None),
        "pw4": ({"decode_options": DecodeOptions(page_window=4)}, None),
        "pw16": ({"decode_options": DecodeOptions(page_window=16)}, None),
        "pw4 s4": ({"decode_options": DecodeOptions(page_window=4, stages=4)}, None),
        "pw16 s4": ({"decode_options": DecodeOptions(page_window=16, stages=4)}, None),
        # Batch 1 only (other batches split less than 32 ways): 64 splits of 4 tiles, twice
        # the programs to hide each one's latency chain, twice the partials to merge.
        "pw4 s4 64sp": ({"decode_options": DecodeOptions(page_window=4, stages=4),
                         "max_splits": 64}, ("pw4 s4", 32)),
    },
    "merge": {
        "two-launch": ({"merge_in_kernel": False, "write_in_kernel": False}, None),
        "merged": ({"merge_in_kernel": True, "write_in_kernel": False}, ("two-launch", 1)),
        "merged+write": ({"merge_in_kernel": True, "write_in_kernel": True}, None),
        # All 32 splits of a batch-1 merge in one round of loads instead of two.
        "+write r128": ({"merge_in_kernel": True, "write_in_kernel": True, "merge_rows": 128},
                        ("merged+write", 16)),
    },
}
# The merge study merges and writes in the kernel at every batch size; the loop study keeps
# the backend's default (small batches only), as the engine runs.
UNBOUNDED: dict[str, dict[str, Any]] = {"merge": {"in_kernel_max_seqs": 1 << 20}, "loop": {}}


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


def run_case(study: str, batch: int, context: int, device: torch.device) -> dict[str, Any]:
    storage, forward, q, layers = make_case(batch, context, device)
    row: dict[str, Any] = {"study": study, "batch": batch, "context": context,
                           "floor_us": max(kv_bytes(batch, context) / COPY_RATE,
                                           batch * context * 16384 / MATMUL_RATE) * 1e6,
                           "counters_zero": True}
    outputs: dict[str, torch.Tensor] = {}
    variants = STUDIES[study]
    for name, (options, same) in variants.items():
        backend = TritonPagedBackend(cascade_min_saved_keys=None, **UNBOUNDED[study],
                                     **options)
        splits = backend._decode_splits(batch * KV_HEADS, device)
        row.setdefault("splits", splits)  # the baseline's
        if same is not None and splits <= same[1]:
            row[name], outputs[name] = row[same[0]], outputs[same[0]]
            continue
        row[name], outputs[name] = graph_us_per_call(backend, storage, forward, q, layers)
        row["counters_zero"] = row["counters_zero"] and all(
            int(c.abs().sum()) == 0 for c in backend.split_counters.held(device))
    ref = outputs[next(iter(variants))].float()
    row["max_rel_diff"] = max(float((outputs[name].float() - ref).norm() / ref.norm())
                              for name in variants)
    report("decode_attention", device=device_name(), layers=layers, **row)
    del storage
    torch.cuda.empty_cache()
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--study", default="loop", choices=tuple(STUDIES))
    parser.add_argument("--batches", default="1,4,32,256")
    parser.add_argument("--contexts", default="640,4096,16384")
    args = parser.parse_args()
    device = torch.device("cuda", torch.cuda.current_device())
    rows = [run_case(args.study, b, c, device) for b in map(int, args.batches.split(","))
            for c in map(int, args.contexts.split(","))]
    print_table(rows, list(STUDIES[args.study]))


def print_table(rows: list[dict[str, Any]], names: list[str]) -> None:
    """The compact table: us per call of every variant, the best against the first (the
    baseline) and the best's bandwidth (KV bytes / time)."""
    width = max(9, *(len(n) + 1 for n in names))
    print(f"\n{'batch':>5} {'ctx':>6} {'splits':>6} {'floor':>8}"
          + "".join(f"{n:>{width}}" for n in names)
          + f" {'best':>{width}} {'x base':>7} {'TB/s':>6} {'rel diff':>9} counters0")
    for r in rows:
        best = min(names[1:] or names, key=lambda n: r[n])
        rate = kv_bytes(r["batch"], r["context"]) / (r[best] * 1e-6) / 1e12
        print(f"{r['batch']:>5} {r['context']:>6} {r['splits']:>6} {r['floor_us']:>8.2f}"
              + "".join(f"{r[n]:>{width}.2f}" for n in names)
              + f" {best:>{width}} {r[names[0]] / r[best]:>7.2f} {rate:>6.2f}"
              f" {r['max_rel_diff']:>9.1e} {r['counters_zero']}")
    print(f"(us per layer call (write + attention + merge) inside a 32-call CUDA graph; floor: "
          f"KV bytes at 4.25 TB/s; best: the fastest of {', '.join(names[1:])}; x base: "
          f"{names[0]} / best; TB/s: KV bytes / best's time)")


if __name__ == "__main__":
    main()
