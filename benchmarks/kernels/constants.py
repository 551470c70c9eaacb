"""The kernel constants a microbenchmark runs with. Production reads its launch shapes from
module constants at call time (`decode.BLOCK_N`, `quant_decode.PAGE_WINDOW`, `fused_ops.SILU_BLOCK`,
...); a benchmark measures another setting by patching them:

    python benchmarks/kernels/decode_attention.py --set decode.PAGE_WINDOW=0

``MODULE`` is one of `MODULES`; ``VALUE`` a Python literal. `patched` applies settings for a
block (variants measured side by side in one run).
"""

from __future__ import annotations

import argparse
import ast
import importlib
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from types import ModuleType

MODULES = {
    "decode": "dyngen_core.kv.attention.triton.decode",
    "merge": "dyngen_core.kv.attention.triton.merge",
    "prefill": "dyngen_core.kv.attention.triton.prefill",
    "quant_decode": "dyngen_core.kv.attention.triton.quant_decode",
    "cascade_path": "dyngen_core.kv.attention.triton.cascade_path",
    "fused_ops": "dyngen_core.ops.fused_ops",
    "skinny_matmul": "dyngen_core.ops.skinny_matmul",
    "fused": "dyngen_core.sampling.fused",
}


def add_argument(parser: argparse.ArgumentParser) -> None:
    """``--set MODULE.NAME=VALUE`` (repeatable): run with that kernel constant."""
    parser.add_argument("--set", action="append", default=[], metavar="MODULE.NAME=VALUE",
                        help=f"patch a kernel constant for the whole run; modules: "
                             f"{', '.join(MODULES)}")


def _parse(setting: str) -> tuple[ModuleType, str, object]:
    target, _, text = setting.partition("=")
    module_name, _, name = target.partition(".")
    if module_name not in MODULES or not name or not text:
        raise SystemExit(f"--set {setting!r}: use MODULE.NAME=VALUE with MODULE one of "
                         f"{', '.join(MODULES)}")
    module = importlib.import_module(MODULES[module_name])
    if not hasattr(module, name):
        raise SystemExit(f"--set {setting!r}: {MODULES[module_name]} has no constant {name}")
    try:
        value = ast.literal_eval(text)
    except (ValueError, SyntaxError):
        raise SystemExit(f"--set {setting!r}: {text!r} is not a Python literal") from None
    return module, name, value


def apply(settings: Sequence[str]) -> None:
    """Patch every ``MODULE.NAME=VALUE`` of ``settings`` for the rest of the process."""
    for setting in settings:
        module, name, value = _parse(setting)
        setattr(module, name, value)


@contextmanager
def patched(settings: Sequence[str]) -> Iterator[None]:
    """The ``settings`` applied inside the block, the previous values restored after it."""
    saved = []
    for setting in settings:
        module, name, value = _parse(setting)
        saved.append((module, name, getattr(module, name)))
        setattr(module, name, value)
    try:
        yield
    finally:
        for module, name, value in reversed(saved):
            setattr(module, name, value)
