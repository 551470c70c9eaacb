"""Page copies of the quantized storage (`quant.QuantStorage.copy_pages`): codes and scales
slot by slot (the native kernel in one launch per device where it is built), then head rows."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from dyngen_core.engine.plan import PageCopy
from dyngen_core.kv.quant.layer import QuantLayer
from dyngen_core.kv.quant.native import NativeKernels


def copy_quant_pages(layers: Sequence[QuantLayer], copies: Sequence[PageCopy], num_pages: int,
                     page_size: int, kernels: Sequence[NativeKernels | None]) -> None:
    """Copy the first ``num_slots`` slots of page ``src`` into page ``dst`` in every layer of
    ``layers`` (pages of ``page_size`` slots, ``num_pages`` a layer), in the order given;
    ``kernels[layer]``: the native kernels that copy that layer's pages, or None (torch)."""
    copies = [c for c in copies if c.src != c.dst and c.num_slots > 0]
    for c in copies:
        _check_copy(c, num_pages, page_size)
    if not copies:
        return
    by_kernels: dict[torch.device, tuple[NativeKernels, list[torch.Tensor]]] = {}
    for pages, native in zip(layers, kernels, strict=True):
        if native is not None:
            device = pages.key_codes.device
            by_kernels.setdefault(device, (native, []))[1].extend(pages.tensors())
            continue
        for c in copies:
            for tensor in pages.tensors():
                tensor[c.dst, : c.num_slots].copy_(tensor[c.src, : c.num_slots])
    for native, tensors in by_kernels.values():
        native.copy_pages(tensors, copies)
    # Every copy starts at slot 0, so the destination takes the source's head rows (key and
    # value at once); in order, as a later copy may read what an earlier one wrote.
    for pages in layers:
        for c in copies:
            pages.head_rows[:, c.dst].copy_(pages.head_rows[:, c.src])


def _check_copy(copy: PageCopy, num_pages: int, page_size: int) -> None:
    for page in (copy.src, copy.dst):
        if not 0 <= page < num_pages:
            raise IndexError(f"page copy {copy} names page {page}; the storage holds pages "
                             f"0..{num_pages - 1}")
    if copy.num_slots > page_size:
        raise ValueError(f"page copy {copy} copies {copy.num_slots} slots; a page holds "
                         f"{page_size}")
