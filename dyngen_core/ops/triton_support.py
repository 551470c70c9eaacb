"""Where the optional Triton kernels run, decided in one place: whether a kernel with a torch twin
runs on a device (`triton_by_default`, `require_triton`), the device context its launches run in
(`launch_device`), and the ``triton`` / ``tl`` / ``libdevice`` names every kernel module imports
from here.

Triton is never required (CI has none): a kernel runs by default on CUDA when triton is
installed, and on the CPU only under ``TRITON_INTERPRET=1`` (the interpreter tests use), when
asked for explicitly. Without triton the kernel modules still import: ``triton.jit`` then makes
each kernel an object that raises when launched, which the routing above never does.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch


class _NoTritonKernel:
    """A kernel defined where triton is not installed: launching it raises."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __getitem__(self, grid: object) -> Callable[..., None]:
        raise RuntimeError(f"the Triton kernel {self.name} cannot launch: triton is not "
                           "installed (its torch twin runs instead; install triton to use it)")

    def __call__(self, *args: object, **kwargs: object) -> None:
        self[None]()


class _NoTriton:
    """Stands in for ``triton`` and ``triton.language`` where triton is not installed, so the
    kernel modules import (the kernels are then `_NoTritonKernel`s)."""

    def jit(self, fn: Callable[..., Any] | None = None, **options: object) -> Any:
        if fn is None:
            return self.jit
        return _NoTritonKernel(fn.__name__)

    def constexpr(self, value: object = None) -> object:
        return value


try:
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice
except ImportError:
    triton = tl = _NoTriton()
    libdevice = None  # read only inside kernels, which never run without triton


def triton_by_default(device: torch.device) -> bool:
    """Whether a Triton kernel with a torch twin runs on ``device`` when not told: on CUDA,
    with triton installed."""
    return device.type == "cuda" and importlib.util.find_spec("triton") is not None


def require_triton(device: torch.device, option: str) -> None:
    """Raise ValueError, naming the ``option`` that asked for it, when a Triton kernel cannot
    run on ``device`` (no triton, or neither CUDA nor the interpreter)."""
    if importlib.util.find_spec("triton") is None:
        raise ValueError(f"{option}=True needs triton installed; pass {option}=None")
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(f"{option}=True needs a CUDA device (got {device}), or "
                         "TRITON_INTERPRET=1 to run the kernel on the CPU in tests")


def launch_device(device: torch.device) -> AbstractContextManager[object]:
    """The context a Triton launch on ``device`` runs in: Triton launches on the current CUDA
    device, so a tensor on another GPU (a layer split over devices) needs its own; entered
    only then, since the switch costs host time on every eager launch."""
    if device.type == "cuda" and device.index is not None \
            and device.index != torch.cuda.current_device():
        return torch.cuda.device(device)
    return nullcontext()


__all__ = ["launch_device", "require_triton", "tl", "triton", "triton_by_default"]
