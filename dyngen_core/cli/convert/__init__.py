"""Model conversion: GGUF files to Hugging Face folders, the cached demo model and the cached
speculative-decoding pair.

The names below load their module on first use, so registering the subcommands (`pair_command`)
does not import numpy and `tokenizers` into every ``dyngen`` call.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from dyngen_core.cli.convert.demo import default_demo_dir, fetch_demo_model
    from dyngen_core.cli.convert.gguf import convert_gguf
    from dyngen_core.cli.convert.speculative_pair import (
        SpeculativePair,
        default_pair_dirs,
        fetch_speculative_pair,
    )

_HOMES = {
    "convert_gguf": "gguf",
    "default_demo_dir": "demo",
    "fetch_demo_model": "demo",
    "SpeculativePair": "speculative_pair",
    "default_pair_dirs": "speculative_pair",
    "fetch_speculative_pair": "speculative_pair",
}

__all__ = ["SpeculativePair", "convert_gguf", "default_demo_dir", "default_pair_dirs",
           "fetch_demo_model", "fetch_speculative_pair"]


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{home}"), name)
