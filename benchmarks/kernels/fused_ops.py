"""The fused RMSNorm (+ residual add) and SiLU-and-mul kernels (`ops.fused_ops`) against the
torch ops they replace, for Llama-3-8B shapes in bf16: per shape, the element-wise set of one
forward (32 layers), and end to end an 8,030-token prefill forward and decode CUDA-graph steps
of the random 32-layer model with the kernels off, on except the rotary embedding, and on.
Other launch shapes: ``--set fused_ops.SILU_BLOCK=1024`` etc.

Floors (H200 copy bandwidth 4.25 TB/s, bytes read + written once; no FLOP floor matters):

    op         shape            bytes (T = 8030)   floor     bytes per row
    norm       T x 4096         131.6 MB           31.0 us   16 KB (read x, write y)
    add_norm   T x 4096         263.1 MB           61.9 us   32 KB (read x, out; write h, y)
    silu_mul   T x 14336        690.7 MB          162.5 us   84 KB (read [2I], write [I])
    per forward (32 x (2 add_norm + silu_mul)) at T = 8030: 38.9 GB -> 9.2 ms
    (the torch ops move ~3x that: float32 intermediates, one kernel per op)

At T = 1 (decode) every op is a launch and a latency (~2-3 us), so the figure is time per call,
not bandwidth. Each measurement replays a CUDA graph of one call per operand copy, rotating over
copies that hold at least 4 x L2 (2 to 64 copies; at T <= 64 the copies fit in L2, as the
decode step's hot residual stream does); the time per call is the median replay over the calls.
The kernels are checked against the torch ops first (BAD: relative error above 1e-2). At T = 1
the per-case line adds torch_host / default_host: host seconds per eager call (launch overhead,
what an eager, uncaptured decode step pays).

    python benchmarks/kernels/fused_ops.py [--rows 1,64,256,8030] [--no-e2e] [--small]
                                           [--set MODULE.NAME=VALUE]

``--small`` runs tiny shapes without graphs (a smoke run, e.g. under TRITON_INTERPRET=1 on a
CPU). The compact table comes last.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks._common import (  # noqa: E402
    LLAMA3_8B,
    device_name,
    free_memory,
    graph_step,
    random_model,
    report,
)
from benchmarks.kernels import constants  # noqa: E402
from benchmarks.kernels.skinny_matmul import per_launch_seconds  # noqa: E402
from dyngen_core.engine.plan import SequenceSlice, StepPlan  # noqa: E402
from dyngen_core.kv.attention import get_backend  # noqa: E402
from dyngen_core.kv.attention.base import build_forward_batch  # noqa: E402
from dyngen_core.kv.cache import Cache  # noqa: E402
from dyngen_core.model import Model  # noqa: E402
from dyngen_core.model.layers import Attention  # noqa: E402
from dyngen_core.ops import fused_ops as fo  # noqa: E402

BANDWIDTH = 4.25e12
LAYERS = 32
EPS = 1e-5


@dataclass(frozen=True)
class Case:
    """One op at one shape: "norm" / "add_norm" over [rows, width], "silu_mul" over
    [rows, 2 * width] -> [rows, width]."""

    op: str
    rows: int
    width: int

    @property
    def nbytes(self) -> int:
        per_row = {"norm": 2, "add_norm": 4, "silu_mul": 3}[self.op] * self.width * 2
        return self.rows * per_row


def operands(case: Case, copies: int, device: torch.device,
             dtype: torch.dtype) -> list[tuple[torch.Tensor, ...]]:
    gen = torch.Generator(device=device).manual_seed(case.rows)
    width = 2 * case.width if case.op == "silu_mul" else case.width
    count = 2 if case.op == "add_norm" else 1
    return [tuple(torch.randn(case.rows, width, generator=gen, device=device, dtype=dtype)
                  for _ in range(count)) for _ in range(copies)]


def torch_call(case: Case, weight: torch.Tensor, ops: tuple[torch.Tensor, ...]) -> torch.Tensor:
    if case.op == "silu_mul":
        return fo.silu_mul_torch(ops[0])
    x = ops[0] + ops[1] if case.op == "add_norm" else ops[0]
    return fo.rms_norm_torch(x, weight, EPS)


def kernel_call(case: Case, weight: torch.Tensor, ops: tuple[torch.Tensor, ...]) -> torch.Tensor:
    if case.op == "silu_mul":
        return fo.launch_silu_mul(ops[0])
    residual = ops[1] if case.op == "add_norm" else None
    return fo.launch_rms_norm(ops[0], weight, EPS, residual)[0]


def measure(case: Case, small: bool, device: torch.device,
            dtype: torch.dtype) -> dict[str, float]:
    """Seconds per call: "torch" and the kernel, "default" (inf: wrong result)."""
    copies = 1 if small else max(2, min(64, -(-(200 << 20) // case.nbytes)))
    all_ops = operands(case, copies, device, dtype)
    weight = 1.0 + 0.1 * torch.randn(case.width, device=device, dtype=dtype)
    reference = torch_call(case, weight, all_ops[0]).float()
    replays = 5 if case.nbytes > (100 << 20) else 10
    seconds = {"torch": per_launch_seconds([partial(torch_call, case, weight, ops)
                                            for ops in all_ops], replays)}
    calls: list[Callable[[], object]] = [partial(kernel_call, case, weight, ops)
                                         for ops in all_ops]
    result = kernel_call(case, weight, all_ops[0]).float()
    error = ((result - reference).norm() / reference.norm()).item()
    seconds["default"] = per_launch_seconds(calls, replays) if error < 1e-2 else float("inf")
    if device.type == "cuda" and case.rows == 1:  # eager decode: is the host the limit?
        seconds["torch_host"] = host_seconds(partial(torch_call, case, weight, all_ops[0]))
        seconds["default_host"] = host_seconds(partial(kernel_call, case, weight, all_ops[0]))
    print(f"{case.op:8} T={case.rows:<5} floor={case.nbytes / BANDWIDTH * 1e6:.1f} " + " ".join(
        f"{key}={_us(value)}" for key, value in seconds.items()), flush=True)
    return seconds


def host_seconds(call: Callable[[], object], calls: int = 200) -> float:
    """Host seconds per eager call (launch overhead), back to back without syncing."""
    call()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        call()
    seconds = (time.perf_counter() - start) / calls
    torch.cuda.synchronize()
    return seconds


def _us(seconds: float) -> str:
    return "BAD" if seconds == float("inf") else f"{seconds * 1e6:.1f}"


def layer_set(results: dict[Case, dict[str, float]], rows_list: list[int]) -> list[str]:
    """Per T: 32 x (2 add_norm + silu_mul), torch ops vs the kernels' defaults (table lines)."""
    lines = []
    for rows in rows_list:
        members = [c for c in results if c.rows == rows and c.op != "norm"]
        weights = [2 if c.op == "add_norm" else 1 for c in members]
        torch_s = LAYERS * sum(w * results[c]["torch"] for c, w in zip(members, weights))
        fused_s = LAYERS * sum(w * results[c]["default"] for c, w in zip(members, weights))
        floor = LAYERS * sum(w * c.nbytes for c, w in zip(members, weights)) / BANDWIDTH
        report("fused_ops_layer_set", rows=rows, torch_ms=torch_s * 1e3,
               fused_ms=fused_s * 1e3, floor_ms=floor * 1e3, device=device_name())
        lines.append(f"{'32 layers':10} {rows:>5} {torch_s * 1e3:>9.3f}ms "
                     f"{fused_s * 1e3:>9.3f}ms {floor * 1e3:>8.3f}ms "
                     f"{torch_s / fused_s:>5.2f}")
    return lines


