"""Device time of the fused draw's top-k: ``torch.topk(x, bound, dim=-1)`` against the
two-stage Triton top-k (`dyngen_core.sampling.fused.topk_rows`, its default plan) over
float32 logits, at bounds on both sides of the sampler's rule (`sampling.fused`: the Triton
top-k up to ``AUTO_TRITON_MAX_BOUND`` candidates, torch.topk above). Other plans: ``--set
fused.DEFAULT_CHUNK=4096``.

Floors (H200: 4.25 TB/s copy bandwidth, bytes read + written; no FLOPs to speak of):
  [256, 128256] fp32: 131.3 MB read -> 30.9 us (+ 8.9 MB of group maxima written and
                      read back in part by the Triton top-k: ~33 us)
  [32, 128256]  fp32:  16.4 MB -> 3.9 us      [256, 32000] fp32: 32.8 MB -> 7.7 us
  bound 1024 reads the same bytes; its cost is the sorting.

Timing: one CUDA graph holding one call per logits buffer (several buffers, together well
past the 50 MB L2, so no call reads what the previous one left in cache), replayed; device
microseconds per call from CUDA events, median of the replays. The Triton top-k is checked
against torch (values equal to torch.topk's, ids equal to a stable sort's; ``ok`` column).

    python benchmarks/kernels/topk.py [--replays 15] [--small] [--set MODULE.NAME=VALUE]

``--small``: tiny shapes, for a smoke run (also on the CPU under ``TRITON_INTERPRET=1``, timed
by the host clock). Figures: BENCHMARKS.md, "9. Sampler".
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks._common import device_name, report  # noqa: E402
from benchmarks.kernels import constants  # noqa: E402
from dyngen_core.sampling.fused import topk_plan, topk_rows  # noqa: E402

L2_BYTES = 50 << 20
# (label, rows, vocab, bound)
SHAPES = [("256x128256 b50", 256, 128256, 50), ("32x128256 b50", 32, 128256, 50),
          ("256x32000 b50", 256, 32000, 50), ("256x128256 b128", 256, 128256, 128),
          ("256x128256 b256", 256, 128256, 256), ("256x128256 b512", 256, 128256, 512),
          ("256x128256 b1024", 256, 128256, 1024), ("32x128256 b1024", 32, 128256, 1024)]
SMALL_SHAPES = [("4x3000 b50", 4, 3000, 50), ("2x1000 b8", 2, 1000, 8)]


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


def agrees(x: torch.Tensor, bound: int) -> bool:
    """Whether the Triton top-k of ``x`` is torch's: values equal to torch.topk's, ids to a
    stable descending sort's (ties to the lower column)."""
    values, ids = topk_rows(x, bound)
    want = torch.topk(x, bound, dim=-1).values.float()
    order = torch.sort(x, dim=-1, descending=True, stable=True).indices[:, :bound]
    return torch.equal(values, want) and torch.equal(ids, order)


Row = tuple[str, float, float, str]  # shape, torch's us, Triton's us, ok


def run_shape(label: str, rows: int, vocab: int, bound: int, replays: int,
              device: torch.device) -> Row:
    """torch.topk and the Triton top-k (default plan) on one shape."""
    buffers = buffers_for(rows, vocab, device)
    torch_us = device_us(lambda x: torch.topk(x, bound, dim=-1), buffers, replays)
    report("topk_kernel", device=device_name(), rows=rows, vocab=vocab, bound=bound,
           path="torch", device_us=torch_us)
    plan = topk_plan(vocab, bound)
    ok = agrees(buffers[0], bound)
    us = device_us(partial(topk_rows, bound=bound), buffers, replays)
    report("topk_kernel", device=device_name(), rows=rows, vocab=vocab, bound=bound,
           path="triton", plan=plan._asdict(), device_us=us, ok=ok, speedup=torch_us / us)
    return label, torch_us, us, "yes" if ok else "NO"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--replays", type=int, default=15)
    parser.add_argument("--small", action="store_true", help="tiny shapes (smoke run)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    constants.add_argument(parser)
    args = parser.parse_args()
    constants.apply(args.set)
    device = torch.device(args.device)
    started = time.perf_counter()
    table = [run_shape(*shape, args.replays, device)
             for shape in (SMALL_SHAPES if args.small else SHAPES)]
    print(f"\n{'shape':<18} {'torch.topk us':>14} {'Triton us':>10} {'speed-up':>9} {'ok':>4}")
    for label, torch_us, us, ok in table:
        print(f"{label:<18} {torch_us:14.1f} {us:10.1f} {torch_us / us:8.2f}x {ok:>4}")
    print(f"total {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
