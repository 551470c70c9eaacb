"""Attention backends behind one protocol, and `get_backend` to pick one by name or device."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass

import torch

from dyngen_core.kv.attention.base import AttentionBackend, ForwardBatch
from dyngen_core.kv.attention.sdpa import SdpaBackend


@dataclass(frozen=True)
class BackendEntry:
    """How to build a backend, and which devices it runs on."""

    factory: Callable[[], AttentionBackend]
    supports: Callable[[torch.device], bool]


def _cuda_with(package: str) -> Callable[[torch.device], bool]:
    return lambda device: device.type == "cuda" and importlib.util.find_spec(package) is not None


def _triton_backend() -> AttentionBackend:
    from dyngen_core.kv.attention.triton.paged import TritonPagedBackend

    return TritonPagedBackend()


def _flash_backend() -> AttentionBackend:
    from dyngen_core.kv.attention.flash import FlashBackend

    return FlashBackend()


BACKENDS: dict[str, BackendEntry] = {
    "flash": BackendEntry(_flash_backend, _cuda_with("flash_attn")),
    "triton": BackendEntry(_triton_backend, _cuda_with("triton")),
    "sdpa": BackendEntry(SdpaBackend, lambda device: True),
}
# "auto" takes the first backend of this order that supports the device.
AUTO_ORDER: tuple[str, ...] = ("flash", "triton", "sdpa")


def get_backend(name: str | AttentionBackend = "auto",
                device: str | torch.device | None = None) -> AttentionBackend:
    """Build an attention backend.

    name: "auto" (the fastest backend for ``device``) or a backend name: "sdpa" (reference,
        any device), plus GPU backends when installed; or a backend already built (e.g.
        ``TritonPagedBackend(cascade_min_saved_keys=None)``), returned as it is.
    device: the model's device; "auto" uses it to choose (None means the CPU).
    """
    if not isinstance(name, str):
        return name
    target = torch.device(device) if device is not None else torch.device("cpu")
    if name == "auto":
        name = next(n for n in AUTO_ORDER if n in BACKENDS and BACKENDS[n].supports(target))
    entry = BACKENDS.get(name)
    if entry is None:
        raise ValueError(
            f"attention backend {name!r} is unknown; available: 'auto', "
            f"{', '.join(repr(n) for n in BACKENDS)}"
        )
    if not entry.supports(target):
        raise ValueError(f"attention backend {name!r} does not run on {target}; use 'auto'")
    return entry.factory()


__all__ = ["AttentionBackend", "BACKENDS", "ForwardBatch", "SdpaBackend", "get_backend"]
