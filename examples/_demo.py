"""Shared by the examples: the model folder to use (argument, $DYNGEN_MODEL, or the demo)."""

from __future__ import annotations

import os
import sys
from pathlib import Path


def model_dir() -> Path:
    """The model folder from argv[1] or $DYNGEN_MODEL; otherwise the demo model (fetched and
    converted on first use)."""
    if len(sys.argv) > 1:
        return Path(sys.argv[1])
    if os.environ.get("DYNGEN_MODEL"):
        return Path(os.environ["DYNGEN_MODEL"])
    from dyngen_core.cli.convert.demo import fetch_demo_model

    return fetch_demo_model()
