"""The whole decode step with and without the Triton skinny matmul: a random Llama-3-8B-shape
model, the step replayed from a CUDA graph (eager kernels, or torch.compile'd with --compile)
at a few batch sizes, every product ``F.linear`` (skinny_matmul_rows=0) vs routed through the
kernel for up to ``--rows`` rows; ms per step, the saving, and how far the logits of the two
settings are apart (relative norm; both are bf16 products, summed in another order).

    python benchmarks/skinny_step.py [--batches 1,4,16] [--rows 16] [--context 512]
                                     [--layers 32] [--compile]

Expected (batch 1, eager graph): the step minus ~32 x (qkv + o + reduce-kernel savings) of
benchmarks/skinny_matmul.py's layer-set line. The figures are BENCH json lines
(`_common.report`) and one summary line per batch.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._common import (  # noqa: E402
    device_name,
    graph_step,
    llama3_8b_config,
    random_model,
    report,
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", default="1,4,16", help="batch sizes, comma-separated")
    parser.add_argument("--rows", type=int, default=16, help="skinny_matmul_rows when on")
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--compile", action="store_true", help="torch.compile'd graphs")
    args = parser.parse_args()
    device = torch.device("cuda")
    model = random_model(llama3_8b_config(num_hidden_layers=args.layers), device)
    for batch in (int(b) for b in args.batches.split(",")):
        model.set_skinny_matmul(0)
        torch_s, torch_logits = graph_step(model, batch, args.context, args.compile)
        model.set_skinny_matmul(args.rows)
        skinny_s, skinny_logits = graph_step(model, batch, args.context, args.compile)
        model.set_skinny_matmul(0)
        error = ((skinny_logits - torch_logits).norm() / torch_logits.norm()).item()
        print(f"batch {batch}: F.linear {torch_s * 1e3:.3f} ms, skinny {skinny_s * 1e3:.3f} ms "
              f"per step ({(torch_s - skinny_s) * 1e6:.0f} us saved), logits rel. diff "
              f"{error:.2e}", flush=True)
        report("skinny_step", batch=batch, rows=args.rows, context=args.context,
               compiled=args.compile, layers=args.layers, torch_ms=torch_s * 1e3,
               skinny_ms=skinny_s * 1e3, logits_rel_diff=error, device=device_name())


if __name__ == "__main__":
    main()
