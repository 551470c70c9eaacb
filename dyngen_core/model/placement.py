"""Where and in what precision a model lives: resolving the ``device`` and ``dtype`` options."""

from __future__ import annotations

import torch

_DTYPE_NAMES = {
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
}
SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def resolve_device(device: str | torch.device | None) -> torch.device:
    """None or "auto" gives the current CUDA device when CUDA is available, else the CPU.

    A bare "cuda" is pinned to the current CUDA index so device comparisons stay exact.
    """
    if device is None or device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    resolved = torch.device(device)
    if resolved.type == "cuda" and resolved.index is None:
        resolved = torch.device("cuda", torch.cuda.current_device())
    return resolved


def resolve_dtype(dtype: str | torch.dtype | None, config_dtype: str,
                  device: torch.device) -> torch.dtype:
    """None or "auto" gives the checkpoint's ``torch_dtype`` on CUDA and float32 on the CPU.

    float32 is the CPU default because CPUs have no fast half-precision matrix products, and
    fp32 is the reference.
    """
    if dtype is None or dtype == "auto":
        if device.type == "cpu":
            return torch.float32
        return _DTYPE_NAMES.get(config_dtype, torch.float32)
    if isinstance(dtype, str):
        if dtype not in _DTYPE_NAMES:
            raise ValueError(
                f"dtype {dtype!r} is unknown; use 'auto', 'bfloat16', 'float16' or 'float32'"
            )
        return _DTYPE_NAMES[dtype]
    if dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"dtype {dtype} is not supported; use bfloat16, float16 or float32")
    return dtype
