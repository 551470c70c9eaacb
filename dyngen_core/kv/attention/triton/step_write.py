"""The decode step's key/value write inside the decode attention kernel, for float pages.

A decode layer used to run the storage's write (`storage.fp16_write`, one launch) and then the
attention launch; in a batch-1 CUDA-graph step the boundary between them costs more than the
write's few hundred bytes. With `StepWrite`, the attention program of each (sequence, KV head)
whose split holds the sequence's last position first stores that position's key and value
rows (this step's, as computed) into the pages at the sequence's slot, exactly as the
storage's write does (same slot, same conversion to the pages' dtype, nothing written for a
slot outside the pages), then reads its keys as usual: a barrier orders the program's own
store before its loads of the same row.

Other programs never read that row: each (sequence, KV head) row is read by the one split
that writes it. CUDA-graph padding rows repeat a real sequence (same slot, same rows), so
their programs store identical bytes to the same place, each before reading it.

Float pages only ([pages, page_size, kv_heads, head_dim], the layout `triton_paged`'s page
operands describe for `FP16Storage`); quantized pages keep their storage's write.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

if TYPE_CHECKING:
    from dyngen_core.kv.attention.base import ForwardBatch
    from dyngen_core.kv.storage import KVStorage


@dataclass(frozen=True)
class StepWrite:
    """This step's rows the kernel stores: keys and values [T, kv_heads, head_dim] (last
    dimension contiguous), their flat slots [T] (int64) and the pages' slot count."""

    keys: torch.Tensor
    values: torch.Tensor
    slots: torch.Tensor
    num_slots: int

    @staticmethod
    def of(keys: torch.Tensor, values: torch.Tensor, slots: torch.Tensor,
           pages: torch.Tensor) -> StepWrite:
        """The write of rows ``keys``/``values`` at ``slots`` into ``pages`` (a layer's
        [pages, page_size, kv_heads, head_dim] key or value tensor)."""
        return StepWrite(_last_dim_contiguous(keys), _last_dim_contiguous(values), slots,
                         pages.shape[0] * pages.shape[1])

    def arguments(self) -> tuple[object, ...]:
        """In the kernel's order: rows, their strides, slots, slot count."""
        k, v = self.keys, self.values
        return (k, v, k.stride(0), k.stride(1), v.stride(0), v.stride(1), self.slots,
                self.num_slots)


def step_write_for(storage: KVStorage, layer: int, batch: ForwardBatch,
                   step_rows: tuple[torch.Tensor, torch.Tensor] | None, pages: torch.Tensor,
                   plain_decode: bool) -> StepWrite | None:
    """The write of this step's rows ``step_rows`` for the attention kernel to do, when it
    can: unquantized storage (``pages``: the layer's key pages) and ``plain_decode`` (a
    decode-only batch taking the plain kernel, no shared-prefix pass). Otherwise the storage
    writes them now, and None comes back. Raises ValueError without ``step_rows``."""
    if step_rows is None:
        raise ValueError("write_step needs step_rows: the step's keys and values to write")
    if plain_decode and storage.mode == "fp16" and batch.is_decode_only:
        return StepWrite.of(*step_rows, batch.slot_mapping, pages)
    storage.write(layer, *step_rows, batch.slot_mapping)
    return None


def _last_dim_contiguous(rows: torch.Tensor) -> torch.Tensor:
    return rows if rows.stride(-1) == 1 else rows.contiguous()


@triton.jit
def store_step_row(step_k_ptr, step_v_ptr, stride_skt, stride_skh, stride_svt, stride_svh,
                   slot_ptr, num_slots, token, holds, kv_head, dims, k_ptr, v_ptr, stride_kp,
                   stride_ks, stride_kh, stride_vp, stride_vs, stride_vh,
                   PAGE_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr):
    """When ``holds`` (this program's split holds the token's position), store token
    ``token``'s key and value rows of ``kv_head`` at its slot (converted to the pages' dtype;
    nothing for a slot outside [0, num_slots)); then a barrier, so this program's later loads
    of that row see the store."""
    slot = tl.load(slot_ptr + token).to(tl.int64)
    valid = holds & (slot >= 0) & (slot < num_slots)
    slot = tl.where(valid, slot, 0)  # even masked addresses stay inside the pages
    page = slot // PAGE_SIZE
    offset = slot % PAGE_SIZE
    mask = valid & (dims < HEAD_DIM)
    key = tl.load(step_k_ptr + token * stride_skt + kv_head * stride_skh + dims, mask=mask)
    value = tl.load(step_v_ptr + token * stride_svt + kv_head * stride_svh + dims, mask=mask)
    tl.store(k_ptr + page * stride_kp + offset * stride_ks + kv_head * stride_kh + dims,
             key.to(k_ptr.dtype.element_ty), mask=mask)
    tl.store(v_ptr + page * stride_vp + offset * stride_vs + kv_head * stride_vh + dims,
             value.to(v_ptr.dtype.element_ty), mask=mask)
    tl.debug_barrier()


__all__ = ["StepWrite", "step_write_for", "store_step_row"]
