"""The Triton skinny matmul (`models.skinny_matmul`) against ``F.linear`` (cuBLAS) for the five
weight shapes of Llama-3-8B decode, at 1, 2, 4, 8 and 16 rows, every kernel variant of a small
sweep; the best variant per shape and row count; the whole layer set of one decode step.

Floors (H200: 4.25 TB/s copy bandwidth, ~780 TFLOP/s bf16; bytes are the bf16 weight, read once):

    shape     N x K            bytes      bytes / 4.25 TB/s   FLOPs at 16 rows / 780 TFLOP/s
    qkv       6144 x 4096      50.3 MB    11.8 us             0.81 GFLOP   1.0 us
    o         4096 x 4096      33.6 MB     7.9 us             0.54 GFLOP   0.7 us
    gate_up  28672 x 4096     234.9 MB    55.3 us             3.76 GFLOP   4.8 us
    down      4096 x 14336    117.4 MB    27.6 us             1.88 GFLOP   2.4 us
    lm_head 128256 x 4096    1050.7 MB   247.2 us            16.8  GFLOP  21.6 us
    layer set: 32 x (qkv + o + gate_up + down) + lm_head = 15.01 GB -> 3.53 ms

Every product is memory-bound at these row counts, so TB/s = weight bytes / time is the figure.
Each measurement replays a CUDA graph of one launch per weight copy, rotating over at least 4
copies (and at least 256 MB in all) so the 50 MB L2 never holds the next weight; the time per
launch is the median replay over the launches, gaps between launches included (as in the
captured decode step). Variants are checked against ``F.linear`` first (BAD: relative error
above 1e-2, or the variant failed to compile; left out of the best).

    python benchmarks/skinny_matmul.py [--rows 1,2,4,8,16] [--shapes qkv,o,...] [--quick]

``--small`` runs tiny shapes without graphs (a smoke run, e.g. under TRITON_INTERPRET=1 on a
CPU). After the per-variant lines come the BENCH json lines (`_common.report`), the layer set
per row count, `DEFAULT_CONFIGS` as measured (paste it), and last the compact table.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._common import cuda_seconds, device_name, free_memory, report  # noqa: E402
from dyngen_core.ops.skinny_matmul import SkinnyConfig, default_config, launch, shape_class

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096),
          "down": (4096, 14336), "lm_head": (128256, 4096)}
SMALL_SHAPES = {"qkv": (96, 64), "o": (64, 64), "gate_up": (256, 64), "down": (64, 128),
                "lm_head": (512, 64)}
PER_LAYER = ("qkv", "o", "gate_up", "down")
LAYERS = 32
# (block_n, block_k, warps, stages, prefetch) of the reduce kernel per BLOCK_M;
# (block_n, block_k, warps, stages) of the dot kernel.
REDUCE = {1: [(8, 512, 4, 1, True), (8, 512, 4, 1, False), (8, 512, 4, 3, False),
              (16, 512, 4, 1, True), (16, 256, 4, 1, True), (4, 1024, 4, 1, True),
              (8, 1024, 8, 1, True), (16, 1024, 8, 1, True), (32, 256, 8, 1, True),
              (8, 1024, 4, 1, False)],
          2: [(8, 256, 4, 1, True), (8, 256, 4, 3, False), (8, 512, 4, 1, True),
              (4, 512, 4, 1, True), (16, 256, 8, 1, True)],
          4: [(8, 256, 4, 1, True), (8, 256, 4, 3, False), (4, 256, 4, 1, True),
              (4, 512, 4, 1, True), (16, 256, 8, 1, True)]}
DOT = [(16, 256, 4, 4), (32, 128, 4, 4), (32, 256, 4, 3), (64, 128, 4, 4), (64, 128, 4, 6),
       (64, 256, 4, 3), (128, 128, 4, 4), (128, 64, 4, 8)]


def label(config: SkinnyConfig) -> str:
    return (f"{config.kernel[0]}{config.block_n}x{config.block_k}w{config.num_warps}"
            f"s{config.num_stages}" + ("p" if config.prefetch else ""))


def variants(rows: int, quick: bool) -> list[SkinnyConfig]:
    """The sweep for ``rows`` rows: reduce variants up to 4 rows, dot variants for all."""
    configs = []
    if rows <= 4:
        block_m = 1 << (rows - 1).bit_length()
        reduce = REDUCE[block_m][:3] if quick else REDUCE[block_m]
        configs += [SkinnyConfig("reduce", n, k, w, s, prefetch=p) for n, k, w, s, p in reduce]
    dot = DOT[1:4] if quick else DOT
    configs += [SkinnyConfig("dot", n, k, w, s) for n, k, w, s in dot]
    return configs


def per_launch_seconds(calls: Sequence[Callable[[], object]], replays: int) -> float:
    """Median seconds per call of ``calls`` run back to back: a CUDA graph replayed on CUDA,
    host timing elsewhere."""
    if not torch.cuda.is_available():
        host_start = time.perf_counter()
        for call in calls:
            call()
        return (time.perf_counter() - host_start) / len(calls)
    for call in calls:  # compile (Triton JIT) and cuBLAS warm-up outside the capture
        call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    seconds = cuda_seconds(graph.replay, replays, warmup=1) / len(calls)
    del graph
    return seconds


@dataclass
class Timings:
    """Seconds per launch of one shape at one row count: "torch" and each variant's label
    (inf: wrong result); ``default`` names the entry `default_config` picks."""

    seconds: dict[str, float]
    default: str


def measure_shape(name: str, n: int, k: int, rows_list: list[int], args: argparse.Namespace,
                  device: torch.device, dtype: torch.dtype,
                  configs_seen: dict[str, SkinnyConfig]) -> dict[int, Timings]:
    """{rows: Timings} for one weight shape; adds every variant to ``configs_seen``."""
    nbytes = n * k * dtype.itemsize
    copies = 1 if args.small else max(4, -(-(256 << 20) // nbytes))
    gen = torch.Generator(device=device).manual_seed(n)
    weights = [torch.randn(n, k, generator=gen, device=device, dtype=dtype) / k**0.5
               for _ in range(copies)]
    replays = 5 if nbytes > (500 << 20) else 10
    results: dict[int, Timings] = {}
    for rows in rows_list:
        xs = [torch.randn(rows, k, generator=gen, device=device, dtype=dtype)
              for _ in range(copies)]
        outs = [torch.empty(rows, n, device=device, dtype=dtype) for _ in range(copies)]
        operands = list(zip(xs, weights, outs, strict=True))
        reference = F.linear(xs[0], weights[0]).float()
        seconds = {"torch": per_launch_seconds(
            [partial(F.linear, x, w) for x, w, _ in operands], replays)}
        configs = variants(rows, args.quick)
        default = default_config(rows, n, k)
        configs += [] if default is None or default in configs else [default]
        for config in configs:
            configs_seen[label(config)] = config
            calls = [partial(launch, x, w, None, out, config) for x, w, out in operands]
            try:
                calls[0]()
                error = ((outs[0].float() - reference).norm() / reference.norm()).item()
                seconds[label(config)] = (per_launch_seconds(calls, replays) if error < 1e-2
                                          else float("inf"))
            except Exception as exc:  # noqa: BLE001 - a variant that fails to compile is a result
                print(f"{label(config)} failed: {exc!r:.200}", flush=True)
                seconds[label(config)] = float("inf")
        results[rows] = Timings(seconds, "torch" if default is None else label(default))
        print(f"{name:8} rows={rows:<3}" + " ".join(
            f"{key}={_us(value)}" for key, value in seconds.items()), flush=True)
    return results


def _us(seconds: float) -> str:
    return "BAD" if seconds == float("inf") else f"{seconds * 1e6:.1f}"


def _best(timings: Timings) -> str:
    return min((key for key in timings.seconds if key != "torch"),
               key=timings.seconds.__getitem__)


def report_all(results: dict[str, dict[int, Timings]], dtype: torch.dtype,
               shapes: dict[str, tuple[int, int]]) -> None:
    """A BENCH line per shape and row count (torch, best variant, the defaults)."""
    for name, by_rows in results.items():
        n, k = shapes[name]
        nbytes = n * k * dtype.itemsize
        for rows, timings in by_rows.items():
            best = _best(timings)
            torch_s, best_s = timings.seconds["torch"], timings.seconds[best]
            report("skinny_matmul", shape=name, rows=rows, n=n, k=k, torch_us=torch_s * 1e6,
                   best=best, best_us=best_s * 1e6,
                   default_us=timings.seconds[timings.default] * 1e6,
                   torch_tbps=nbytes / torch_s / 1e12, best_tbps=nbytes / best_s / 1e12,
                   device=device_name())


def print_table(results: dict[str, dict[int, Timings]], dtype: torch.dtype,
                shapes: dict[str, tuple[int, int]]) -> None:
    """The compact table: torch vs the best variant vs the defaults, per shape and rows."""
    print(f"\n{'shape':8} {'rows':>4} {'torch us':>9} {'TB/s':>5} {'best':>16} {'us':>8} "
          f"{'TB/s':>5} {'x':>5} {'default us':>10}")
    for name, by_rows in results.items():
        n, k = shapes[name]
        nbytes = n * k * dtype.itemsize
        for rows, timings in by_rows.items():
            best = _best(timings)
            torch_s, best_s = timings.seconds["torch"], timings.seconds[best]
            print(f"{name:8} {rows:>4} {torch_s * 1e6:>9.1f} {nbytes / torch_s / 1e12:>5.2f} "
                  f"{best:>16} {best_s * 1e6:>8.1f} {nbytes / best_s / 1e12:>5.2f} "
                  f"{torch_s / best_s:>5.2f} {_us(timings.seconds[timings.default]):>10}")


def layer_set(results: dict[str, dict[int, Timings]]) -> None:
    """32 x (qkv + o + gate_up + down) + lm_head per row count: torch, the best variant of
    each shape, the faster of the two per shape (mixed), and the defaults; then the row
    cut-off up to which the mixed set saves at least 1 % at every row count measured."""
    if not all(name in results for name in (*PER_LAYER, "lm_head")):
        return
    cut_off, faster = 0, True
    for rows in sorted(results["lm_head"]):
        sums = {"torch": 0.0, "best": 0.0, "mixed": 0.0, "default": 0.0}
        for name in (*PER_LAYER, "lm_head"):
            timings = results[name][rows]
            weight = LAYERS if name in PER_LAYER else 1
            sums["torch"] += weight * timings.seconds["torch"]
            sums["best"] += weight * timings.seconds[_best(timings)]
            sums["mixed"] += weight * min(timings.seconds[_best(timings)],
                                          timings.seconds["torch"])
            sums["default"] += weight * timings.seconds[timings.default]
        print(f"layer set rows={rows}: torch {sums['torch'] * 1e3:.3f} ms, best "
              f"{sums['best'] * 1e3:.3f} ms, mixed {sums['mixed'] * 1e3:.3f} ms, defaults "
              f"{sums['default'] * 1e3:.3f} ms (mixed saves "
              f"{(sums['torch'] - sums['mixed']) * 1e3:.3f} ms per step)")
        report("skinny_matmul_layer_set", rows=rows, torch_ms=sums["torch"] * 1e3,
               best_ms=sums["best"] * 1e3, mixed_ms=sums["mixed"] * 1e3,
               default_ms=sums["default"] * 1e3, device=device_name())
        faster = faster and sums["mixed"] < 0.99 * sums["torch"]
        cut_off = rows if faster else cut_off
    print(f"skinny_matmul_rows as measured: {cut_off} (0: F.linear everywhere)")


def suggest_defaults(results: dict[str, dict[int, Timings]],
                     shapes: dict[str, tuple[int, int]],
                     configs_seen: dict[str, SkinnyConfig]) -> None:
    """Print `DEFAULT_CONFIGS` as measured: per shape class, the variant with the least time
    summed over its shapes and row counts (per-layer shapes weighted by the layer count), or
    None where torch is at least as fast."""
    groups: dict[tuple[str, str], list[tuple[float, Timings]]] = {}
    for name, by_rows in results.items():
        weight = LAYERS if name in PER_LAYER else 1
        for rows, timings in by_rows.items():
            groups.setdefault(shape_class(rows, *shapes[name]), []).append((weight, timings))
    print("\nDEFAULT_CONFIGS as measured (dyngen_core/models/skinny_matmul.py):")
    for key, members in sorted(groups.items()):
        common = set.intersection(*(set(t.seconds) for _, t in members))
        score = {label_: sum(w * t.seconds[label_] for w, t in members) for label_ in common}
        best = min((label_ for label_ in common if label_ != "torch"), key=score.__getitem__)
        choice = "None" if score["torch"] <= score[best] else repr(configs_seen[best])
        print(f"    {key!r}: {choice},  # {score[best] * 1e6:.1f} us vs torch "
              f"{score['torch'] * 1e6:.1f} us")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="1,2,4,8,16", help="row counts, comma-separated")
    parser.add_argument("--shapes", default=",".join(SHAPES), help="shapes, comma-separated")
    parser.add_argument("--quick", action="store_true", help="a third of the variants")
    parser.add_argument("--small", action="store_true", help="tiny shapes, no graphs (smoke)")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float16
    shapes = SMALL_SHAPES if args.small else SHAPES
    rows_list = [int(r) for r in args.rows.split(",")]
    start = time.perf_counter()
    results: dict[str, dict[int, Timings]] = {}
    configs_seen: dict[str, SkinnyConfig] = {}
    for name in args.shapes.split(","):
        results[name] = measure_shape(name, *shapes[name], rows_list, args, device, dtype,
                                      configs_seen)
        free_memory()  # the weight copies of the shape just measured
    report_all(results, dtype, shapes)
    layer_set(results)
    suggest_defaults(results, shapes, configs_seen)
    print_table(results, dtype, shapes)
    print(f"total {time.perf_counter() - start:.1f} s on {device_name()}")


if __name__ == "__main__":
    main()
