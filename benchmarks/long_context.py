"""Decode at 16k context, batch 1 and 32, with fp16, q8 and q4 caches: tok/s per mode.

The cache is filled with random keys/values (codes and scales for quantized modes) instead of
prefilling 16k-token prompts: decode cost does not depend on the values, and it keeps the run
short. Each step is one decode of every sequence, replayed from its CUDA graph through the
runner (sampling and scheduling excluded). Target: q4 at least as fast as fp16.

    python benchmarks/long_context.py [--layers 32] [--context 16384] [--batches 1,32]
        [--modes fp16,q8,q4] [--recent-window N] [--profile BATCH] [--set MODULE.NAME=VALUE]

``--recent-window``: the quantized caches' recent window (`Cache(recent_window=...)`; default:
each mode's own, 0 for q8 and 16 for q4), e.g. 16 to time q8 with exact recent rows.

``--set``: run with a kernel constant patched (benchmarks/kernels/constants.py), e.g.
``--set quant_decode.ONE_LAUNCH_MAX_SEQS=0``.
"""

from __future__ import annotations

import argparse
import time
from functools import partial
from typing import Any

import torch
from _common import (
    add_common_args,
    bench_config,
    copy_bandwidth,
    device_name,
    free_memory,
    kernel_table,
    random_model,
    report,
    synchronize,
    weight_bytes,
)

from benchmarks.kernels import constants
from dyngen_core import Cache
from dyngen_core.engine.plan import SequenceSlice, StepPlan
from dyngen_core.kv.attention import get_backend
from dyngen_core.runtime.runner import ModelRunner

MODES = ("fp16", "q8", "q4")


def fill_random(cache: Cache) -> None:
    """Random contents for every page: normal values, or random codes with small scales."""
    storage: Any = cache.storage
    if cache.mode == "fp16":
        for tensor in (*storage.keys, *storage.values):
            tensor.normal_()
        return
    for layer in storage.layers:
        for codes in (layer.key_codes, layer.value_codes):
            codes.view(torch.uint8).random_(0, 256)
        for scales in (layer.key_scales, layer.value_scales):
            scales.uniform_(0.01, 0.05)


def decode_seconds(runner: ModelRunner, batch: int, context: int, pages_per_seq: int,
                   steps: int) -> float:
    plan = StepPlan([SequenceSlice(i, [1000 + i], context - 1,
                                   list(range(i * pages_per_seq, (i + 1) * pages_per_seq)),
                                   sample=True) for i in range(batch)])
    assert runner.graphs is not None and runner.graphs.can_run(plan)
    for _ in range(3):
        runner.run(plan)
    synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        runner.run(plan)
    synchronize()
    return (time.perf_counter() - start) / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    add_common_args(parser)
    parser.add_argument("--context", type=int, default=16384)
    parser.add_argument("--batches", default="1,32")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--modes", default=",".join(MODES), help="cache modes to run")
    parser.add_argument("--recent-window", type=int, default=None,
                        help="quantized caches' recent window (default: the mode's own)")
    parser.add_argument("--profile", type=int, default=0, metavar="BATCH",
                        help="print each mode's top kernels of a step at this batch size")
    constants.add_argument(parser)
    args = parser.parse_args()
    constants.apply(args.set)
    batches = [int(b) for b in args.batches.split(",")]
    device = torch.device(args.device)
    config = bench_config(args)
    bandwidth = copy_bandwidth(device)
    model = random_model(config, device)
    weights = weight_bytes(model)
    report("long_context.setup", device=device_name(), layers=config["num_hidden_layers"],
           context=args.context, copy_GBps=bandwidth / 1e9, weight_GB=weights / 1e9)
    rates: dict[tuple[str, int], float] = {}
    for mode in args.modes.split(","):
        window = {} if mode == "fp16" or args.recent_window is None else {
            "recent_window": args.recent_window}
        cache = Cache(model, max_tokens=max(batches) * args.context, mode=mode, **window)
        fill_random(cache)
        pages_per_seq = args.context // cache.page_size
        kv_bytes = cache.nbytes() / cache.max_tokens
        runner = ModelRunner(model, cache, get_backend("triton", device),
                             max_batch_size=max(batches))
        for batch in batches:
            seconds = decode_seconds(runner, batch, args.context, pages_per_seq, args.steps)
            rates[(mode, batch)] = batch / seconds
            floor = (weights + batch * args.context * kv_bytes) / bandwidth
            report("long_context.decode", mode=mode, batch=batch, settings=args.set,
                   recent_window=args.recent_window,
                   step_ms=seconds * 1e3, tok_s=batch / seconds,
                   roofline_fraction=floor / seconds, cache_GB=cache.nbytes() / 1e9)
            if batch == args.profile:
                kernel_table(partial(decode_seconds, runner, batch, args.context,
                                     pages_per_seq, 1), f"{mode} batch {batch}")
        del runner
        free_memory()
        del cache
        free_memory()
    for batch in batches:
        if ("q4", batch) in rates and ("fp16", batch) in rates:
            report("long_context.q4_over_fp16", batch=batch,
                   ratio=rates[("q4", batch)] / rates[("fp16", batch)])


if __name__ == "__main__":
    main()
