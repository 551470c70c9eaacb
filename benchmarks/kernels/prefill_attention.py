"""Prefill attention alone, one layer of Llama-3-8B shape (32 query heads, 8 KV heads,
head_dim 128, bf16 pages of 256 tokens): the tiled prefill kernel (`attention.triton.prefill`)
the backend takes, against the paged kernel (what it takes for short queries,
``prefill.MIN_QUERY``) and torch's dense flash SDPA (causal, no pages, K/V expanded to every
head) as the flash-class yardstick. Other tile shapes: ``--set prefill.BLOCK_N=128`` etc.

Shapes (query tokens x sequences, causal over each sequence's pages):
  1x8030     one 8,030-token document in one chunk
  4x2048     four 2,048-token prompts
  256x512    benchmarks/throughput.py's prefill
  64x30@8030 64 questions of 30 tokens over an 8,030-token cached document (full pages
             shared by every page table, as prefix dedup leaves them)
  64x4@8030  the same with 4-token chunks (draft verification): the smallest tiles

Floors (H200: 780 TFLOP/s bf16 matmul, 4.25 TB/s copy), one layer, FLOPs = 4 x H x D x
(keys seen, summed over query tokens), bytes = q + out + K/V read once:
  1x8030     5.28e11 FLOP -> 677 us;  164 MB -> 39 us
  4x2048     1.37e11 FLOP -> 176 us;  168 MB -> 40 us
  256x512    5.51e11 FLOP -> 706 us;  2.68 GB -> 630 us (q and out alone are 2.1 GB)
  64x30@8030 2.53e11 FLOP -> 324 us;  96 MB -> 23 us (shared pages once, own pages each)
  64x4@8030  3.37e10 FLOP ->  43 us;  63 MB -> 15 us

    python benchmarks/kernels/prefill_attention.py [--repeats 10] [--shapes 1x8030,...]
        [--variants tiled,paged,torch-flash-dense] [--set MODULE.NAME=VALUE]

Prints one BENCH line per (shape, variant): us, TFLOP/s and the relative error against the
first variant; then a table, variants as columns (us / TFLOP/s).
"""

from __future__ import annotations

import argparse
import random
import sys
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks._common import (  # noqa: E402
    add_common_args,
    bench_config,
    cuda_seconds,
    device_name,
    report,
)
from benchmarks.kernels import constants  # noqa: E402
from dyngen_core.config import ModelConfig  # noqa: E402
from dyngen_core.engine.plan import SequenceSlice, StepPlan  # noqa: E402
from dyngen_core.kv.attention.base import ForwardBatch, build_forward_batch  # noqa: E402
from dyngen_core.kv.attention.triton.paged import TritonPagedBackend  # noqa: E402
from dyngen_core.kv.fp16 import FP16Storage  # noqa: E402

PAGE = 256
SHAPES = ("1x8030", "4x2048", "256x512", "64x30@8030", "64x4@8030")
# Variant name -> kernel constants it sets (`constants.patched`); the first is the reference
# of the error column.
VARIANTS: dict[str, list[str]] = {
    "tiled": [],
    "paged": ["prefill.MIN_QUERY=1048576"],
}


def shape_lens(shape: str) -> tuple[list[tuple[int, int]], int]:
    """(query tokens, context after the step) per sequence, and the shared prefix's full
    pages (0: none)."""
    if "@" in shape:
        head, prefix = shape.split("@")
        count, qlen = (int(x) for x in head.split("x"))
        return [(qlen, int(prefix) + qlen)] * count, int(prefix) // PAGE
    count, qlen = (int(x) for x in shape.split("x"))
    return [(qlen, qlen)] * count, 0


