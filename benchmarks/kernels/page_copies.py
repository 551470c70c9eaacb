"""A defragmentation plan's page copies over a whole model's key and value tensors: resolved
into one gather and scatter per tensor (`kv.storage.resolve_copies`, what the storages run)
against running the copies one at a time, and checked against it.

Two jobs' pages interleaved at random over ``--used`` pages (each job's pages in a random order
of ids), so the plan (`engine.defrag.plan_defrag`, every page that may move) is made of chains
and cycles through its spare page.

    python3 benchmarks/kernels/page_copies.py [--tensors 64] [--pages 300] [--used 256]
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _common import device_name, report, synchronize  # noqa: E402

from dyngen_core.engine.defrag import plan_defrag  # noqa: E402
from dyngen_core.engine.plan import PageCopy  # noqa: E402
from dyngen_core.kv.storage import copy_page_slots, resolve_copies  # noqa: E402

PAGE_SIZE = 256


def one_at_a_time(tensors: list[torch.Tensor], copies: list[PageCopy]) -> None:
    for copy in copies:
        for tensor in tensors:
            tensor[copy.dst, :copy.num_slots] = tensor[copy.src, :copy.num_slots]


def timed(fn: Callable[[], object]) -> float:
    synchronize()
    start = time.perf_counter()
    fn()
    synchronize()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tensors", type=int, default=64, help="32 layers x keys and values")
    parser.add_argument("--pages", type=int, default=300)
    parser.add_argument("--used", type=int, default=256)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    shape = (args.pages, PAGE_SIZE, args.kv_heads, args.head_dim)
    tensors = [torch.randn(shape, device=device, dtype=dtype) for _ in range(args.tensors)]
    order = list(range(args.used))
    random.Random(0).shuffle(order)
    half = args.used // 2
    plan = plan_defrag([order[:half], order[half:]], [], args.pages, PAGE_SIZE,
                       min_fraction=0.0, max_moves=args.pages)
    assert plan is not None
    check, reference = [t.clone() for t in tensors[:2]], [t.clone() for t in tensors[:2]]
    copy_page_slots(check, resolve_copies(plan.copies, PAGE_SIZE))
    one_at_a_time(reference, plan.copies)
    assert all(torch.equal(a, b) for a, b in zip(check, reference, strict=True))
    del check, reference
    resolved = [timed(lambda: copy_page_slots(tensors, resolve_copies(plan.copies, PAGE_SIZE)))
                for _ in range(3)]
    singly = timed(lambda: one_at_a_time(tensors, plan.copies))
    moved = len(plan.mapping) * args.tensors * PAGE_SIZE * args.kv_heads * args.head_dim
    report("page_copies.defrag_plan", device=device_name(), copies=len(plan.copies),
           pages_moved=len(plan.mapping), tensors=args.tensors,
           gigabytes_moved=moved * tensors[0].element_size() / 1e9,
           resolved_ms=[round(s * 1e3, 2) for s in resolved], one_at_a_time_ms=singly * 1e3)


if __name__ == "__main__":
    main()
