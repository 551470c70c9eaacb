"""Lazy build and loading of the native CUDA kernels in csrc/ (quantize-on-write, dequantizing
gather, page copies).

Nothing is compiled at install time. The first quantized storage placed on a CUDA device calls
`load_native`, which builds csrc/ with ``torch.utils.cpp_extension.load`` (ninja, cached by torch
under its extensions folder) when CUDA, nvcc and ninja are all present. Any failure is logged once
with its reason and the caller falls back to the torch reference (`qformat`), which is also the
test oracle of these kernels. Set ``DYNGEN_NO_NATIVE=1`` to skip the build.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from dyngen_core.engine.plan import PageCopy

log = logging.getLogger(__name__)

CSRC_DIR = Path(__file__).resolve().parents[2] / "csrc"
SOURCES = ("quant_cache.cpp", "quant_cache_kernels.cu")
EXTENSION_NAME = "dyngen_quant_cache_v1"
MAX_COPIES_PER_LAUNCH = 65535  # CUDA's grid.z limit


class NativeKernels:
    """Thin typed wrapper over the built extension; arguments as in `quant.QuantStorage`."""

    def __init__(self, module: Any) -> None:
        self.module = module

    def quantize_write(self, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor,
                       key_codes: torch.Tensor, key_scales: torch.Tensor,
                       value_codes: torch.Tensor, value_scales: torch.Tensor,
                       signs: torch.Tensor, key_bits: int, value_bits: int) -> None:
        """Quantize key/value rows [T, H, D] into the page tensors at flat ``slot_mapping``;
        slots outside the storage (e.g. -1 padding) are skipped."""
        self.module.quantize_write(key.contiguous(), value.contiguous(),
                                   slot_mapping.to(torch.int64).contiguous(),
                                   key_codes, key_scales, value_codes, value_scales,
                                   signs, key_bits, value_bits)

    def dequantize_gather(self, codes: torch.Tensor, scales: torch.Tensor,
                          page_table: torch.Tensor, signs: torch.Tensor, bits: int,
                          out: torch.Tensor) -> None:
        """Dequantize the pages of ``page_table`` [B, P] into ``out`` [B, P * page_size, H, D]."""
        table = page_table.to(device=codes.device, dtype=torch.int32).contiguous()
        self.module.dequantize_gather(codes, scales, table, signs, bits, out)

    def copy_pages(self, tensors: Sequence[torch.Tensor], copies: Sequence[PageCopy]) -> None:
        """Copy slot ranges between pages of every tensor in ``tensors`` (all on one device,
        each [num_pages, page_size, ...] contiguous), preserving the order of ``copies``:
        independent copies share one launch, dependent ones go in later launches."""
        device = tensors[0].device
        table = torch.tensor(
            [[t.data_ptr(), t.stride(0) * t.element_size(), t.stride(1) * t.element_size()]
             for t in tensors], dtype=torch.int64).to(device)
        slot_bytes = max(t.stride(1) * t.element_size() for t in tensors)
        for run in independent_runs(copies):
            for start in range(0, len(run), MAX_COPIES_PER_LAUNCH):
                part = run[start : start + MAX_COPIES_PER_LAUNCH]
                rows = torch.tensor([[c.src, c.dst, c.num_slots] for c in part],
                                    dtype=torch.int64)
                max_bytes = max(c.num_slots for c in part) * slot_bytes
                self.module.copy_pages(table, rows.to(device), max_bytes)


def independent_runs(copies: Sequence[PageCopy]) -> list[list[PageCopy]]:
    """Split ``copies`` into consecutive runs whose copies can run at once: within a run no page
    is written twice, and no page written is also read."""
    runs: list[list[PageCopy]] = []
    read: set[int] = set()
    written: set[int] = set()
    for copy in copies:
        conflict = copy.src in written or copy.dst in written or copy.dst in read
        if not runs or conflict:
            runs.append([])
            read, written = set(), set()
        runs[-1].append(copy)
        read.add(copy.src)
        written.add(copy.dst)
    return runs


# A process-wide cache on purpose: building is slow and torch keeps loaded extensions
# process-wide anyway; the cached value is immutable once made.
@functools.cache
def load_native() -> NativeKernels | None:
    """Build (first call) and load the csrc/ kernels; None, with the reason logged, when they
    cannot be had here. The result is cached for the process."""
    reason = _unavailable_reason()
    if reason is not None:
        log.info("dyngen native kernels not used: %s; using the torch implementation", reason)
        return None
    try:
        from torch.utils.cpp_extension import load

        module = load(
            name=EXTENSION_NAME,
            sources=[str(CSRC_DIR / s) for s in SOURCES],
            extra_cflags=["-O3"],
            extra_cuda_cflags=["-O3"],
            verbose=os.environ.get("DYNGEN_NATIVE_VERBOSE") == "1",
        )
    except Exception as exc:  # any build or load failure means: fall back
        log.warning("dyngen native kernels failed to build (%s: %s); using the torch "
                    "implementation", type(exc).__name__, exc)
        return None
    log.info("dyngen native kernels loaded from %s", getattr(module, "__file__", "?"))
    return NativeKernels(module)


def _unavailable_reason() -> str | None:
    if os.environ.get("DYNGEN_NO_NATIVE") == "1":
        return "DYNGEN_NO_NATIVE=1"
    if not torch.cuda.is_available():
        return "CUDA is not available"
    if not all((CSRC_DIR / s).is_file() for s in SOURCES):
        return f"csrc sources not found in {CSRC_DIR}"
    from torch.utils import cpp_extension

    if cpp_extension.CUDA_HOME is None:
        return "no CUDA toolkit (nvcc) found; set CUDA_HOME"
    if not cpp_extension.is_ninja_available():
        return "ninja is not installed (pip install ninja)"
    return None
