"""Whether the optional Triton kernels (those with a torch twin: the fp16 KV write, the fused
sampler draw) run on a device, decided in one place, and the device context their launches run
in.

Triton is never required (CI has none): a kernel runs by default on CUDA when triton is
installed, and on the CPU only under ``TRITON_INTERPRET=1`` (the interpreter tests use),
when asked for explicitly.
"""

from __future__ import annotations

import importlib.util
import os
from contextlib import AbstractContextManager, nullcontext

import torch


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

