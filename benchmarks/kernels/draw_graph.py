"""Host time of one sampled step's draw on the GPU: `Sampler.launch_tokens` for 256 top-p rows
(temperature 0.8, top_p 0.9, top_k 50) over [256, 128256] float32 logits, with the fused draw
launched eagerly (top-k, output, Triton kernel) or replayed from its CUDA graph
(`sampling.draw.DrawGraphs`), and the bare replay of that graph. Host microseconds per call (median;
the device is synchronized after each call, outside the clock: a call queued behind the last
one's device work would wait for it, as the keys' pinned buffer is reused), and the device
time per call from CUDA events. Each path runs with each fused top-k asked for (``--topk``:
torch.topk, the Triton top-k of `sampling.fused`, or both). ``--set fused.NAME=VALUE``
patches a constant of `sampling.fused` (`constants`). Figures: BENCHMARKS.md, "5. Host
overhead".

    python benchmarks/kernels/draw_graph.py [--rows 256] [--vocab 128256] [--calls 200]
        [--topk torch|triton|both] [--set MODULE.NAME=VALUE]
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks._common import device_name, report  # noqa: E402
from benchmarks.kernels import constants  # noqa: E402
from dyngen_core import SamplerSettings  # noqa: E402
from dyngen_core.engine.record import SampleRequest  # noqa: E402
from dyngen_core.sampling.sampler import Sampler  # noqa: E402

SETTINGS = SamplerSettings(temperature=0.8, top_p=0.9, top_k=50)


def host_us(call: Callable[[], Any], calls: int) -> tuple[float, float]:
    """(median host us per call, device us per call) over ``calls`` calls after a warm-up (the
    device figure includes the host's gaps between calls: an upper bound)."""
    for _ in range(5):
        call()
    torch.cuda.synchronize()
    times = []
    start_event, end_event = torch.cuda.Event(enable_timing=True), torch.cuda.Event(
        enable_timing=True)
    start_event.record()
    for _ in range(calls):
        begin = time.perf_counter()
        call()
        times.append(time.perf_counter() - begin)
        torch.cuda.synchronize()
    end_event.record()
    torch.cuda.synchronize()
    return sorted(times)[len(times) // 2] * 1e6, start_event.elapsed_time(end_event) * 1e3 / calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--topk", choices=("torch", "triton", "both"), default="both",
                        help="the fused draw's top-k (Sampler's fused_topk)")
    constants.add_argument(parser)
    args = parser.parse_args()
    constants.apply(args.set)
    device = torch.device("cuda")
    logits = torch.randn(args.rows, args.vocab, device=device) * 3
    requests = [SampleRequest(settings=SETTINGS, seed=i, counter=0) for i in range(args.rows)]
    results = {}
    for topk in ("torch", "triton") if args.topk == "both" else (args.topk,):
        for graphs in (False, True):
            sampler = Sampler(args.vocab, device, draw_graphs=graphs, fused_topk=topk)

            def step(sampler: Sampler = sampler) -> None:
                for request in requests:
                    request.counter += 1
                sampler.launch_tokens(logits, requests, kept=True)

            results[("graph" if graphs else "eager", topk)] = host_us(step, args.calls)
            if graphs:
                assert sampler.draw_graphs is not None
                entry = next(iter(sampler.draw_graphs._graphs.values()))
                results[("replay only", topk)] = host_us(entry.graph.replay, args.calls)
    for (name, topk), (host, device_us) in results.items():
        report("draw_graph", device=device_name(), rows=args.rows, vocab=args.vocab,
               path=name, topk=topk, host_us=host, device_us=device_us)
    print(f"{'path':<12} {'top-k':<7} {'host us':>9} {'device us':>10}")
    for (name, topk), (host, device_us) in results.items():
        print(f"{name:<12} {topk:<7} {host:9.1f} {device_us:10.1f}")


if __name__ == "__main__":
    main()
