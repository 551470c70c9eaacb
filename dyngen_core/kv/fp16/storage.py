"""Unquantized KV storage ("fp16" mode): pages kept in the model's own dtype.

Per layer, one key and one value tensor [num_pages, page_size, num_kv_heads, head_dim] on that
layer's device. Writes scatter rows to flat slots (one Triton launch per layer on CUDA,
`fp16_write`); gathers return whole pages.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from dyngen_core.config import ModelConfig
from dyngen_core.engine.plan import PageCopy
from dyngen_core.kv.fp16.write import (
    check_triton_write,
    triton_write_default,
    write_rows_torch,
    write_rows_triton,
)
from dyngen_core.kv.storage import copy_page_slots

# (keys cache, values cache, key rows, value rows, slots) -> None
RowWriter = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]


class FP16Storage:
    """Paged keys/values in the compute dtype ("fp16" means: the model's dtype, unquantized).

    config: the model's shape (layers, kv heads, head_dim).
    num_pages, page_size: the cache's pages and slots per page.
    dtype: the storage dtype (the model's dtype).
    layer_devices: one device per layer; each layer's pages live there.
    triton_write: write keys and values in one Triton launch per layer (`fp16_write`) instead
        of two ``index_copy_``. None: on the CUDA layers when triton is installed; True: on
        every layer (ValueError when it cannot run there; on the CPU only under
        ``TRITON_INTERPRET=1``, for tests); False: never. The two differ only for slots
        outside the cache, which no caller makes: the torch write raises, the kernel skips
        the row.

    Tensors start zeroed: padded page-table entries and masked slots are read by batched
    attention, and garbage such as NaN in them would leak through a zero attention weight.
    Writes and copies run in inference mode, so storage made inside or outside
    ``torch.inference_mode`` can be updated from either.
    """

    mode = "fp16"

    def __init__(self, config: ModelConfig, num_pages: int, page_size: int, dtype: torch.dtype,
                 layer_devices: Sequence[torch.device], *,
                 triton_write: bool | None = None) -> None:
        if len(layer_devices) != config.num_layers:
            raise ValueError(f"layer_devices has {len(layer_devices)} entries; the model has "
                             f"{config.num_layers} layers")
        self.page_size = page_size
        self.num_pages = num_pages
        self.dtype = dtype
        shape = (num_pages, page_size, config.num_kv_heads, config.head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=d) for d in layer_devices]
        self.values = [torch.zeros(shape, dtype=dtype, device=d) for d in layer_devices]
        self._writers = [_row_writer(torch.device(d), triton_write) for d in layer_devices]

    @torch.inference_mode()
    def write(self, layer: int, key: torch.Tensor, value: torch.Tensor,
              slot_mapping: torch.Tensor, *,
              decode_window: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        """Store key/value rows [T, num_kv_heads, head_dim] at flat slots [T] (int64);
        ``decode_window`` is ignored (no per-sequence state)."""
        keys = self.keys[layer]
        slots = slot_mapping.to(keys.device, non_blocking=True)
        self._writers[layer](keys, self.values[layer], key, value, slots)

    def gather(self, layer: int, page_table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of ``page_table`` [B, P], as [B, P * page_size, Hkv, head_dim]."""
        keys, values = self.keys[layer], self.values[layer]
        pages = page_table.to(keys.device, dtype=torch.long, non_blocking=True).flatten()
        # index_select is ~3x faster than advanced indexing for this gather on the CPU.
        shape = (page_table.shape[0], -1, *keys.shape[2:])
        return (keys.index_select(0, pages).view(shape),
                values.index_select(0, pages).view(shape))

    @torch.inference_mode()
    def copy_pages(self, copies: Sequence[PageCopy]) -> None:
        """Copy slot ranges between pages in every layer, in order (`copy_page_slots`)."""
        copy_page_slots([*self.keys, *self.values], copies, self.page_size)

    def write_recent(self, layer: int, key: torch.Tensor, value: torch.Tensor,
                     positions: torch.Tensor, seq_slots: torch.Tensor) -> None:
        """Nothing to do: every row of this storage is exact."""

    def reserve_sequences(self, count: int) -> bool:
        """No per-sequence state to make room for: False."""
        return False

    def clear_sequences(self, seq_slots: Sequence[int]) -> None:
        """No per-sequence state to forget."""

    def nbytes(self) -> int:
        """Device memory held by the key and value tensors."""
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values))


def _row_writer(device: torch.device, triton_write: bool | None) -> RowWriter:
    """The write a layer on ``device`` uses, as `FP16Storage`'s ``triton_write`` says."""
    if triton_write:
        check_triton_write(device)
    use_triton = triton_write_default(device) if triton_write is None else triton_write
    return write_rows_triton if use_triton else write_rows_torch

