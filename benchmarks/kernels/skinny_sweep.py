"""One-row launch settings of the skinny matmul's reduce kernel (`ops.skinny_matmul`), swept per
Llama-3-8B weight shape, then the best settings against the table (`DEFAULT_CONFIGS`) in the
whole batch-1 decode step.

1. Sweep: every ``block_n`` x ``block_k`` x ``num_stages`` x ``num_warps`` of the grid below
   for one row, timed as `skinny_matmul.py` times a launch (a CUDA graph over weight copies
   that overflow the L2); prints each shape's best eight and the table's own setting.
2. Each shape class's best setting (`best_per_class`): the least time of one decode step's
   launches of the class's swept shapes (q/k/v, o, down and gate/up once a layer, lm_head
   once a step).
3. ``--step-ab``: the bare decode graph step (batch 1, 640 tokens of context, the random 8B
   model of `_common`) with the table as it is and with those best settings, alternating
   ``--rounds`` times: a setting that wins a launch alone must also win the step, where each
   launch follows other kernels (`step_ab.alternate`: after `_common.enter_generator_state`,
   in the state a generator's graphs run in; BENCHMARKS.md, section 1).

    python benchmarks/kernels/skinny_sweep.py [--shapes qkv,o,down,gate_up,lm_head]
        [--step-ab] [--rounds 3]

A class's best counts only its shapes that were swept: sweep gate_up and lm_head together
before changing the "wide" entry.
"""

from __future__ import annotations

import argparse
import itertools
import sys
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from functools import partial
from pathlib import Path
from types import MappingProxyType

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._common import (  # noqa: E402
    add_common_args,
    bench_config,
    device_name,
    random_model,
    report,
)
from benchmarks.kernels.skinny_matmul import (  # noqa: E402
    SHAPES,
    per_launch_seconds,
    replays_for,
    weight_copies,
)
from benchmarks.step_ab import alternate  # noqa: E402
from dyngen_core.ops import skinny_matmul  # noqa: E402
from dyngen_core.ops.skinny_matmul import SkinnyConfig, launch, shape_class  # noqa: E402

GRID = {"block_n": (4, 8, 16, 32), "block_k": (256, 512, 1024), "num_stages": (1, 2, 3, 4),
        "num_warps": (2, 4, 8)}
STEP_CONTEXT = 640
# Launches of each shape in one decode step of the 32-layer model.
LAUNCHES_A_STEP = {"qkv": 32, "o": 32, "down": 32, "gate_up": 32, "lm_head": 1}


def sweep_shape(name: str, n: int, k: int,
                device: torch.device) -> list[tuple[float, SkinnyConfig]]:
    """(seconds per launch, setting) of every grid setting for one row of ``name``, fastest
    first; settings whose product is off by more than 1e-2 (relative) are left out."""
    nbytes = n * k * 2
    gen = torch.Generator(device=device).manual_seed(n)
    weights = weight_copies(n, k, device, torch.bfloat16, gen)
    xs = [torch.randn(1, k, generator=gen, device=device, dtype=torch.bfloat16)
          for _ in weights]
    reference = F.linear(xs[0], weights[0]).float()
    timed: list[tuple[float, SkinnyConfig]] = []
    for values in itertools.product(*GRID.values()):
        config = SkinnyConfig("reduce", **dict(zip(GRID, values, strict=True)))

        def call(x: torch.Tensor, w: torch.Tensor, config: SkinnyConfig = config) -> torch.Tensor:
            out = torch.empty(1, n, device=device, dtype=torch.bfloat16)
            launch(x, w, None, out, config)
            return out

        error = ((call(xs[0], weights[0]).float() - reference).norm() / reference.norm()).item()
        if error > 1e-2:
            continue
        seconds = per_launch_seconds([partial(call, x, w) for x, w in zip(xs, weights,
                                                                            strict=True)],
                                     replays_for(nbytes))
        timed.append((seconds, config))
        report("skinny_sweep", shape=name, us=seconds * 1e6, tbps=nbytes / seconds / 1e12,
               **{key: getattr(config, key) for key in GRID}, device=device_name())
    timed.sort(key=lambda item: item[0])
    return timed


def print_shape(name: str, n: int, k: int, timed: list[tuple[float, SkinnyConfig]]) -> None:
    table = skinny_matmul.default_config(1, n, k)
    print(f"== {name} ({n} x {k}); the table's setting: {table}")
    for seconds, config in timed[:8]:
        print(f"  {seconds * 1e6:7.2f} us  " + " ".join(f"{key}={getattr(config, key)}"
                                                       for key in GRID))
    for seconds, config in timed:
        if config == table:
            print(f"  the table's: {seconds * 1e6:7.2f} us")


def best_per_class(timed: dict[str, list[tuple[float, SkinnyConfig]]]
                   ) -> dict[tuple[str, str], SkinnyConfig]:
    """The one-row table entry each swept shape class would take: the setting with the least
    time over a decode step's launches of the class's swept shapes (``timed``: seconds per
    launch and setting, per shape name of `SHAPES`), among the settings timed for all of
    them."""
    classes: dict[tuple[str, str], list[str]] = {}
    for name in timed:
        n, k = SHAPES[name]
        classes.setdefault(shape_class(1, n, k), []).append(name)
    best: dict[tuple[str, str], SkinnyConfig] = {}
    for key, names in classes.items():
        per_shape = [{config: seconds for seconds, config in timed[name]} for name in names]
        common = set.intersection(*(set(times) for times in per_shape))
        if not common:
            continue
        best[key] = min(common, key=lambda config: sum(
            LAUNCHES_A_STEP[name] * times[config]
            for name, times in zip(names, per_shape, strict=True)))
    return best


def step_ab(best: dict[tuple[str, str], SkinnyConfig], rounds: int,
            device: torch.device) -> None:
    """The bare decode step with the table as it is against the table with ``best``
    (`step_ab.alternate`)."""
    model = random_model(bench_config(_common_args()), device)
    variants = {"table": nullcontext, "swept": partial(_table_with, best)}
    alternate(model, variants, rounds=rounds, context=STEP_CONTEXT,
              benchmark="skinny_sweep.step")


@contextmanager
def _table_with(best: dict[tuple[str, str], SkinnyConfig]) -> Iterator[None]:
    """`skinny_matmul.DEFAULT_CONFIGS` with ``best``'s entries, restored after the block."""
    original = skinny_matmul.DEFAULT_CONFIGS
    skinny_matmul.DEFAULT_CONFIGS = MappingProxyType({**original, **best})
    try:
        yield
    finally:
        skinny_matmul.DEFAULT_CONFIGS = original


def _common_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_common_args(parser)
    return parser.parse_args([])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--shapes", default="qkv,o,down,gate_up")
    parser.add_argument("--step-ab", action="store_true")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("the sweep times CUDA launches: run it on a GPU")
    device = torch.device("cuda")
    timed: dict[str, list[tuple[float, SkinnyConfig]]] = {}
    for name in args.shapes.split(","):
        n, k = SHAPES[name]
        timed[name] = sweep_shape(name, n, k, device)
        print_shape(name, n, k, timed[name])
    best = best_per_class(timed)
    for key, config in best.items():
        print(f"best for {key}: {config}")
    if args.step_ab and best:
        step_ab(best, args.rounds, device)


if __name__ == "__main__":
    main()