def build_case(config: dict[str, Any], lens: list[tuple[int, int]], shared_pages: int,
               copies: int, device: torch.device
               ) -> tuple[FP16Storage, ForwardBatch, list[torch.Tensor]]:
    """Pages (``copies`` layers of random K/V, shuffled page order), the batch and ``copies``
    random query tensors (rotated between calls so the L2 holds none of them)."""
    own = [-(-ctx // PAGE) - shared_pages for _, ctx in lens]
    num_pages = shared_pages + sum(own) + 1
    shape = ModelConfig.from_dict({**config, "num_hidden_layers": copies})
    storage = FP16Storage(shape, num_pages, PAGE, torch.bfloat16, [device] * copies)
    for layer in range(copies):
        storage.keys[layer].normal_()
        storage.values[layer].normal_()
    order = list(range(1, num_pages))
    random.Random(0).shuffle(order)
    shared, used, slices = order[:shared_pages], shared_pages, []
    for index, ((qlen, ctx), count) in enumerate(zip(lens, own, strict=True)):
        table = shared + order[used:used + count]
        used += count
        slices.append(SequenceSlice(index, [1] * qlen, ctx - qlen, table, True))
    batch = build_forward_batch(StepPlan(slices), PAGE, device)
    heads, head_dim = config["num_attention_heads"], config["head_dim"]
    queries = [torch.randn(batch.num_tokens, heads, head_dim, device=device,
                           dtype=torch.bfloat16) for _ in range(copies)]
    return storage, batch, queries


def causal_flops(lens: list[tuple[int, int]], heads: int, head_dim: int) -> float:
    """4 x heads x head_dim per (query, visible key) pair: QK^T and PV."""
    pairs = sum(qlen * (ctx - qlen) + qlen * (qlen + 1) // 2 for qlen, ctx in lens)
    return 4.0 * heads * head_dim * pairs


def rotating(fns: list[Callable[[], torch.Tensor]]) -> Callable[[], torch.Tensor]:
    """One call per invocation, cycling through ``fns`` (each on its own copy of the data)."""
    state = {"next": 0}

    def call() -> torch.Tensor:
        fn = fns[state["next"] % len(fns)]
        state["next"] += 1
        return fn()

    return call


def dense_flash(lens: list[tuple[int, int]], config: dict[str, Any],
                device: torch.device) -> Callable[[], torch.Tensor] | None:
    """torch's flash SDPA on dense [B, H, T, D] tensors (equal-length prompts, no cached
    context only); None where that does not apply or the flash kernel is unavailable."""
    if any(q != c for q, c in lens) or len({q for q, _ in lens}) != 1:
        return None
    from torch.nn.attention import SDPBackend, sdpa_kernel

    heads, head_dim = config["num_attention_heads"], config["head_dim"]
    count, length = len(lens), lens[0][0]
    q, k, v = (torch.randn(count, heads, length, head_dim, device=device, dtype=torch.bfloat16)
               for _ in range(3))

    def call() -> torch.Tensor:
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    try:
        call()
    except RuntimeError:
        return None
    return call


def run_shape(shape: str, config: dict[str, Any], device: torch.device, repeats: int,
              variants: list[str]) -> dict[str, tuple[float, float]]:
    """The ``variants`` on one shape: {variant: (us, TFLOP/s)}; errors are against the
    first of them."""
    lens, shared_pages = shape_lens(shape)
    tokens = sum(q for q, _ in lens)
    kv_bytes = sum(c for _, c in lens) * config["num_key_value_heads"] * config["head_dim"] * 4
    q_bytes = tokens * config["num_attention_heads"] * config["head_dim"] * 2
    copies = max(1, min(4, -(-150_000_000 // (2 * q_bytes + kv_bytes))))
    storage, batch, queries = build_case(config, lens, shared_pages, copies, device)
    flops = causal_flops(lens, config["num_attention_heads"], config["head_dim"])
    scale = config["head_dim"] ** -0.5
    results: dict[str, tuple[float, float]] = {}
    reference: torch.Tensor | None = None
    for name, settings in VARIANTS.items():
        if name not in variants:
            continue
        with constants.patched(settings):
            backend = TritonPagedBackend()
            out = backend.attend_cached(0, queries[0], storage, batch, scale).float()
        reference = out if reference is None else reference
        error = float((out - reference).norm() / reference.norm())
        report_name = "rel_error_vs_" + variants[0]
        del out
        with constants.patched(settings):
            seconds = cuda_seconds(rotating([
                partial(backend.attend_cached, layer, queries[layer], storage, batch, scale)
                for layer in range(copies)]), repeats=repeats, warmup=2)
        results[name] = (seconds * 1e6, flops / seconds / 1e12)
        report("prefill_attention", device=device_name(), shape=shape, variant=name,
               us=seconds * 1e6, tflops=flops / seconds / 1e12, **{report_name: error})
    dense = dense_flash(lens, config, device) if "torch-flash-dense" in variants else None
    if dense is not None:
        seconds = cuda_seconds(dense, repeats=repeats, warmup=2)
        results["torch-flash-dense"] = (seconds * 1e6, flops / seconds / 1e12)
        report("prefill_attention", device=device_name(), shape=shape,
               variant="torch-flash-dense", us=seconds * 1e6, tflops=flops / seconds / 1e12)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_common_args(parser)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--variants", default=",".join([*VARIANTS, "torch-flash-dense"]))
    constants.add_argument(parser)
    args = parser.parse_args()
    constants.apply(args.set)
    device = torch.device(args.device)
    config = bench_config(args)
    columns = args.variants.split(",")
    table = {shape: run_shape(shape, config, device, args.repeats, columns)
             for shape in args.shapes.split(",")}
    print(f"{'shape':12}" + "".join(f"{c:>20}" for c in columns))
    for shape, results in table.items():
        cells = [f"{results[c][0]:9.0f} /{results[c][1]:6.0f}" if c in results else "-"
                 for c in columns]
        print(f"{shape:12}" + "".join(f"{cell:>20}" for cell in cells))
    print("cells: median us of one layer / TFLOP/s (causal FLOPs); '-': not run")


if __name__ == "__main__":
    main()
