"""Where one decode step's GPU time goes: a kernel-time breakdown (torch.profiler) of the
forward for ``--batch`` sequences at ``--context`` tokens, Llama-3-8B shape, random weights,
Triton attention, no CUDA graph (kernel times are the same), or with ``--graph [--compile]`` the
replay of a captured (compiled) decode graph. fp16 pages hold random values;
quantized pages (``--mode q8|q6|q4``) stay zero, which costs the kernel the same work.

Prints the top kernels by total CUDA time and the share of attention vs everything else, plus
the step's floor (weights + KV bytes at the copy bandwidth measured in the same run).

    python benchmarks/profile_step.py [--batch 256] [--context 640] [--mode fp16]
"""

from __future__ import annotations

import argparse

import torch
from _common import (
    add_common_args,
    bench_config,
    copy_bandwidth,
    cuda_seconds,
    kernel_table,
    random_model,
    report,
    weight_bytes,
)

from dyngen_core.engine.plan import SequenceSlice, StepPlan
from dyngen_core.kv.attention import get_backend
from dyngen_core.kv.attention.base import build_forward_batch
from dyngen_core.kv.cache import make_storage

PAGE = 256


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_common_args(parser)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--context", type=int, default=640)
    parser.add_argument("--mode", default="fp16")
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument("--graph", action="store_true",
                        help="profile the replay of a captured decode CUDA graph")
    parser.add_argument("--compile", action="store_true",
                        help="with --graph: capture the torch.compile'd forward")
    args = parser.parse_args()
    device = torch.device(args.device)
    config = bench_config(args)
    model = random_model(config, device)
    pages_per_seq = -(-args.context // PAGE)
    storage = make_storage(args.mode, model.config, args.batch * pages_per_seq, PAGE,
                           model.dtype, model.layer_devices)
    for tensor in [t for name in ("keys", "values") for t in getattr(storage, name, [])]:
        tensor.normal_()
    slices = [SequenceSlice(job_id=i, token_ids=[1000 + i], start_pos=args.context - 1,
                            page_table=list(range(i * pages_per_seq, (i + 1) * pages_per_seq)),
                            sample=True) for i in range(args.batch)]
    batch = build_forward_batch(StepPlan(slices=slices), PAGE, device)
    backend = get_backend("triton" if device.type == "cuda" else "sdpa", device)

    def step() -> torch.Tensor:
        return model.forward(batch, storage, backend)

    if args.graph:
        from dyngen_core.runtime.graphs import DecodeGraphs

        graphs = DecodeGraphs(model, storage, backend, page_size=PAGE,
                              max_context=pages_per_seq * PAGE, max_batch_size=args.batch,
                              buckets=[args.batch], compile_model=args.compile)
        plan = StepPlan(slices=slices)

        def step() -> torch.Tensor:
            return graphs.run(plan)

    seconds = cuda_seconds(step, repeats=10)
    kv_bytes = (args.batch * args.context * model.config.num_layers * 2
                * model.config.num_kv_heads * model.config.head_dim * 2)
    floor = (weight_bytes(model) + kv_bytes) / copy_bandwidth(device)
    report("profile_step", batch=args.batch, context=args.context, mode=args.mode,
           graph=args.graph, compiled=args.compile,
           step_ms=seconds * 1e3, floor_ms=floor * 1e3, fraction=floor / seconds)
    kernel_table(step, f"{args.mode} batch {args.batch} at {args.context}", top=args.top)

if __name__ == "__main__":
    main()
