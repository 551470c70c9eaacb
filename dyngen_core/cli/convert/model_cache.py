"""The dyngen model cache: where downloaded GGUF files and converted model folders live, and how
a converted folder comes into place whole.

A folder is converted into a staging folder beside its target, marked finished with
`COMPLETE_MARKER` (which records where it came from), and moved into place in one rename, so an
interrupted run never leaves a half-written model behind and a finished one is found at once.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dyngen_core.config import cache_root
from dyngen_core.errors import ConversionError

# Written last into a finished folder; its presence is what "already converted" means.
COMPLETE_MARKER = ".dyngen-complete.json"

Converter = Callable[..., Path]  # convert_gguf(gguf_path, out_dir, progress=...) -> out_dir


def downloads_dir() -> Path:
    """Where downloaded GGUF files are kept, so converting again needs no second download."""
    return cache_root() / "downloads"


def is_complete(folder: Path) -> bool:
    """Whether ``folder`` holds a finished conversion."""
    return (folder / COMPLETE_MARKER).is_file() and (folder / "config.json").is_file()


def check_free(target: Path, what: str) -> None:
    """Raise ConversionError when ``target`` exists, is not empty and is not a finished
    conversion (``what`` names the model for the message)."""
    if target.exists() and not is_complete(target) and any(target.iterdir()):
        raise ConversionError(
            f"{str(target)!r} exists, is not empty and holds no finished {what}; remove it or "
            "choose another folder"
        )


def convert_into_place(gguf_path: Path, target: Path, provenance: dict[str, Any],
                       convert: Converter, *, progress: bool = False) -> Path:
    """Convert ``gguf_path`` with ``convert`` into a staging folder beside ``target``, mark it
    finished (the marker holds ``provenance``) and move it to ``target`` in one rename."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f".{target.name}.", dir=target.parent) as work:
        staged = Path(work) / "model"
        convert(gguf_path, staged, progress=progress)
        (staged / COMPLETE_MARKER).write_text(json.dumps(provenance) + "\n", encoding="utf-8")
        _move_into_place(staged, target)
    return target


def _move_into_place(staged: Path, target: Path) -> None:
    if target.exists() and not any(target.iterdir()):
        target.rmdir()
    try:
        os.replace(staged, target)
    except OSError:
        # Another process finished first: its folder is as good as ours.
        if not is_complete(target):
            raise
        shutil.rmtree(staged, ignore_errors=True)
