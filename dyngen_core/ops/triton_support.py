"""Whether the optional Triton kernels (those with a torch twin: the fp16 KV write, the fused
sampler draw) run on a device, decided in one place, the device context their launches run
in, and whether a launch is a programmatic dependent launch (`pdl_launch`).

Triton is never required (CI has none): a kernel runs by default on CUDA when triton is
installed, and on the CPU only under ``TRITON_INTERPRET=1`` (the interpreter tests use),
when asked for explicitly.
"""

from __future__ import annotations

import importlib.util
import os
from contextlib import AbstractContextManager, nullcontext

import torch

# "1" turns programmatic dependent launches on (sm_90+); unset or anything else leaves them
# off. Off by default: on the H200 they measured no faster end to end (BENCHMARKS.md: batch-1
# decode step 4.297 ms off, 4.376 on, same run; 16k q4 step 5.293 off, 5.351 on).
PDL_ENV = "DYNGEN_PDL"


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


def pdl_launch(device: torch.device) -> bool:
    """Whether a Triton launch on ``device`` is a programmatic dependent launch (the kernel
    then starts with `triton_pdl.pdl_start`; pass the result as its ``GDC`` and as
    ``launch_pdl``): when the ``DYNGEN_PDL`` environment variable is "1", on CUDA devices
    of compute capability 9.0 or above (`PDL_ENV` says why it is off by default)."""
    if device.type != "cuda" or os.environ.get(PDL_ENV) != "1":
        return False
    return torch.cuda.get_device_capability(device)[0] >= 9
