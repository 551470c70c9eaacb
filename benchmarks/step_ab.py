"""The bare decode step with kernel constants patched, variants alternating in one process:
the A/B a kernel change of the decode path must win before it becomes the default.

Each ``--variant`` is a comma-separated list of ``MODULE.NAME=VALUE`` settings
(benchmarks/kernels/constants.py; "" runs the code as it is). The step is a decode graph of
``--batch`` sequences at ``--context`` tokens over the random Llama-3-8B-shape model of
`_common`, timed over ``--steps`` replays, ``--rounds`` times each variant in turn, after
`_common.enter_generator_state` (the graphs of a process that has captured more than three run
slower; a generator always has: BENCHMARKS.md, section 1). Prints each step in ms, its share
of the memory roofline (weights over the copy bandwidth measured in the same run), its ratio
to the first variant of the round, and the largest logit difference from the first variant.

    python3 benchmarks/step_ab.py --variant "" --variant skinny_matmul.GATED=False
        [--rounds 3] [--batch 1] [--context 640] [--steps 300] [--compiled]
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._common import (  # noqa: E402
    add_common_args,
    bench_config,
    copy_bandwidth,
    device_name,
    enter_generator_state,
    graph_step,
    random_model,
    report,
    weight_bytes,
)
from benchmarks.kernels import constants  # noqa: E402
from dyngen_core import Model  # noqa: E402


def variant_settings(variant: str) -> list[str]:
    """The ``MODULE.NAME=VALUE`` settings of one ``--variant`` (comma-separated; "" for
    none)."""
    return [setting.strip() for setting in variant.split(",") if setting.strip()]


def alternate(model: Model, variants: Mapping[str, Callable[[], AbstractContextManager[object]]],
              *, rounds: int, batch: int = 1, context: int = 640, steps: int = 300,
              compiled: bool = False, benchmark: str = "step_ab") -> None:
    """Time ``model``'s decode graph step under each variant in turn (``variants``: label ->
    a context manager factory that sets the variant up and restores the code after), ``rounds``
    times, after `enter_generator_state`; print and report (as ``benchmark``) each step's ms,
    roofline share, ratio to the round's first variant and largest logit difference from it."""
    device = model.device
    roofline_tps = copy_bandwidth(device) / weight_bytes(model)
    enter_generator_state(model)
    for round_index in range(rounds):
        first: tuple[float, torch.Tensor] | None = None
        for label, variant in variants.items():
            with variant():
                seconds, logits = graph_step(model, batch, context, compiled, steps=steps)
            if first is None:
                first = (seconds, logits.float())
            ratio, diff = seconds / first[0], (logits.float() - first[1]).abs().max().item()
            print(f"round {round_index} {label or '(as is)':50s} {seconds * 1e3:.4f} ms "
                  f"{100 / seconds / roofline_tps:5.1f} % of the roofline, {ratio:.4f} of the "
                  f"first, logits differ by {diff:.3g}", flush=True)
            report(benchmark, variant=label, round=round_index, step_ms=seconds * 1e3,
                   roofline_fraction=1 / seconds / roofline_tps, ratio=ratio, max_diff=diff,
                   batch=batch, context=context, compiled=compiled, device=device_name())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    add_common_args(parser)
    parser.add_argument("--variant", action="append", required=True,
                        help="comma-separated MODULE.NAME=VALUE settings; \"\" for none")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--context", type=int, default=640)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--compiled", action="store_true", help="torch.compile the step")
    args = parser.parse_args()
    model = random_model(bench_config(args), torch.device(args.device))
    variants = {label: partial(constants.patched, variant_settings(label))
                for label in args.variant}
    alternate(model, variants, rounds=args.rounds, batch=args.batch, context=args.context,
              steps=args.steps, compiled=args.compiled)


if __name__ == "__main__":
    main()
