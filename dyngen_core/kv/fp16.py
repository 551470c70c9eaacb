"""Unquantized KV storage ("fp16" mode): pages kept in the model's own dtype, and its write.

Per layer, one key and one value tensor [num_pages, page_size, num_kv_heads, head_dim] on that
layer's device. Gathers return whole pages. A write scatters rows to flat slots: on CUDA one
Triton launch per layer (`kv_write_kernel`: keys and values together, value rows read where the
fused qkv projection left them, strided, with no copy first), elsewhere its torch twin, two
``index_copy_`` (`write_rows_torch`).

Slots outside the caches: the torch write raises (IndexError on the CPU, a device-side assert on
CUDA); the kernel cannot raise without a host sync, so it writes nothing for such a row rather
than outside the caches. No caller makes such slots: CUDA-graph padding rows repeat the last
real row's slot, so they write the same data to the same slot. The launch reads its grid from
the key's shape and its slots from the device, so it is captured in CUDA graphs and replayed
with new slots.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from dyngen_core.config import ModelConfig
from dyngen_core.engine.plan import PageCopy
from dyngen_core.kv.storage import copy_page_slots, resolve_copies
from dyngen_core.ops.triton_support import (
    launch_device,
    require_triton,
    tl,
    triton,
    triton_by_default,
)

# (keys cache, values cache, key rows, value rows, slots) -> None
RowWriter = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]


class FP16Storage:
    """Paged keys/values in the compute dtype ("fp16" means: the model's dtype, unquantized).

    config: the model's shape (layers, kv heads, head_dim).
    num_pages, page_size: the cache's pages and slots per page.
    dtype: the storage dtype (the model's dtype).
    layer_devices: one device per layer; each layer's pages live there.
    triton_write: write keys and values in one Triton launch per layer (`kv_write_kernel`)
        instead of two ``index_copy_`` (`write_rows_torch`). None: on the CUDA layers when
        triton is installed; True: on every layer (ValueError when it cannot run there; on
        the CPU only under ``TRITON_INTERPRET=1``, for tests); False: never.

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
        # index_select rather than advanced indexing: the faster gather on the CPU.
        shape = (page_table.shape[0], -1, *keys.shape[2:])
        return (keys.index_select(0, pages).view(shape),
                values.index_select(0, pages).view(shape))

    @torch.inference_mode()
    def copy_pages(self, copies: Sequence[PageCopy]) -> None:
        """Copy slot ranges between pages in every layer, with the result of running them in
        order (`resolve_copies`)."""
        copy_page_slots([*self.keys, *self.values], resolve_copies(copies, self.page_size))

    def write_recent(self, layer: int, key: torch.Tensor, value: torch.Tensor,
                     positions: torch.Tensor, seq_slots: torch.Tensor) -> None:
        """Nothing to do: every row of this storage is exact."""

    def reserve_sequences(self, count: int) -> int:
        """No per-sequence state to make room for: 0."""
        return 0

    def clear_sequences(self, seq_slots: Sequence[int]) -> None:
        """No per-sequence state to forget."""

    def nbytes(self) -> int:
        """Device memory held by the key and value tensors."""
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values))



def _row_writer(device: torch.device, triton_write: bool | None) -> RowWriter:
    """The write a layer on ``device`` uses, as `FP16Storage`'s ``triton_write`` says."""
    if triton_write:
        require_triton(device, "triton_write")
    use_triton = triton_by_default(device) if triton_write is None else triton_write
    return write_rows_triton if use_triton else write_rows_torch


def write_rows_torch(keys: torch.Tensor, values: torch.Tensor, key: torch.Tensor,
                     value: torch.Tensor, slots: torch.Tensor) -> None:
    """Store key/value rows [T, H, D] into caches [pages, page_size, H, D] at flat ``slots``
    [T] (int64, on the caches' device) with two ``index_copy_``; raises on slots outside the
    caches."""
    keys.view(-1, *keys.shape[2:]).index_copy_(0, slots, key.to(keys.dtype))
    values.view(-1, *values.shape[2:]).index_copy_(0, slots, value.to(values.dtype))


def write_rows_triton(keys: torch.Tensor, values: torch.Tensor, key: torch.Tensor,
                      value: torch.Tensor, slots: torch.Tensor) -> None:
    """`write_rows_torch` in one kernel launch; rows whose slot is outside the caches (e.g. -1)
    are not written. ``key``/``value`` may be any strided views whose last dimension is
    contiguous (others are copied first); ``slots`` is int32 or int64. Rows in another dtype
    are converted by torch first, as `write_rows_torch` does (bit for bit the same rounding;
    the model's rows come in the cache dtype, so no conversion runs)."""
    tokens, heads, head_dim = key.shape
    if tokens == 0:
        return
    key = _last_dim_contiguous(key.to(keys.dtype))
    value = _last_dim_contiguous(value.to(values.dtype))
    page_size = keys.shape[1]
    with launch_device(keys.device):
        kv_write_kernel[(tokens,)](
            key, value, slots,
            key.stride(0), key.stride(1), value.stride(0), value.stride(1),
            keys, values, *keys.stride()[:3], *values.stride()[:3],
            keys.shape[0] * page_size,
            PAGE_SIZE=page_size, HEADS=heads, HEAD_DIM=head_dim,
            HEADS_PAD=_next_pow2(heads), DIM_PAD=_next_pow2(head_dim),
            num_warps=4,
        )


def _last_dim_contiguous(rows: torch.Tensor) -> torch.Tensor:
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def _next_pow2(n: int) -> int:
    return 1 << (max(1, n) - 1).bit_length()


@triton.jit
def kv_write_kernel(
    key, value, slots,
    key_token_stride, key_head_stride, value_token_stride, value_head_stride,
    key_cache, value_cache,
    key_page_stride, key_slot_stride, key_cache_head_stride,
    value_page_stride, value_slot_stride, value_cache_head_stride,
    num_slots,
    PAGE_SIZE: tl.constexpr, HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    HEADS_PAD: tl.constexpr, DIM_PAD: tl.constexpr,
):
    """Program ``t`` copies token t's key and value rows [HEADS, HEAD_DIM] (last dimension
    contiguous, other strides as given) into the caches [pages, PAGE_SIZE, HEADS, HEAD_DIM] at
    flat slot ``slots[t]``; the rows come in the caches' dtype (a pure copy). A slot outside
    [0, num_slots) writes nothing (a launch cannot raise, and must never write outside the
    caches)."""
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots + token).to(tl.int64)
    valid = (slot >= 0) & (slot < num_slots)
    slot = tl.where(valid, slot, 0)  # keep even the masked addresses inside the caches
    page = slot // PAGE_SIZE
    offset = slot % PAGE_SIZE
    heads = tl.arange(0, HEADS_PAD)[:, None]
    dims = tl.arange(0, DIM_PAD)[None, :]
    mask = (heads < HEADS) & (dims < HEAD_DIM) & valid
    key_row = tl.load(key + token * key_token_stride + heads * key_head_stride + dims,
                      mask=mask)
    value_row = tl.load(value + token * value_token_stride + heads * value_head_stride + dims,
                        mask=mask)
    key_at = page * key_page_stride + offset * key_slot_stride + heads * key_cache_head_stride
    value_at = (page * value_page_stride + offset * value_slot_stride
                + heads * value_cache_head_stride)
    tl.store(key_cache + key_at + dims, key_row, mask=mask)
    tl.store(value_cache + value_at + dims, value_row, mask=mask)
