"""The q8/q4 decode kernel alone (`quant_decode.attend_word_decode`: kernel and split combine,
operands prepared once) against the fp16 paged decode: one layer of Llama-3-8B shape (32 query
heads, 8 KV heads, head_dim 128, bf16) at 16k context, batch 1 and 32, us per call and effective
GB/s of cache bytes (codes and scales) read.

Floors at 16k context, one layer (bytes / 4.25 TB/s; FLOPs / 780 TFLOP/s with the 4 query heads
of a KV head padded to 16 MMA rows; the page blocks pad them to 8, half those FLOPs):

| batch | fp16 | q8 | q4 | dots (padded) |
| --- | --- | --- | --- | --- |
| 32 | 2.15 GB, 505 us | 1.14 GB, 268 us | 0.60 GB, 142 us | 34 GFLOP, 44 us |
| 4 | 269 MB, 63 us | 143 MB, 34 us | 75 MB, 18 us | 4.3 GFLOP, 5.5 us |
| 1 | 67 MB, 16 us | 36 MB, 8 us | 19 MB, 4 us | 1.1 GFLOP, 1.4 us |

Variants (``--variants``, each a set of kernel constants, `constants.MODULES`): ``default`` the
backend's rule (page and tail programs in one launch up to `quant_decode.ONE_LAUNCH_MAX_SEQS`
sequences, else two with the tail in three parts); ``one-launch`` and
``two-launch`` force either side of that rule. Other settings: ``--set
quant_decode.PAGE_WINDOW=8`` etc. Each variant's output is checked against the first's
(``err``). A variant that is not one of those names is its own settings, joined by ``+``:
``quant_decode.WARPS=8+quant_decode.BLOCK_N=128``.
Quantized modes run as the runner does (q4 with its 16-position recent window and page heads,
q8 with page heads; the kernel does the step's write, `quant_decode.deferred_word_write`, the
same rows into the same slots every call). Each call is timed inside a CUDA graph of
``--calls`` calls (batch 1 cycles over 16 sequences' pages so L2 holds none of them), median of
5 replays.

    python benchmarks/kernels/quant_decode.py [--context 16384] [--batches 1,32]
        [--modes fp16,q8,q4] [--variants default,one-launch,two-launch] [--set ...]

Nsight Compute on the kernel (one mode and variant, so every launch is that variant's):

    ncu --clock-control none -k regex:quant_decode_kernel --launch-skip 20 --launch-count 1 \\
        --section WarpStateStats --section SourceCounters --section Occupancy \\
        --section MemoryWorkloadAnalysis python3 benchmarks/kernels/quant_decode.py \\
        --modes q4 --batches 1 --variants default

End to end: ``python3 benchmarks/long_context.py``.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

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
from dyngen_core.kv.attention.triton.decode import (  # noqa: E402
    LOG2_E,
    exact_operands,
    page_arguments,
    page_operands,
)
from dyngen_core.kv.attention.triton.paged import TritonPagedBackend  # noqa: E402
from dyngen_core.kv.attention.triton.quant_decode import (  # noqa: E402
    attend_word_decode,
    deferred_word_write,
    page_splits,
)
from dyngen_core.kv.fp16 import FP16Storage  # noqa: E402
from dyngen_core.kv.quant.storage import QuantStorage  # noqa: E402

COPIES_BATCH1 = 16
# Variant name -> kernel constants it sets (`constants.patched`); the first is the baseline.
VARIANTS: dict[str, list[str]] = {
    "default": [],
    "one-launch": ["quant_decode.ONE_LAUNCH_MAX_SEQS=1048576"],
    "two-launch": ["quant_decode.ONE_LAUNCH_MAX_SEQS=0"],
}


def variant_settings(name: str) -> list[str]:
    """The kernel constants of variant ``name``: a `VARIANTS` entry, or settings joined by
    ``+`` (``MODULE.NAME=VALUE+...``)."""
    if name in VARIANTS:
        return VARIANTS[name]
    if "=" not in name:
        raise SystemExit(f"--variants: {name!r} is neither one of {', '.join(VARIANTS)} nor "
                         f"settings joined by '+' (MODULE.NAME=VALUE+...)")
    return name.split("+")


def one_layer_storage(config: dict[str, Any], mode: str, tokens: int,
                      device: torch.device) -> Any:
    """One layer of ``mode`` pages for ``tokens`` tokens, random contents."""
    shape = ModelConfig.from_dict({**config, "num_hidden_layers": 1})
    pages = tokens // 256
    if mode == "fp16":
        fp16 = FP16Storage(shape, pages, 256, torch.bfloat16, [device])
        fp16.keys[0].normal_()
        fp16.values[0].normal_()
        return fp16
    storage = QuantStorage(shape, pages, 256, torch.bfloat16, [device], mode=mode)
    layer = storage.layers[0]
    for codes in (layer.key_codes, layer.value_codes):
        codes.view(torch.uint8).random_(0, 256)
    for scales in (layer.key_scales, layer.value_scales):
        scales.uniform_(0.01, 0.05)
    return storage


def decode_inputs(config: dict[str, Any], batch_size: int, context: int, device: torch.device,
                  windowed: bool
                  ) -> tuple[ForwardBatch, torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """One decode of ``batch_size`` sequences at ``context`` tokens (sequence slots for the
    recent windows when ``windowed``): the batch, the queries and the step's keys/values."""
    pages_per_seq = context // 256
    plan = StepPlan([SequenceSlice(i, [1], context - 1,
                                   list(range(i * pages_per_seq, (i + 1) * pages_per_seq)), True)
                     for i in range(batch_size)])
    slots = list(range(batch_size)) if windowed else None
    batch = build_forward_batch(plan, 256, device, seq_slots=slots)
    head_dim = config["head_dim"]
    q = torch.randn(batch_size, config["num_attention_heads"], head_dim, device=device,
                    dtype=torch.bfloat16)
    k = torch.randn(batch_size, config["num_key_value_heads"], head_dim, device=device,
                    dtype=torch.bfloat16)
    return batch, q, (k, torch.randn_like(k))