VARIANTS = ("torch", "no_rotary", "fused")  # end to end: torch ops; kernels but rotary; all


def set_variant(model: Model, variant: str) -> None:
    """Every element-wise op through torch (``torch``), through the kernels (``fused``), or
    through the kernels except the rotary embedding (``no_rotary``: its A/B)."""
    model.set_fused_ops(variant != "torch")
    if variant == "no_rotary":
        for module in model.modules():
            if isinstance(module, Attention):
                module.fused = False


def end_to_end(layers: int, prefill: int, device: torch.device) -> list[str]:
    """The random Llama-3-8B (``layers`` layers): one ``prefill``-token forward (eager, median
    of 3) and decode graph steps at batch 1 and 64 (1024-token contexts), in each `VARIANTS`."""
    model = random_model({**LLAMA3_8B, "num_hidden_layers": layers}, device)
    backend = get_backend("triton", device)
    cache = Cache(model, max_tokens=(prefill // 256 + 2) * 256, mode="fp16")
    pages = list(range(1, prefill // 256 + 2))
    plan = StepPlan([SequenceSlice(0, [1000 + i % 5000 for i in range(prefill)], 0, pages,
                                   sample=True)])
    batch = build_forward_batch(plan, cache.page_size, device)
    lines, timings = [], {}
    for variant in VARIANTS:
        set_variant(model, variant)
        times = []
        for _ in range(4):
            torch.cuda.synchronize()
            start = time.perf_counter()
            model(batch, cache.storage, backend)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        timings[("prefill", variant)] = sorted(times[1:])[1]
    del cache
    free_memory()
    for size in (1, 64):
        for variant in VARIANTS:
            set_variant(model, variant)
            timings[(f"decode b{size}", variant)] = graph_step(model, size, 1024, False)[0]
    for name in ("prefill", "decode b1", "decode b64"):
        off, partial_on, on = (timings[(name, variant)] for variant in VARIANTS)
        report("fused_ops_e2e", step=name, layers=layers, torch_ms=off * 1e3,
               no_rotary_ms=partial_on * 1e3, fused_ms=on * 1e3, device=device_name())
        lines.append(f"{name:10} {prefill if name == 'prefill' else '':>5} {off * 1e3:>9.3f}ms "
                     f"{on * 1e3:>9.3f}ms {'':>10} {off / on:>5.2f}  "
                     f"(rotary unfused {partial_on * 1e3:.3f}ms)")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="1,64,256,8030", help="token counts, comma-separated")
    parser.add_argument("--no-e2e", action="store_true", help="skip the whole-model timings")
    parser.add_argument("--layers", type=int, default=LAYERS, help="layers of the e2e model")
    parser.add_argument("--small", action="store_true", help="tiny shapes, no graphs (smoke)")
    constants.add_argument(parser)
    args = parser.parse_args()
    constants.apply(args.set)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float16
    hidden, inter = (96, 160) if args.small else (4096, 14336)
    rows_list = [int(r) for r in args.rows.split(",")]
    start = time.perf_counter()
    results: dict[Case, dict[str, float]] = {}
    for rows in rows_list:
        for case in (Case("norm", rows, hidden), Case("add_norm", rows, hidden),
                     Case("silu_mul", rows, inter)):
            results[case] = measure(case, args.small, device, dtype)
            free_memory()
    lines = []
    for case, seconds in results.items():
        floor = case.nbytes / BANDWIDTH
        report("fused_ops", op=case.op, rows=case.rows, width=case.width,
               torch_us=seconds["torch"] * 1e6, default_us=seconds["default"] * 1e6,
               floor_us=floor * 1e6,
               torch_host_us=seconds.get("torch_host", 0.0) * 1e6,
               default_host_us=seconds.get("default_host", 0.0) * 1e6, device=device_name())
        lines.append(f"{case.op:10} {case.rows:>5} {seconds['torch'] * 1e6:>9.1f}us "
                     f"{_us(seconds['default']):>9}us "
                     f"{floor * 1e6:>8.1f}us {seconds['torch'] / seconds['default']:>5.2f}"
                     + (f"  host {seconds['torch_host'] * 1e6:.1f} vs "
                        f"{seconds['default_host'] * 1e6:.1f}us" if "torch_host" in seconds
                        else ""))
    lines += layer_set(results, rows_list)
    if device.type == "cuda" and not args.no_e2e and not args.small:
        lines += end_to_end(args.layers, 8030, device)
    print(f"\n{'what':10} {'T':>5} {'torch':>11} {'fused':>11} {'floor':>10} {'x':>5}")
    print("\n".join(lines))
    print(f"total {time.perf_counter() - start:.1f} s on {device_name()}")


if __name__ == "__main__":
    main()
