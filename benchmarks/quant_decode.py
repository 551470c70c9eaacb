"""The q8/q4 decode kernel alone (`triton_quant.attend_word_decode`) against the fp16 paged
kernel: one layer of Llama-3-8B shape (32 query heads, 8 KV heads, head_dim 128, bf16) at 16k
context, batch 1 and 32, µs per call and effective GB/s of cache bytes (codes and scales) read.

Floors at 16k context, one layer (bytes / 4.25 TB/s; FLOPs / 780 TFLOP/s with the 4 query
heads of a KV head padded to 16 MMA rows):

| batch | fp16 | q8 | q4 | dots (padded) |
| --- | --- | --- | --- | --- |
| 32 | 2.15 GB, 505 µs | 1.14 GB, 268 µs | 0.60 GB, 142 µs | 34 GFLOP, 44 µs |
| 4 | 269 MB, 63 µs | 143 MB, 34 µs | 75 MB, 18 µs | 4.3 GFLOP, 5.5 µs |
| 1 | 67 MB, 16 µs | 36 MB, 8 µs | 19 MB, 4 µs | 1.1 GFLOP, 1.4 µs |

The split partials a merge reads are small beside them (batch 1, 33 partials of 32 heads x
128 float32: 0.54 MB); what the in-kernel merge saves is the second launch.

Neither floor explains q4 at ~1 ms (batch 32): the kernel is bound by unpacking (shifts, masks,
packing, shared-memory stores of each dequantized tile) and by its 252 registers a thread (per
code field a [16, 16] value dot that Triton ran on every one of the 4 warps).

Variants (``--q8`` / ``--q4``, comma-separated names): ``old`` is the kernel without options
(64 keys x 4 warps, page and tail programs in two launches); the others add
`attend_word_decode`'s options: ``v`` join_values, ``k`` join_keys, ``h`` half_dot, ``f``
fast_unpack, ``w`` wide_scales, ``r`` scale_rows, then the launch shape ``NxW``, then
suffixes in any order: ``-pP`` splits chosen for P programs per multiprocessor instead of the
backend's 4 (P=2: 2 splits at batch 32, one wave of 512 programs where 128 registers a thread
fit 4 per multiprocessor; 3 splits make 1.5 waves); ``-lL`` L=1 runs the page and tail
programs in one launch (the backend's ``word_launches``; default 2); ``-sS`` S
software-pipelining stages of the key loop (default: Triton's, 3); ``-wW`` the page programs
load page ids W pages at a time ahead of their blocks (``page_window``; default 0: one load
per block inside the loop, which makes the loop wait for every copy each step, so stages
changed nothing); ``-mM`` merges the splits in the attention kernel (``counters``, M its
``merge_rows``: query rows x partials per load round, the backend's 64) instead of
`combine_splits_kernel` (the backend does so for batches of at most 4 sequences; batch 1 is
where the saved launch shows, 2.8 us a layer on an H200); ``-tT`` the tail's work in T programs
(``tail_parts``: 1 the single serial tail, 3 its blocks, page heads and window rows side by
side; default: the kernel's, 3 with a window); ``-nN`` the one-launch kernel's register cap
(``max_registers``; 0 none; default: the kernel's, 168 with the tail in parts); ``-xX`` at most
X page splits for this variant (``--max-splits`` otherwise; the fp16 rows take it too, e.g.
``--fp16 fp16,fp16-x64``); ``-l0`` launches as the backend picks them (one launch up to
`DecodeOptions.word_one_launch_max_seqs` sequences, else two); ``-oO`` the key-loop options
as bits (1 lazy_sum, 2 paired_values, 4 small_tail_rows, 8 swapped_values;
`attend_word_decode`).
Each variant's output is checked against the first variant's (relative error, ``err`` in
the table; a variant that fails to launch, e.g. for shared memory, is reported and skipped).
Quantized modes run as the runner does (q4 with its 16-position recent window and page
heads, q8 with page heads). Each call is timed inside a CUDA graph of ``--calls`` calls (batch
1 cycles over 16 sequences' pages so L2 holds none of them), median of 5 replays.

    python benchmarks/quant_decode.py [--context 16384] [--batches 1,32] [--q8 ...] [--q4 ...]

The tail in parts against the single serial tail, at 32 page splits and more (45: 8 x 48
programs fill 132 multiprocessors x 3; 64: two waves), as the backend launches at batch 1 (one
launch) and 4 (two launches); ``--tail-sweep`` sets those variants, fp16 at 32 and 64 splits,
modes fp16,q4 and batches 1,4 (success: q4 t3 at or below fp16 at batch 1, against ~0.89x of
its speed with t1 in the runner):

    python benchmarks/quant_decode.py --tail-sweep

The in-kernel merge against the second kernel, as the backend launches at batch 1 (one
launch) and 4 (two launches) (``--merge-sweep`` sets those variants and batches 1,4):

    python benchmarks/quant_decode.py --merge-sweep --modes fp16,q4
    python benchmarks/quant_decode.py --merge-sweep --modes fp16,q8

The key loop's shared-memory round trips (``--loop-sweep``: LOOP_SWEEP's variants, batches
1,4,32, modes fp16,q4; success: a batch-1 q4 row well below the first's ~28 us, towards fp16's
~23.6, with batches 4 and 32 no slower), and one variant alone under Nsight Compute (a single
``--q4`` variant and mode: every quant_decode_kernel launch is that variant's):

    python benchmarks/quant_decode.py --loop-sweep
    ncu --clock-control none -k regex:quant_decode_kernel --launch-skip 20 --launch-count 1 \
        --section WarpStateStats --section SourceCounters --section Occupancy \
        --section MemoryWorkloadAnalysis python3 benchmarks/quant_decode.py --modes q4 \
        --batches 1 --q4 vhfr-64x4-l0-w4-o15-n128-x64

End to end (the issue's figure): ``python3 benchmarks/long_context.py``.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from collections.abc import Callable
from typing import Any

import torch
from _common import add_common_args, bench_config, cuda_seconds, device_name, report
from attention_kernels import decode_inputs, one_layer_storage

from dyngen_core.kv.attention.base import ForwardBatch
from dyngen_core.kv.attention.triton.decode_options import DecodeOptions
from dyngen_core.kv.attention.triton.exact import exact_operands
from dyngen_core.kv.attention.triton.page_operands import page_arguments, page_operands
from dyngen_core.kv.attention.triton.paged import LOG2_E, TritonPagedBackend
from dyngen_core.kv.attention.triton.quant import attend_word_decode

# name: (attend_word_decode options, block_n, warps)
VARIANTS: dict[str, tuple[dict[str, bool], int, int]] = {
    "old": ({}, 64, 4),
    "h-64x4": ({"half_dot": True}, 64, 4),
    "v-64x4": ({"join_values": True}, 64, 4),
    "vh-64x4": ({"join_values": True, "half_dot": True}, 64, 4),
    "vh-128x4": ({"join_values": True, "half_dot": True}, 128, 4),
    "vh-64x8": ({"join_values": True, "half_dot": True}, 64, 8),
    "vh-32x4": ({"join_values": True, "half_dot": True}, 32, 4),
    "kvh-64x4": ({"join_keys": True, "join_values": True, "half_dot": True}, 64, 4),
    "hf-64x4": ({"half_dot": True, "fast_unpack": True}, 64, 4),
    "hf-64x8": ({"half_dot": True, "fast_unpack": True}, 64, 8),
    "vhf-64x4": ({"join_values": True, "half_dot": True, "fast_unpack": True}, 64, 4),
    "vhf-64x8": ({"join_values": True, "half_dot": True, "fast_unpack": True}, 64, 8),
    "vhf-32x4": ({"join_values": True, "half_dot": True, "fast_unpack": True}, 32, 4),
    "vhf-128x8": ({"join_values": True, "half_dot": True, "fast_unpack": True}, 128, 8),
    "hfw-64x4": ({"half_dot": True, "fast_unpack": True, "wide_scales": True}, 64, 4),
    "vhfw-64x4": ({"join_values": True, "half_dot": True, "fast_unpack": True,
                   "wide_scales": True}, 64, 4),
    "vhfw-64x8": ({"join_values": True, "half_dot": True, "fast_unpack": True,
                   "wide_scales": True}, 64, 8),
    "hfr-64x4": ({"half_dot": True, "fast_unpack": True, "scale_rows": True}, 64, 4),
    "vhfr-64x4": ({"join_values": True, "half_dot": True, "fast_unpack": True,
                   "scale_rows": True}, 64, 4),
    "vhfr-32x4": ({"join_values": True, "half_dot": True, "fast_unpack": True,
                   "scale_rows": True}, 32, 4),
    "vhfr-128x8": ({"join_values": True, "half_dot": True, "fast_unpack": True,
                    "scale_rows": True}, 128, 8),
}
# Kept small: each variant compiles two kernels per batch size (~30 compiles in all).
# The page-window sweep (issue #5): the backend's options (two launches; -l1: one, faster at
# batch 1 but the joint kernel takes 145 (q8) / 205 (q4) registers a thread against the
# page programs' 128) without and with page ids loaded ahead (-w), then with scale rows too
# (r: with the page ids out of the loop the scales' 2-byte gathers are its last synchronous
# loads), at 2-4 stages (-s). About 45 compiles: run q8 and q4 as two calls (--q4 old /
# --q8 old) to keep each under 90 s.
DEFAULT_VARIANTS = {"q8": "old,hf-64x4,hf-64x4-l1,hf-64x4-w4,hfr-64x4-w4,hfr-64x4-l1-w4,"
                          "hfr-64x4-w4-s4",
                    "q4": "old,vhf-64x4,vhf-64x4-l1,vhf-64x4-w4,vhfr-64x4-w4,vhfr-64x4-l1-w4,"
                          "vhfr-64x4-w4-s2,vhfr-64x4-w4-s4,vhfr-64x4-w8"}
# The backend's defaults in both launch forms, without and with the in-kernel merge, at the
# key-loop defaults since the ninth session (-o15; q8 -o5, its other two bits act only on
# joined values): the smaller kernel may change the seventh session's verdict (merge slower).
MERGE_SWEEP = {"q8": "hfr-64x4-l1-w4-o5,hfr-64x4-l1-w4-m64-o5,hfr-64x4-w4-o5,"
                     "hfr-64x4-w4-m64-o5",
               "q4": "vhfr-64x4-l1-w4-o15,vhfr-64x4-l1-w4-m64-o15,vhfr-64x4-w4-o15,"
                     "vhfr-64x4-w4-m64-o15"}
# The tail in parts (the backend's defaults and launch rule): t1 is the backend before parts;
# -m64 with the in-kernel merge; -n0 the parts without the register cap; -x the page split
# count; 32- and 128-key blocks. About 16 compiles. (t4, the window's two blocks in two
# programs, changes nothing at 16384 tokens: with a 16-position window the tail's keys are
# then exactly one block.)
TAIL_SWEEP = {"q4": "vhfr-64x4-l0-w4-t1,vhfr-64x4-l0-w4-t3,vhfr-64x4-l0-w4-m64-t3,"
                    "vhfr-64x4-l0-w4-t3-n0,vhfr-64x4-l0-w4-t3-x45,vhfr-32x4-l0-w8-t3,"
                    "vhfr-128x8-l0-w2-t3",
              "q8": "hfr-64x4-l0-w4-m64-t1,hfr-64x4-l0-w4-m64-t1-x64",
              "fp16": "fp16,fp16-x64"}
# The key loop's shared-memory round trips (`attend_word_decode`'s lazy_sum 1, paired_values
# 2, small_tail_rows 4, swapped_values 8, as ``-oO`` bits) at the backend's launch rule, then
# with more page splits where the smaller kernel lets them be one wave: 48 splits at 3
# programs a multiprocessor (168 registers, 41 KB), 64 at 4 (-n128). Batch 1 is the target
# (H200 before: q4 ~28 us, fp16 ~23.6); batches 4 and 32 check nothing regressed (-x and -n
# change nothing there; o12 keeps the page programs of two launches at 128 registers, where
# lazy_sum and paired_values take them to 168). About 35 compiles: if the run passes 90 s,
# run --batches 1 and --batches 4,32 as two calls. q8 (--modes q8: its values are not
# joined, so bits 2 and 8 change nothing) checks whether lazy_sum and small_tail_rows pay.
LOOP_SWEEP = {"q4": "vhfr-64x4-l0-w4,vhfr-64x4-l0-w4-o1,vhfr-64x4-l0-w4-o3,vhfr-64x4-l0-w4-o7,"
                    "vhfr-64x4-l0-w4-o12,vhfr-64x4-l0-w4-o15,vhfr-64x4-l0-w4-o15-x48,"
                    "vhfr-64x4-l0-w4-o15-n128-x64",
              "q8": "hfr-64x4-l0-w4,hfr-64x4-l0-w4-o1,hfr-64x4-l0-w4-o4,hfr-64x4-l0-w4-o5",
              "fp16": "fp16"}
SUFFIXES = {"p": "per_sm", "l": "launches", "s": "stages", "w": "page_window",
            "m": "merge_rows", "t": "tail_parts", "n": "max_registers", "x": "max_splits",
            "o": "loop_flags"}


def parse_variant(name: str) -> tuple[str, dict[str, int]]:
    """A variant name as its `VARIANTS` key (or ``fp16``) and its suffix values (``-pP``,
    ``-lL``, ``-sS``, ``-wW``, ``-mM``, ``-tT``, ``-nN``, ``-xX``, ``-oO``, in any order after
    the base),
    e.g. ``vhf-64x4-l1-w4-s4-m64-t3``."""
    parts = name.split("-")
    suffixes: dict[str, int] = {}
    while len(parts) > 1 and parts[-1][:1] in SUFFIXES and parts[-1][1:].isdigit():
        suffix = parts.pop()
        suffixes[SUFFIXES[suffix[0]]] = int(suffix[1:])
    return "-".join(parts), suffixes
COPIES_BATCH1 = 16


def graph_seconds(calls: list[Callable[[], Any]], repeats: int = 5) -> tuple[float, str]:
    """Median seconds per call of ``calls`` run in turn, replayed from one CUDA graph (plain
    launches timed with events where capture fails, the host clock without CUDA); and which
    timing it was."""
    def run_all() -> None:
        for call in calls:
            call()

    if not torch.cuda.is_available():
        return cuda_seconds(run_all, repeats=1, warmup=1) / len(calls), "host"
    run_all()
    torch.cuda.synchronize()
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            run_all()
        run, how = graph.replay, "graph"
    except RuntimeError:
        torch.cuda.synchronize()
        run, how = run_all, "events"
    return cuda_seconds(run, repeats, warmup=1) / len(calls), how


def copies(batch: ForwardBatch, batch_size: int, pages_per_seq: int) -> list[ForwardBatch]:
    """The batch itself, or (batch 1) the same decode over 16 different sequences' pages."""
    if batch_size > 1:
        return [batch]
    return [dataclasses.replace(batch, page_table=batch.page_table + i * pages_per_seq,
                                page_tables_host=None) for i in range(COPIES_BATCH1)]


