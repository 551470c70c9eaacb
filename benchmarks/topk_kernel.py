"""Device time of the fused draw's top-k: ``torch.topk(x, bound, dim=-1)`` against the
two-stage Triton top-k (`dyngen_core.sampling.topk_kernel.topk_rows`) over float32 logits,
with a sweep of the Triton plan's knobs (`topk_plan`: chunk, group, super_group, warps,
select_warps) at the main shape and the default plan at the others.

Floors (H200: 4.25 TB/s copy bandwidth, bytes read + written; no FLOPs to speak of):
  [256, 128256] fp32: 131.3 MB read -> 30.9 us (+ 8.9 MB of group maxima written and
                      read back in part by the Triton top-k: ~33 us)
  [32, 128256]  fp32:  16.4 MB -> 3.9 us      [256, 32000] fp32: 32.8 MB -> 7.7 us
  bound 1024 reads the same bytes; its cost is the sorting.
torch.topk at [256, 128256] bound 50 measured ~450 us (benchmarks/draw_graph.py's replay).

Timing: one CUDA graph holding one call per logits buffer (several buffers, together well
past the 50 MB L2, so no call reads what the previous one left in cache), replayed; device
microseconds per call from CUDA events, median of the replays. Triton variants are checked
against torch (values equal to torch.topk's, ids equal to a stable sort's; ``ok`` column).
Sweep variants are skipped once ``--budget`` seconds have passed (JIT compiles dominate).

    python benchmarks/topk_kernel.py [--replays 15] [--budget 70] [--no-sweep] [--small]

``--small``: tiny shapes, for a smoke run (also on the CPU under ``TRITON_INTERPRET=1``, timed
by the host clock).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
from _common import device_name, report

from dyngen_core.sampling.topk_kernel import topk_plan, topk_rows

L2_BYTES = 50 << 20
# (label, rows, vocab, bound); the first is the main shape (the sweep runs there)
SHAPES = [("256x128256 b50", 256, 128256, 50), ("32x128256 b50", 32, 128256, 50),
          ("256x32000 b50", 256, 32000, 50), ("256x128256 b128", 256, 128256, 128),
          ("256x128256 b256", 256, 128256, 256), ("256x128256 b512", 256, 128256, 512),
          ("256x128256 b1024", 256, 128256, 1024), ("32x128256 b1024", 32, 128256, 1024)]
SMALL_SHAPES = [("4x3000 b50", 4, 3000, 50), ("2x1000 b8", 2, 1000, 8)]
# Plan options varied one at a time from the defaults, at the main shape.
SWEEP: list[dict[str, int]] = [
    {"chunk": 4096}, {"chunk": 16384}, {"warps": 8}, {"select_warps": 4},
    {"select_warps": 16}, {"group": 8}, {"super_group": 8}, {"group": 32, "super_group": 8}]


def buffers_for(rows: int, vocab: int, device: torch.device) -> list[torch.Tensor]:
    """Random logits buffers (scaled as a model's), together at least 4x the L2 (two on the
    CPU)."""
    count = max(2, -(-4 * L2_BYTES // (rows * vocab * 4))) if device.type == "cuda" else 2
    return [torch.randn(rows, vocab, device=device) * 3 for _ in range(count)]


def device_us(call: Callable[[torch.Tensor], Any], buffers: list[torch.Tensor],
              replays: int) -> float:
    """Median device microseconds of ``call`` per buffer (module docstring)."""
    for x in buffers:
        call(x)
    if not buffers[0].is_cuda:
        begin = time.perf_counter()
        for x in buffers:
            call(x)
        return (time.perf_counter() - begin) * 1e6 / len(buffers)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for x in buffers:
            call(x)
    graph.replay()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / len(buffers))
    return sorted(times)[len(times) // 2]


def agrees(x: torch.Tensor, bound: int, options: dict[str, int]) -> bool:
    """Whether the plan's top-k of ``x`` is torch's: values equal to torch.topk's, ids to a
    stable descending sort's (ties to the lower column)."""
    values, ids = topk_rows(x, bound, plan=topk_plan(x.shape[1], bound, **options))
    want = torch.topk(x, bound, dim=-1).values.float()
    order = torch.sort(x, dim=-1, descending=True, stable=True).indices[:, :bound]
    return torch.equal(values, want) and torch.equal(ids, order)


Row = tuple[str, str, float, float, str]  # shape, top-k, device us, torch's us, ok


def run_shape(label: str, rows: int, vocab: int, bound: int, variants: list[dict[str, int]],
              args: argparse.Namespace, started: float, torch_us: float | None = None,
              ) -> list[Row]:
    """Rows of the table for one shape: torch.topk (unless its time is given), then each
    Triton variant."""
    device = torch.device(args.device)
    buffers = buffers_for(rows, vocab, device)
    out: list[Row] = []
    if torch_us is None:
        torch_us = device_us(lambda x: torch.topk(x, bound, dim=-1), buffers, args.replays)
        report("topk_kernel", device=device_name(), rows=rows, vocab=vocab, bound=bound,
               path="torch", device_us=torch_us)
        out.append((label, "torch.topk", torch_us, torch_us, "-"))
    for options in variants:
        if options and time.perf_counter() - started > args.budget:
            out.append((label, f"skipped {options} (budget)", float("nan"), torch_us, "-"))
            continue
        plan = topk_plan(vocab, bound, **options)
        ok = agrees(buffers[0], bound, options)
        us = device_us(partial(topk_rows, bound=bound, plan=plan), buffers, args.replays)
        report("topk_kernel", device=device_name(), rows=rows, vocab=vocab, bound=bound,
               path="triton", plan=plan._asdict(), device_us=us, ok=ok,
               speedup=torch_us / us)
        name = (f"triton c{plan.chunk} g{plan.group} s{plan.super_group} "
                f"w{plan.warps}/{plan.select_warps}")
        out.append((label, name, us, torch_us, "yes" if ok else "NO"))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--replays", type=int, default=15)
    parser.add_argument("--budget", type=float, default=70.0,
                        help="seconds after which sweep variants are skipped")
    parser.add_argument("--no-sweep", action="store_true", help="default plans only")
    parser.add_argument("--small", action="store_true", help="tiny shapes (smoke run)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    started = time.perf_counter()
    shapes = SMALL_SHAPES if args.small else SHAPES
    table: list[Row] = []
    for label, rows, vocab, bound in shapes:  # the default plans first: always measured
        table += run_shape(label, rows, vocab, bound, [{}], args, started)
    if not args.no_sweep and not args.small:  # then the sweep, while the budget lasts
        label, rows, vocab, bound = shapes[0]
        table[2:2] = run_shape(label, rows, vocab, bound, SWEEP, args, started, table[0][2])
    print(f"\n{'shape':<18} {'top-k':<34} {'device us':>10} {'vs torch':>9} {'ok':>4}")
    for label, name, us, torch_us, ok in table:
        print(f"{label:<18} {name:<34} {us:10.1f} {torch_us / us:8.2f}x {ok:>4}")
    print(f"total {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
