"""The Triton skinny matmul (`ops.skinny_matmul`) against ``F.linear`` (cuBLAS) for the five
weight shapes of Llama-3-8B decode, at 1, 2, 4, 8 and 16 rows: the product as `skinny_linear`
routes it (`DEFAULT_CONFIGS` per shape class; ``F.linear`` where the table says None), and the
whole layer set of one decode step. Other launch tables: ``--set`` a whole
``skinny_matmul.DEFAULT_CONFIGS`` is not a literal; patch it in a script of your own.

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
captured decode step). The routed product is checked against ``F.linear`` first (BAD: relative
error above 1e-2).

    python benchmarks/kernels/skinny_matmul.py [--rows 1,2,4,8,16] [--shapes qkv,o,...]

``--small`` runs tiny shapes without graphs (a smoke run, e.g. under TRITON_INTERPRET=1 on a
CPU).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks._common import cuda_seconds, device_name, free_memory, report  # noqa: E402
from dyngen_core.ops.skinny_matmul import default_config, skinny_linear  # noqa: E402

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096),
          "down": (4096, 14336), "lm_head": (128256, 4096)}
SMALL_SHAPES = {"qkv": (96, 64), "o": (64, 64), "gate_up": (256, 64), "down": (64, 128),
                "lm_head": (512, 64)}
PER_LAYER = ("qkv", "o", "gate_up", "down")
LAYERS = 32


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


def weight_copies(n: int, k: int, device: torch.device, dtype: torch.dtype,
                  gen: torch.Generator, *, small: bool = False) -> list[torch.Tensor]:
    """Random [n, k] weights, enough copies (at least 4, and 256 MB in all) that the L2 never
    holds the next launch's; one for a smoke run (``small``)."""
    copies = 1 if small else max(4, -(-(256 << 20) // (n * k * dtype.itemsize)))
    return [torch.randn(n, k, generator=gen, device=device, dtype=dtype) / k**0.5
            for _ in range(copies)]


def replays_for(nbytes: int) -> int:
    """Graph replays to time a launch over a weight of ``nbytes`` (fewer for the largest)."""
    return 5 if nbytes > (500 << 20) else 10


def measure_shape(name: str, n: int, k: int, rows_list: list[int], small: bool,
                  device: torch.device, dtype: torch.dtype) -> dict[int, dict[str, float]]:
    """{rows: {"torch": s, "skinny": s}} per launch for one weight shape."""
    nbytes = n * k * dtype.itemsize
    gen = torch.Generator(device=device).manual_seed(n)
    weights = weight_copies(n, k, device, dtype, gen, small=small)
    replays = replays_for(nbytes)
    results: dict[int, dict[str, float]] = {}
    for rows in rows_list:
        xs = [torch.randn(rows, k, generator=gen, device=device, dtype=dtype)
              for _ in weights]
        reference = F.linear(xs[0], weights[0]).float()
        routed = skinny_linear(xs[0], weights[0]).float()
        error = ((routed - reference).norm() / reference.norm()).item()
        seconds = {"torch": per_launch_seconds(
            [partial(F.linear, x, w) for x, w in zip(xs, weights, strict=True)], replays)}
        seconds["skinny"] = (per_launch_seconds(
            [partial(skinny_linear, x, w) for x, w in zip(xs, weights, strict=True)], replays)
            if error < 1e-2 else float("inf"))
        results[rows] = seconds
        kernel = "F.linear" if default_config(rows, n, k) is None else "kernel"
        report("skinny_matmul", shape=name, rows=rows, n=n, k=k, routed_to=kernel,
               torch_us=seconds["torch"] * 1e6, skinny_us=seconds["skinny"] * 1e6,
               torch_tbps=nbytes / seconds["torch"] / 1e12,
               skinny_tbps=nbytes / seconds["skinny"] / 1e12, device=device_name())
        print(f"{name:8} rows={rows:<3} {kernel:8} torch={seconds['torch'] * 1e6:.1f} us "
              f"skinny={seconds['skinny'] * 1e6:.1f} us", flush=True)
    return results


def layer_set(results: dict[str, dict[int, dict[str, float]]]) -> None:
    """32 x (qkv + o + gate_up + down) + lm_head per row count: torch against the routed
    products."""
    if not all(name in results for name in (*PER_LAYER, "lm_head")):
        return
    for rows in sorted(results["lm_head"]):
        sums = {"torch": 0.0, "skinny": 0.0}
        for name in (*PER_LAYER, "lm_head"):
            weight = LAYERS if name in PER_LAYER else 1
            for key in sums:
                sums[key] += weight * results[name][rows][key]
        print(f"layer set rows={rows}: torch {sums['torch'] * 1e3:.3f} ms, routed "
              f"{sums['skinny'] * 1e3:.3f} ms")
        report("skinny_matmul_layer_set", rows=rows, torch_ms=sums["torch"] * 1e3,
               skinny_ms=sums["skinny"] * 1e3, device=device_name())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="1,2,4,8,16", help="row counts, comma-separated")
    parser.add_argument("--shapes", default=",".join(SHAPES), help="shapes, comma-separated")
    parser.add_argument("--small", action="store_true", help="tiny shapes, no graphs (smoke)")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type != "cuda":
        # The interpreter needs the GPU tests' patch for Triton 3.6 with numpy >= 2.4.
        import tests.gpu.conftest  # noqa: F401
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float16
    shapes = SMALL_SHAPES if args.small else SHAPES
    rows_list = [int(r) for r in args.rows.split(",")]
    start = time.perf_counter()
    results = {}
    for name in args.shapes.split(","):
        results[name] = measure_shape(name, *shapes[name], rows_list, args.small, device,
                                      dtype)
        free_memory()  # the weight copies of the shape just measured
    layer_set(results)
    print(f"total {time.perf_counter() - start:.1f} s on {device_name()}")


if __name__ == "__main__":
    main()
