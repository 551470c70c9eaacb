"""Shared-prefix ("cascade") decode attention, one layer, inside CUDA graphs: plain paged decode
against the cascade as production runs it, and variants of its launch settings (`cascade_path`'s
module constants, patched as `constants` does).

Llama-3-8B shape (32 query heads, 8 KV heads, head_dim 128, bf16 pages of 256 tokens). A case
is ``members`` decodes whose page tables share a document's full pages (the prefix), each with
``document % 256 + 40`` tokens of its own (the document's last partial page, copied by dedup,
and a ~40-token question). Timed, per call, as median graph replays:

- ``plain``: the plain paged decode over every member's whole context;
- ``no_document``: the plain decode of the same members over their 40 own tokens alone (what
  the no-document run pays per layer);
- ``cascade:<variant>``: the whole cascade (the prefix pass, then the own-keys pass that merges
  it), with tables in a fixed region and launches sized by the batch, as a replayed decode
  graph runs it;
- ``prefix:<variant>``: the prefix pass alone, same launch (once per distinct prefix pass:
  variants differing only in the own-keys pass share the first one's row).

A variant patches the constants it names (``VARIANTS``; ``default`` patches none), and
``--set cascade_path.NAME=VALUE`` patches one for the whole run. A variant that beats
``default`` in every column, at the same error (~1e-3 in bf16), is a new default. The goal is
``cascade`` near ``no_document``.

Each graph runs the call over ``copies`` disjoint copies of the pages and queries (more bytes
than the 50 MB L2 in all) and the time is divided by the copies. The last lines are a table.
Floors: the prefix pass reads members' shared pages once (4,096 bytes of KV per token and
layer) and computes members x 32 heads x keys x 128 x 4 FLOPs; plain decode reads members x
context x 4,096 bytes (see BENCHMARKS.md, "3. Shared document", for the figures).

    python benchmarks/kernels/cascade.py [--cases 64x8030,16x8030,64x2048,16x2048]
        [--variants default,own_1split,own_win4,own_n128] [--set cascade_path.NAME=VALUE]

On the CPU (``TRITON_INTERPRET=1``, ``--small``) it runs each call once, without graphs, to
check the script and that every variant agrees with the plain decode.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Callable
from functools import partial
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
from dyngen_core.kv.attention.base import build_forward_batch  # noqa: E402
from dyngen_core.kv.attention.triton import cascade_path  # noqa: E402
from dyngen_core.kv.attention.triton.decode import (  # noqa: E402
    HeadShape,
    page_arguments,
    page_operands,
)
from dyngen_core.kv.attention.triton.paged import TritonPagedBackend  # noqa: E402
from dyngen_core.kv.fp16 import FP16Storage  # noqa: E402

PAGE = 256
QUESTION = 40
# Variant name -> kernel constants it sets (`constants.patched`). "own_*" change the own-keys
# pass: never split, 4 page ids loaded ahead of its tiles, 128-key tiles; "prefix_*" the prefix
# pass: 8 warps, 128 rows x 8 warps x 1 program a multiprocessor, 32-key tiles x 4 stages.
VARIANTS: dict[str, list[str]] = {
    "default": [],
    "own_1split": ["cascade_path.OWN_MAX_SPLITS=1"],
    "own_win4": ["cascade_path.OWN_WINDOW=4"],
    "own_n128": ["cascade_path.OWN_BLOCK_N=128"],
    "prefix_w8": ["cascade_path.PREFIX_WARPS=8"],
    "prefix_m128": ["cascade_path.PREFIX_ROWS=128", "cascade_path.PREFIX_WARPS=8",
                    "cascade_path.PREFIX_PROGRAMS_PER_SM=1"],
    "prefix_n32s4": ["cascade_path.PREFIX_BLOCK_N=32", "cascade_path.PREFIX_STAGES=4"],
}
DEFAULT_VARIANTS = "default,own_1split,own_win4,own_n128"
# Constants that leave the prefix pass as it is: variants differing only in these share its
# timing row.
OWN_KEYS_ONLY = ("cascade_path.OWN_WARPS", "cascade_path.OWN_BLOCK_N",
                 "cascade_path.OWN_MAX_SPLITS", "cascade_path.OWN_WINDOW",
                 "cascade_path.MERGE_SPLIT_BLOCK")
L2_BYTES = 50 << 20


@dataclasses.dataclass
class Case:
    """One shape on the device: ``copies`` batches over disjoint pages, their queries."""

    members: int
    document: int
    storage: FP16Storage
    plans: list[StepPlan]
    no_doc_plans: list[StepPlan]
    queries: list[torch.Tensor]


def build_case(config: dict[str, Any], members: int, document: int, device: torch.device,
               page: int, max_copies: int) -> Case:
    """Random pages for ``copies`` copies of the shape: enough that the shared prefixes alone
    (what the prefix kernel reads) overflow the L2 twice."""
    heads, kv_heads, head_dim = (config["num_attention_heads"], config["num_key_value_heads"],
                                 config["head_dim"])
    shared_pages, own = document // page, document % page + QUESTION
    own_pages = -(-own // page)
    per_token = 2 * kv_heads * head_dim * 2  # K and V, bf16
    copies = max(1, min(max_copies, -(-2 * L2_BYTES // (shared_pages * page * per_token))))
    pages_per_copy = shared_pages + members * own_pages
    shape = ModelConfig.from_dict({**config, "num_hidden_layers": 1})
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    storage = FP16Storage(shape, copies * pages_per_copy + 1, page, dtype, [device])
    storage.keys[0].normal_()
    storage.values[0].normal_()
    plans, no_doc, queries = [], [], []
    for copy in range(copies):
        base = 1 + copy * pages_per_copy
        shared = list(range(base, base + shared_pages))
        own_tables = [list(range(base + shared_pages + i * own_pages,
                                 base + shared_pages + (i + 1) * own_pages))
                      for i in range(members)]
        plans.append(StepPlan([SequenceSlice(i, [1], shared_pages * page + own - 1,
                                             shared + own_tables[i], True)
                               for i in range(members)]))
        no_doc.append(StepPlan([SequenceSlice(i, [1], QUESTION - 1, own_tables[i], True)
                                for i in range(members)]))
        queries.append(torch.randn(members, heads, head_dim, device=device, dtype=dtype))
    return Case(members, document, storage, plans, no_doc, queries)


def graph_calls(case: Case, backend: TritonPagedBackend, device: torch.device
                ) -> tuple[list[Callable[[], torch.Tensor]], list[Callable[[], torch.Tensor]]]:
    """Per copy: the whole cascade and the prefix pass alone, with graph tables."""
    storage, scale = case.storage, case.queries[0].shape[2] ** -0.5
    heads, kv_heads = case.queries[0].shape[1], storage.keys[0].shape[2]
    graph_tables = backend.cascade.graph_tables(storage, heads, kv_heads, capacity=case.members)
    writer = graph_tables.stage(case.plans[0]) if graph_tables is not None else None
    if graph_tables is None or writer is None:
        raise RuntimeError("the case planned no cascade")
    region = torch.zeros(graph_tables.size, dtype=torch.int32)
    writer(region.numpy())
    tables = graph_tables.views(region.to(device), case.members)
    ops = page_operands(storage, 0)
    whole: list[Callable[[], torch.Tensor]] = []
    prefix: list[Callable[[], torch.Tensor]] = []
    for plan, q in zip(case.plans, case.queries, strict=True):
        batch = dataclasses.replace(build_forward_batch(plan, storage.page_size, device),
                                    page_tables_host=None, graph_tables=tables)
        head_shape = HeadShape.of(q, ops)
        launch = backend.cascade.prefix_launch(ops, batch, tables, head_shape,
                                               cascade_path.multiprocessors(device))
        page_args = page_arguments(ops, q)
        whole.append(partial(backend.attend_cached, 0, q, storage, batch, scale))
        prefix.append(partial(_prefix_parts, q, ops, page_args, batch, tables,
                              scale * cascade_path.LOG2_E, launch))
    return whole, prefix


def _prefix_parts(*args: Any) -> torch.Tensor:
    return cascade_path.attend_prefixes(*args)[0]


def plain_calls(case: Case, plans: list[StepPlan], device: torch.device
                ) -> list[Callable[[], torch.Tensor]]:
    backend = TritonPagedBackend(cascade_min_saved_keys=None)
    scale = case.queries[0].shape[2] ** -0.5
    calls: list[Callable[[], torch.Tensor]] = []
    for plan, q in zip(plans, case.queries, strict=True):
        batch = build_forward_batch(plan, case.storage.page_size, device)
        calls.append(partial(backend.attend_cached, 0, q, case.storage, batch, scale))
    return calls


def time_calls(calls: list[Callable[[], torch.Tensor]], repeats: int
               ) -> tuple[float, torch.Tensor]:
    """Median seconds per call of one graph running every call in turn (compiled and warmed up
    first), and the first call's output. Without CUDA: one eager pass, untimed (0)."""
    if not torch.cuda.is_available():
        return 0.0, calls[0]()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for call in calls:
            call()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = [call() for call in calls]
    return cuda_seconds(graph.replay, repeats, warmup=2) / len(calls), outs[0]


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.float(), ref.float()
    return float((out - ref).norm() / ref.norm())


