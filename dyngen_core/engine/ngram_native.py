"""The compiled n-gram index: `ngram_native.c`, built with the machine's C compiler on first use
and kept in the dyngen cache (`config.cache_root`, ``native/``; where that cannot be written,
this user's folder in the temporary directory), keyed by the source and the interpreter.

It is `speculation.NgramIndex` with the same keys, table contents and drafts (the tests hold
both to the same answers), without a Python dictionary store per n-gram: `NgramDrafter` uses it
wherever it can be built, and the Python index where it cannot (no C compiler or Python
headers, a compiler error, ``max_n`` above `MAX_N`), with one warning naming why. Pure Python
otherwise: no torch.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.machinery
import importlib.util
import logging
import os
import shlex
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path
from typing import Any

from dyngen_core.config import cache_root

_SOURCE = Path(__file__).with_name("ngram_native.c")
_MODULE = "dyngen_ngram_native"
# The longest n-gram the compiled index looks up (a key of 21 bits a token shares a 128-bit
# slot with its 32-bit value).
MAX_N = 4
# A build slower than this is abandoned (the Python index serves meanwhile).
BUILD_TIMEOUT_S = 120.0

_log = logging.getLogger("dyngen")


class NativeBuildError(RuntimeError):
    """The compiled index could not be built or loaded (the message says why)."""


def compiled_ngram(max_n: int = 4) -> Any | None:
    """The compiled module for indexes looking up ``max_n`` tokens, or None where it cannot
    serve (``max_n`` above `MAX_N`, or the build failed: warned once). It holds
    ``NgramIndex`` (`speculation.NgramIndex`'s twin) and ``propose_all`` (`speculation.
    propose_all`'s)."""
    if max_n > MAX_N:
        return None
    try:
        return _load()
    except NativeBuildError as error:
        _warn_once(str(error))
        return None


@functools.cache
def _warn_once(reason: str) -> None:
    _log.warning("n-gram drafting uses the Python index, several times slower on the host: %s",
                 reason)


@functools.cache
def _load() -> Any:
    """The built module (built first when the cache lacks it); raises NativeBuildError."""
    path = built_path()
    if not path.is_file():
        path = _built_somewhere(path)
    loader = importlib.machinery.ExtensionFileLoader(_MODULE, str(path))
    spec = importlib.util.spec_from_file_location(_MODULE, path, loader=loader)
    if spec is None:
        raise NativeBuildError(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    try:
        loader.exec_module(module)
    except ImportError as error:
        raise NativeBuildError(f"cannot load {path}: {error}") from error
    return module


def _built_somewhere(path: Path) -> Path:
    """Build into ``path``, or where its folder cannot be written (a read-only home in a
    container), into this user's folder in the temporary directory; the path built."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        writable = os.access(path.parent, os.W_OK)
    except OSError:
        writable = False
    if not writable:
        user = os.getuid() if hasattr(os, "getuid") else "user"
        path = Path(tempfile.gettempdir()) / f"dyngen-native-{user}" / path.name
        if path.is_file():
            return path
    build(path)
    return path


def built_path() -> Path:
    """Where the build of this source for this interpreter lives."""
    digest = hashlib.sha256(_SOURCE.read_bytes())
    digest.update(f"{sys.version}|{sys.platform}".encode())
    suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
    return cache_root() / "native" / f"ngram_native-{digest.hexdigest()[:16]}{suffix}"


def build(path: Path) -> None:
    """Compile `ngram_native.c` into ``path`` (written beside it, then renamed into place, so
    that concurrent builds never load a half-written file); raises NativeBuildError."""
    linker = sysconfig.get_config_var("LDSHARED")
    include = sysconfig.get_paths().get("include")
    if not linker or not include or not (Path(include) / "Python.h").is_file():
        raise NativeBuildError("no C compiler or Python headers are known to this interpreter")
    try:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        handle, staged = tempfile.mkstemp(suffix=path.suffix, dir=path.parent)
        os.close(handle)
    except OSError as error:
        raise NativeBuildError(f"cannot write to {path.parent}: {error}") from error
    command = [*shlex.split(linker), "-O2", "-fPIC", "-std=gnu11", f"-I{include}",
               str(_SOURCE), "-o", staged]
    try:
        done = subprocess.run(command, capture_output=True, text=True,
                              timeout=BUILD_TIMEOUT_S, check=False)
        if done.returncode != 0:
            raise NativeBuildError(f"`{shlex.join(command)}` failed: {done.stderr[-2000:]}")
        os.replace(staged, path)
    except (OSError, subprocess.TimeoutExpired) as error:
        raise NativeBuildError(f"`{shlex.join(command)}` could not run: {error}") from error
    finally:
        if os.path.exists(staged):
            os.unlink(staged)


__all__ = ["MAX_N", "NativeBuildError", "build", "built_path", "compiled_ngram"]