def graph_seconds(calls: list[Callable[[], Any]], repeats: int = 5) -> float:
    """Median seconds per call of ``calls`` run in turn, replayed from one CUDA graph."""
    def run_all() -> None:
        for call in calls:
            call()

    run_all()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run_all()
    return cuda_seconds(graph.replay, repeats, warmup=1) / len(calls)


def copies(batch: ForwardBatch, batch_size: int, pages_per_seq: int) -> list[ForwardBatch]:
    """The batch itself, or (batch 1) the same decode over 16 different sequences' pages."""
    if batch_size > 1:
        return [batch]
    return [dataclasses.replace(batch, page_table=batch.page_table + i * pages_per_seq,
                                page_tables_host=None) for i in range(COPIES_BATCH1)]


def fp16_calls(storage: Any, batches: list[ForwardBatch],
               q: torch.Tensor) -> list[Callable[[], Any]]:
    """The fp16 paged decode over each batch."""
    backend = TritonPagedBackend(cascade_min_saved_keys=None)
    scale = q.shape[2] ** -0.5
    return [lambda b=b: backend.attend_cached(0, q, storage, b, scale) for b in batches]


def word_calls(storage: Any, batches: list[ForwardBatch], q: torch.Tensor,
               step_rows: tuple[torch.Tensor, torch.Tensor]) -> list[Callable[[], Any]]:
    """`attend_word_decode` over each batch with its operands prepared once (kernel alone),
    doing the step's write as a decode step does (`deferred_word_write`; the same rows and
    slots every call)."""
    backend = TritonPagedBackend(cascade_min_saved_keys=None)
    ops = page_operands(storage, 0)
    page_args = page_arguments(ops, backend._rotation(q.device))
    kv_heads = ops.keys.shape[2]
    splits = page_splits(q.shape[0], kv_heads, q.device)

    def call(b: ForwardBatch) -> Callable[[], Any]:
        write = deferred_word_write(storage, 0, *step_rows, b)
        exact = exact_operands(storage, 0, b, step_rows)
        assert exact is not None
        return lambda: attend_word_decode(
            q, page_args, b, exact, q.shape[2] ** -0.5 * LOG2_E, key_bits=ops.key_bits,
            value_bits=ops.value_bits, num_kv_heads=kv_heads, splits=splits, write=write)

    return [call(b) for b in batches]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_common_args(parser)
    parser.add_argument("--context", type=int, default=16384)
    parser.add_argument("--batches", default="1,32")
    parser.add_argument("--calls", type=int, default=16, help="calls per CUDA graph")
    parser.add_argument("--modes", default="fp16,q8,q4", help="cache modes timed, in order")
    parser.add_argument("--variants", default=",".join(VARIANTS),
                        help="q8/q4 variants (fp16 runs the backend as it is)")
    constants.add_argument(parser)
    args = parser.parse_args()
    constants.apply(args.set)
    for name in args.variants.split(","):
        with constants.patched(variant_settings(name)):  # a bad setting stops the run here
            pass
    device = torch.device(args.device)
    config = bench_config(args)
    batches = [int(b) for b in args.batches.split(",")]
    sequences = max(max(batches), COPIES_BATCH1)
    pages_per_seq = args.context // 256
    rows: list[tuple[str, str, int, float, float, float]] = []
    began = time.perf_counter()
    for mode in args.modes.split(","):
        storage = one_layer_storage(config, mode, sequences * args.context, device)
        per_token = storage.nbytes() / (storage.num_pages * 256)
        windowed = mode != "fp16" and storage.reserve_sequences(sequences) > 0
        for batch_size in batches:
            batch, q, step_rows = decode_inputs(config, batch_size, args.context, device,
                                                windowed)
            group = copies(batch, batch_size, pages_per_seq)
            names = ["fp16"] if mode == "fp16" else args.variants.split(",")
            reference = None
            for name in names:
                try:
                    with constants.patched([] if mode == "fp16" else variant_settings(name)):
                        calls = (fp16_calls(storage, group, q) if mode == "fp16"
                                 else word_calls(storage, group, q, step_rows))
                        out = calls[0]().float()
                        reference = out if reference is None else reference
                        error = float((out - reference).norm() / reference.norm())
                        calls = (calls * -(-args.calls // len(calls)))[:args.calls]
                        seconds = graph_seconds(calls)
                except Exception as exc:  # a setting the kernel cannot take (shared memory, ...)
                    if name == names[0]:
                        raise
                    print(f"{mode} {name} batch {batch_size}: failed: "
                          f"{type(exc).__name__}: {str(exc)[:300]}")
                    continue
                gbps = batch_size * args.context * per_token / seconds / 1e9
                rows.append((mode, name, batch_size, seconds * 1e6, gbps, error))
                report("quant_decode", device=device_name(), mode=mode, variant=name,
                       batch=batch_size, context=args.context, us=seconds * 1e6, GBps=gbps,
                       error_vs_first=error, elapsed_s=time.perf_counter() - began)
        storage = None
        torch.cuda.empty_cache()
    print_table(rows, batches)


def print_table(rows: list[tuple[str, str, int, float, float, float]],
                batches: list[int]) -> None:
    """us (GB/s) per mode and variant, one column per batch, each against fp16, and its
    largest error against the mode's first variant."""
    fp16 = {b: us for mode, _, b, us, _, _ in rows if mode == "fp16"}
    width = max(12, *(len(name) + 1 for _, name, *_ in rows))
    print(f"\n{'mode':5} {'variant':{width}}" + "".join(f"{'batch ' + str(b):>24}" for b in batches)
          + "".join(f"{'/fp16 b' + str(b):>10}" for b in batches) + f"{'err':>9}")
    seen: dict[tuple[str, str], dict[int, tuple[float, float, float]]] = {}
    for mode, name, b, us, gbps, error in rows:
        seen.setdefault((mode, name), {})[b] = (us, gbps, error)
    for (mode, name), by_batch in seen.items():
        cells = "".join(f"{by_batch[b][0]:>12.1f} us {by_batch[b][1]:>6.0f} GB/s"
                        if b in by_batch else f"{'-':>24}" for b in batches)
        ratios = "".join(f"{by_batch[b][0] / fp16[b]:>10.2f}" if b in by_batch and b in fp16
                         else f"{'-':>10}" for b in batches)
        error = max(cell[2] for cell in by_batch.values())
        print(f"{mode:5} {name:{width}}{cells}{ratios}{error:>9.1e}")


if __name__ == "__main__":
    main()