def fp16_calls(storage: Any, batches: list[ForwardBatch], q: torch.Tensor,
               max_splits: int) -> list[Callable[[], Any]]:
    """The fp16 paged decode (the backend's defaults but ``max_splits``) over each batch."""
    backend = TritonPagedBackend(max_splits=max_splits)
    scale = q.shape[2] ** -0.5

    def call(b: ForwardBatch) -> Callable[[], Any]:
        return lambda: backend.attend_cached(0, q, storage, b, scale)

    return [call(b) for b in batches]


def word_calls(storage: Any, batches: list[ForwardBatch], q: torch.Tensor,
               step_rows: tuple[torch.Tensor, torch.Tensor], options: dict[str, bool],
               block_n: int, warps: int, knobs: dict[str, int],
               max_splits: int) -> list[Callable[[], Any]]:
    """`attend_word_decode` over each batch with its operands prepared once (kernel alone),
    with a variant's suffix ``knobs`` (`parse_variant`; ``merge_rows`` > 0: the splits merged
    in the kernel, that many rows x partials a round; ``launches`` 0: the backend's rule)."""
    backend = TritonPagedBackend(word_block_n=block_n, word_warps=warps,
                                 programs_per_sm=knobs.get("per_sm", 4),
                                 max_splits=knobs.get("max_splits", max_splits))
    launches = knobs.get("launches", 2)
    if launches == 0:
        launches = 1 if q.shape[0] <= DecodeOptions().word_one_launch_max_seqs else 2
    merge_rows = knobs.get("merge_rows", 0)
    loop = knobs.get("loop_flags", 0)
    loop_options = {"lazy_sum": bool(loop & 1), "paired_values": bool(loop & 2),
                    "small_tail_rows": bool(loop & 4), "swapped_values": bool(loop & 8)}
    ops = page_operands(storage, 0)
    page_args = page_arguments(ops, backend._rotation(q.device))
    kv_heads = ops.keys.shape[2]
    splits = backend._decode_splits(q.shape[0] * kv_heads, q.device)
    counters = (backend.split_counters.for_launch(q.device, q.shape[0] * kv_heads)
                if merge_rows else None)

    def call(b: ForwardBatch) -> Callable[[], Any]:
        exact = exact_operands(storage, 0, b, step_rows)
        assert exact is not None
        return lambda: attend_word_decode(
            q, page_args, b, exact, q.shape[2] ** -0.5 * LOG2_E, key_bits=ops.key_bits,
            value_bits=ops.value_bits, num_kv_heads=kv_heads, block_n=block_n,
            splits=splits, warps=warps, launches=launches, stages=knobs.get("stages"),
            page_window=knobs.get("page_window", 0), counters=counters,
            merge_rows=merge_rows or 64, tail_parts=knobs.get("tail_parts"),
            max_registers=knobs.get("max_registers"), **options, **loop_options)

    return [call(b) for b in batches]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    add_common_args(parser)
    parser.add_argument("--context", type=int, default=16384)
    parser.add_argument("--batches", default="1,32")
    parser.add_argument("--calls", type=int, default=16, help="calls per CUDA graph")
    parser.add_argument("--q8", default=DEFAULT_VARIANTS["q8"], help="q8 variants")
    parser.add_argument("--q4", default=DEFAULT_VARIANTS["q4"], help="q4 variants")
    parser.add_argument("--fp16", default="fp16", help="fp16 rows (fp16, fp16-xX)")
    parser.add_argument("--modes", default=None,
                        help="cache modes timed, in order (default fp16,q8,q4)")
    parser.add_argument("--merge-sweep", action="store_true",
                        help="batches 1,4 and the merge on/off variants (MERGE_SWEEP)")
    parser.add_argument("--tail-sweep", action="store_true",
                        help="batches 1,4, modes fp16,q4 and the tail-parts variants "
                             "(TAIL_SWEEP)")
    parser.add_argument("--loop-sweep", action="store_true",
                        help="batches 1,4,32, modes fp16,q4 and the key-loop variants "
                             "(LOOP_SWEEP)")
    parser.add_argument("--max-splits", type=int, default=32,
                        help="most splits of a decode's context (the backend's max_splits)")
    args = parser.parse_args()
    if args.merge_sweep:
        args.batches, args.q8, args.q4 = "1,4", MERGE_SWEEP["q8"], MERGE_SWEEP["q4"]
    if args.tail_sweep:
        args.batches, args.q8, args.q4 = "1,4", TAIL_SWEEP["q8"], TAIL_SWEEP["q4"]
        args.fp16, args.modes = TAIL_SWEEP["fp16"], args.modes or "fp16,q4"
    if args.loop_sweep:
        args.batches = args.batches if args.batches != "1,32" else "1,4,32"
        args.q4, args.q8, args.fp16 = LOOP_SWEEP["q4"], LOOP_SWEEP["q8"], LOOP_SWEEP["fp16"]
        args.modes = args.modes or "fp16,q4"
    args.modes = args.modes or "fp16,q8,q4"
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
        windowed = mode != "fp16" and storage.reserve_sequences(sequences)
        for batch_size in batches:
            batch, q, step_rows = decode_inputs(config, batch_size, args.context, device,
                                                windowed)
            group = copies(batch, batch_size, pages_per_seq)
            names = getattr(args, mode).split(",")
            reference = None
            for name in names:
                try:
                    base, knobs = parse_variant(name)
                    if mode == "fp16":
                        calls = fp16_calls(storage, group, q,
                                           knobs.get("max_splits", args.max_splits))
                    else:
                        options, block_n, warps = VARIANTS[base]
                        calls = word_calls(storage, group, q, step_rows, options, block_n,
                                           warps, knobs, args.max_splits)
                    out = calls[0]().float()
                    reference = out if reference is None else reference
                    error = float((out - reference).norm() / reference.norm())
                    calls = (calls * -(-args.calls // len(calls)))[:args.calls]
                    seconds, how = graph_seconds(calls)
                except Exception as failure:  # noqa: BLE001 - a variant may not launch
                    report("quant_decode", mode=mode, variant=name, batch=batch_size,
                           failed=repr(failure)[:300])
                    continue
                gbps = batch_size * args.context * per_token / seconds / 1e9
                rows.append((mode, name, batch_size, seconds * 1e6, gbps, error))
                report("quant_decode", device=device_name(), mode=mode, variant=name,
                       batch=batch_size, max_splits=args.max_splits, context=args.context,
                       us=seconds * 1e6, GBps=gbps,
                       error_vs_old=error, timing=how, elapsed_s=time.perf_counter() - began)
        storage = None
        torch.cuda.empty_cache()
    print_table(rows, batches)
    print("end to end: python3 benchmarks/long_context.py")


def print_table(rows: list[tuple[str, str, int, float, float, float]],
                batches: list[int]) -> None:
    """µs (GB/s) per mode and variant, one column per batch, each variant against fp16
    (success for the issue: q4 at most 1.00 at batch 32) and its largest error against old."""
    fp16 = {b: us for mode, name, b, us, _, _ in rows if name == "fp16"}
    print(f"\n{'mode':5} {'variant':28}" + "".join(f"{'batch ' + str(b):>24}" for b in batches)
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
        print(f"{mode:5} {name:28}{cells}{ratios}{error:>9.1e}")


if __name__ == "__main__":
    main()
