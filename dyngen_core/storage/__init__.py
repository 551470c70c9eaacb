"""KV storage modes behind one protocol, and `make_storage` to build one by mode name."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial

import torch

from dyngen_core.config import ModelConfig
from dyngen_core.storage.base import KVStorage
from dyngen_core.storage.fp16 import FP16Storage
from dyngen_core.storage.quant import MODE_BITS, QuantStorage

StorageFactory = Callable[
    [ModelConfig, int, int, torch.dtype, Sequence[torch.device]], KVStorage
]

# Mode name -> constructor taking (config, num_pages, page_size, dtype, layer_devices).
STORAGE_MODES: dict[str, StorageFactory] = {
    "fp16": FP16Storage,
    **{mode: partial(QuantStorage, mode=mode) for mode in MODE_BITS},
}


def make_storage(mode: str, config: ModelConfig, num_pages: int, page_size: int,
                 dtype: torch.dtype, layer_devices: Sequence[torch.device]) -> KVStorage:
    """Build the storage for a cache mode.

    mode: "fp16" (the model's dtype, unquantized), or a quantized mode when available.
    config: the model's shape. num_pages, page_size: the cache geometry.
    dtype: the model's compute dtype (what gathers return).
    layer_devices: one device per layer, as the model places its layers.
    """
    factory = STORAGE_MODES.get(mode)
    if factory is None:
        raise ValueError(
            f"cache mode {mode!r} is not available; available: {', '.join(STORAGE_MODES)}"
        )
    return factory(config, num_pages, page_size, dtype, layer_devices)


__all__ = ["FP16Storage", "KVStorage", "QuantStorage", "STORAGE_MODES", "make_storage"]
