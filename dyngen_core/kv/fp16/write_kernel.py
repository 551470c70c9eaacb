"""The Triton kernel of the unquantized storage's write: one launch stores a layer's key and
value rows at their slots (`fp16_write` launches it).

This module imports triton at the top: only `fp16_write` imports it, lazily, when a write runs
on CUDA with triton installed (or under ``TRITON_INTERPRET=1`` in tests).
"""

from __future__ import annotations

import triton
import triton.language as tl


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