def run_case(case: Case, variants: list[str], device: torch.device, repeats: int
             ) -> list[tuple[str, float, float]]:
    """(name, us per call, relative error against plain) of every timed call of a case."""
    rows: list[tuple[str, float, float]] = []
    plain_s, plain_out = time_calls(plain_calls(case, case.plans, device), repeats)
    rows.append(("plain", plain_s * 1e6, 0.0))
    no_doc_s, _ = time_calls(plain_calls(case, case.no_doc_plans, device), repeats)
    rows.append(("no_document", no_doc_s * 1e6, float("nan")))
    prefix_timed: dict[tuple[str, ...], str] = {}
    for name in variants:
        with constants.patched(VARIANTS[name]):
            backend = TritonPagedBackend(cascade_min_saved_keys=0)  # cascades every prefix
            whole, prefix = graph_calls(case, backend, device)
            seconds, out = time_calls(whole, repeats)
            rows.append((f"cascade:{name}", seconds * 1e6, relative_error(out, plain_out)))
            key = tuple(sorted(setting for setting in VARIANTS[name]
                               if setting.partition("=")[0] not in OWN_KEYS_ONLY))
            if key in prefix_timed:  # the same prefix pass as an earlier variant's
                continue
            prefix_timed[key] = name
            prefix_s, _ = time_calls(prefix, repeats)
            rows.append((f"prefix:{name}", prefix_s * 1e6, float("nan")))
    for name, us, error in rows:
        report("cascade_kernel", device=device_name(), members=case.members,
               document=case.document, copies=len(case.plans), call=name, us=us,
               relative_error=error)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    add_common_args(parser)
    parser.add_argument("--cases", default="64x8030,16x8030,64x2048,16x2048",
                        help="members x document tokens, comma-separated")
    parser.add_argument("--variants", default=DEFAULT_VARIANTS,
                        help=f"comma-separated, of {', '.join(VARIANTS)}")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--max-copies", type=int, default=16)
    constants.add_argument(parser)
    args = parser.parse_args()
    constants.apply(args.set)
    device = torch.device(args.device)
    if device.type != "cuda":
        # The interpreter needs the GPU tests' patch for Triton 3.6 with numpy >= 2.4.
        import tests.gpu.conftest  # noqa: F401
    config = bench_config(args)
    variants = args.variants.split(",")
    unknown = [name for name in variants if name not in VARIANTS]
    if unknown:
        raise SystemExit(f"unknown variants {unknown}; choose from {', '.join(VARIANTS)}")
    page = PAGE if not args.small else 16
    table: list[tuple[str, list[tuple[str, float, float]]]] = []
    for spec in args.cases.split(","):
        members, document = (int(x) for x in spec.split("x"))
        if args.small:
            members, document = min(members, 8), min(document, 70)
        case = build_case(config, members, document, device, page,
                          args.max_copies if device.type == "cuda" else 1)
        table.append((f"{members}x{document}", run_case(case, variants, device, args.repeats)))
        del case
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    print(f"\n{'call':22}" + "".join(f"{label:>16}" for label, _ in table))
    for index, (name, _, _) in enumerate(table[0][1]):
        cells = "".join(f"{rows[index][1]:>9.1f} {rows[index][2]:>6.0e}"
                        if rows[index][2] == rows[index][2] else f"{rows[index][1]:>16.1f}"
                        for _, rows in table)
        print(f"{name:22}{cells}")
    print("(us per call; relative error of the cascade's output against plain)")


if __name__ == "__main__":
    main()
