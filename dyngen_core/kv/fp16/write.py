"""The unquantized storage's write as one kernel launch per layer on CUDA (keys and values
together), and the torch write it replaces, kept as the CPU path and the test oracle.

Why: the torch write is two ``index_copy_`` launches per layer (keys, then values), about
2.6 us each in a captured batch-1 decode step of a Llama-3-8B-shape model on an H200: 3.5 % of
the step. `fp16_write_kernel.kv_write_kernel` stores both in one launch, and reads the value
rows where the fused qkv projection left them (strided), with no copy first.

Slots outside the caches: the torch write raises (IndexError on the CPU, a device-side assert
on CUDA); the kernel cannot raise without a host sync, so it writes nothing for such a row
rather than outside the caches. No caller makes such slots: CUDA-graph padding rows repeat the
last real row's slot, so they write the same data to the same slot.

The launch reads its grid from the key's shape and its slots from the device, so it can be
captured in a CUDA graph and replayed with new slots. triton is imported only when the kernel
runs (CI has none).
"""

from __future__ import annotations

import torch

from dyngen_core.ops.triton_support import (
    launch_device,
    require_triton,
    triton_by_default,
)


def triton_write_default(device: torch.device) -> bool:
    """Whether ``device`` uses the kernel when not told (`triton_support.triton_by_default`)."""
    return triton_by_default(device)


def check_triton_write(device: torch.device) -> None:
    """Raise ValueError when the kernel cannot run on ``device``."""
    require_triton(device, "triton_write")


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
    from dyngen_core.kv.fp16.write_kernel import kv_write_kernel

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

