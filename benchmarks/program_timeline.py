"""Where each program of the q8/q4 decode kernel spends its time: a per-program timeline.

A copy of `triton_quant_kernels.quant_decode_kernel`'s source is compiled with clock stamps
(``%globaltimer``, ``%clock64``, ``%smid`` in inline PTX) at five points of every program:
its start, after the step's write (the tail program with the write in the kernel), after the
query is loaded and rotated, after its keys (page blocks or tail), after its partial is
stored. The layer's attention then runs as the runner's step does (`TritonPagedBackend.attend`:
the write in the kernel, the split combine), batch 1 over 16 sequences' pages in turn so L2
holds none of them, replayed from a CUDA graph. Printed: the call's time, and per program kind
(page programs, tail) the median / max cycles of each phase, when programs start and end
(ns after the first start), how many share a multiprocessor.

The stamps go in at anchors of the kernel's source (each must occur once: the tool stops and
names a missing one after an edit of the kernel). Stamps do not wait for loads in flight, so a
phase holds the latency of whatever its first use waits for.

Eleventh session (H200, 16k): the page programs spent ~11k of ~38k cycles before their first
block, in the query's float32 rotation (`triton_rotation`); after the fix the phase is ~1.8k.

    python3 benchmarks/program_timeline.py [--mode q4] [--context 16384] [--write 1]
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import tempfile
from pathlib import Path
from typing import Any

import torch
from _common import add_common_args, bench_config, device_name, report
from attention_kernels import decode_inputs, one_layer_storage
from quant_decode import copies

import dyngen_core.kv.attention.triton.quant as triton_quant
from dyngen_core.kv.attention.triton.paged import TritonPagedBackend

KERNEL_SOURCE = Path(triton_quant.__file__).with_name("triton_quant_kernels.py")
HELPERS = '''

@triton.jit
def _stamp(x):
    return tl.inline_asm_elementwise(
        "mov.u64 $0, %globaltimer; mov.u64 $1, %clock64; mov.u32 $2, %smid;",
        "=l,=l,=r,r", [x], dtype=(tl.int64, tl.int64, tl.int32), is_pure=False, pack=1)


@triton.jit
def _put(probe_ptr, slot, k: tl.constexpr, stamp):
    tl.store(probe_ptr + slot * 16 + 2 * k, stamp[0])
    tl.store(probe_ptr + slot * 16 + 2 * k + 1, stamp[1])
    tl.store(probe_ptr + slot * 16 + 15, stamp[2].to(tl.int64))
'''
STORES = "".join(f"    _put(probe_ptr, slot, {k}, s{k})\n" for k in range(5))
# (anchor, text put before it): the probe argument, the five stamps, their stores, the
# helpers.
INSERTS = [
    ("\n    G: tl.constexpr", " probe_ptr,"),
    ("    token = seq\n", "    s0 = _stamp(seq)\n    slot = (seq * tl.num_programs(1) + "
                         "tl.program_id(1)) * tl.num_programs(2) + tl.program_id(2)\n"),
    ("    ctx = tl.load(context_lens_ptr + seq)\n", "    s1 = _stamp(seq)\n"),
    ("    if PROGRAMS == 1:\n        m_i, l_i, acc = page_program(", "    s2 = _stamp(seq)\n"),
    ("    acc = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]\n", "    s3 = _stamp(seq)\n"),
    ("    if MERGE:\n        counter = counter_ptr", "    s4 = _stamp(seq)\n" + STORES),
    ("\n\n# As `paged_attention_kernel`", HELPERS),
]
PHASES = ("write", "query", "keys", "store")


def stamped_kernel() -> Any:
    """The kernel compiled from its source with the stamps inserted."""
    text = KERNEL_SOURCE.read_text()
    for anchor, before in INSERTS:
        if text.count(anchor) != 1:
            raise SystemExit(f"anchor {anchor!r} occurs {text.count(anchor)} times in "
                             f"{KERNEL_SOURCE.name}: update INSERTS to the kernel")
        text = text.replace(anchor, before + anchor)
    path = Path(tempfile.mkdtemp()) / "stamped_quant_kernels.py"
    path.write_text(text)  # Triton reads a kernel's source from its file
    spec = importlib.util.spec_from_file_location("stamped_quant_kernels", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.quant_decode_kernel


class Stamped:
    """Stands in for the kernel in `triton_quant`: each launch also gets the probe buffer."""

    def __init__(self, kernel: Any, probe: torch.Tensor) -> None:
        self.kernel, self.probe = kernel, probe

    def __getitem__(self, grid: Any) -> Any:
        launch = self.kernel[grid]
        return lambda *args, **kw: launch(*args, probe_ptr=self.probe, **kw)


def summarize(rows: list[list[int]], splits: int) -> None:
    """Print the phase table of one launch's stamps (one row of 16 int64 per program)."""
    programs = splits + 1
    first = min(row[0] for row in rows)
    per_sm: dict[int, int] = {}
    for row in rows:
        per_sm[row[15]] = per_sm.get(row[15], 0) + 1
    print(f"{'kind':5} {'n':>4}" + "".join(f"{p + ' cyc':>16}" for p in PHASES)
          + f"{'total cyc':>16}{'start ns':>14}{'end ns':>14}")
    for kind, chosen in (("page", lambda p: p < splits), ("tail", lambda p: p == splits)):
        picked = [row for i, row in enumerate(rows) if chosen(i % programs)]
        cells = [[row[2 * (k + 1) + 1] - row[2 * k + 1] for row in picked] for k in range(4)]
        cells.append([row[9] - row[1] for row in picked])
        spans = [[row[0] - first for row in picked], [row[8] - first for row in picked]]
        print(f"{kind:5} {len(picked):>4}"
              + "".join(f"{statistics.median(c):>8.0f}/{max(c):<7.0f}" for c in cells)
              + "".join(f"{statistics.median(s):>7.0f}/{max(s):<6.0f}" for s in spans))
    print(f"programs on {len(per_sm)} multiprocessors, at most {max(per_sm.values())} each")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    add_common_args(parser)
    parser.add_argument("--mode", default="q4", choices=("q8", "q4"))
    parser.add_argument("--context", type=int, default=16384)
    parser.add_argument("--write", type=int, default=1,
                        help="1: the step's write in the kernel (the runner's default)")
    args = parser.parse_args()
    device = torch.device("cuda")
    config = bench_config(args)
    storage = one_layer_storage(config, args.mode, 16 * args.context, device)
    storage.reserve_sequences(16)
    batch, q, (k, v) = decode_inputs(config, 1, args.context, device, True)
    backend = TritonPagedBackend(write_in_kernel=bool(args.write))
    kv_heads = config["num_key_value_heads"]
    splits = backend._decode_splits(kv_heads, device)
    probe = torch.zeros(kv_heads * (splits + 1), 16, dtype=torch.int64, device=device)
    triton_quant.quant_decode_kernel = Stamped(stamped_kernel(), probe)  # type: ignore
    group = copies(batch, 1, args.context // 256)

    def run_all() -> None:
        for each in group:
            backend.attend(0, q, k, v, storage, each, q.shape[2] ** -0.5)

    run_all()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run_all()
    times = []
    for _ in range(7):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1000 / len(group))
    us = statistics.median(times)
    print(f"{args.mode} batch 1 at {args.context}: {us:.2f} us a call (attention and combine)")
    summarize(probe.cpu().tolist(), splits)
    report("program_timeline", device=device_name(), mode=args.mode, context=args.context,
           write=args.write, us=us)


if __name__ == "__main__":
    main()
