"""The flash-attn backend: flash-attn's paged kernels over fp16/bf16 pages, when importable.

Decode-only batches call ``flash_attn_with_kvcache`` (one query per sequence, the page table as
``block_table``: capturable in a CUDA graph); batches with prefill chunks call
``flash_attn_varlen_func`` with the page table. Causal masks in both are aligned to the end of
each sequence, which is dyngen's rule (the query at position p sees slots 0..p).

flash-attn reads only unquantized pages in fp16/bf16 whose size is a multiple of 256; for other
storage (q8/q6/q4, float32, smaller pages) this backend hands the step to the Triton backend.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from dyngen_core.kv.attention.base import ForwardBatch
from dyngen_core.kv.storage import KVStorage

FLASH_PAGE_MULTIPLE = 256


class FlashBackend:
    """Paged attention through flash-attn 2 (CUDA only; falls back to Triton as described).

    fallback_options: keyword arguments for the `TritonPagedBackend` that serves the storage
        flash-attn cannot read.
    """

    name = "flash"

    def __init__(self, **fallback_options: Any) -> None:
        from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache

        from dyngen_core.kv.attention.triton.paged import TritonPagedBackend

        self._with_kvcache = flash_attn_with_kvcache
        self._varlen = flash_attn_varlen_func
        self._fallback = TritonPagedBackend(**fallback_options)
        self._cu_seqlens: tuple[ForwardBatch, torch.Tensor] | None = None

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               storage: KVStorage, batch: ForwardBatch, scale: float) -> torch.Tensor:
        """Write k/v [T, Hkv, D] to storage, then attend q [T, H, D]; returns [T, H, D]."""
        if not _flash_can_read(storage, q, batch):
            return self._fallback.attend(layer, q, k, v, storage, batch, scale)
        storage.write(layer, k, v, batch.slot_mapping)
        keys = storage.keys[layer]  # type: ignore[attr-defined]
        values = storage.values[layer]  # type: ignore[attr-defined]
        if batch.is_decode_only:
            out = self._with_kvcache(
                q.unsqueeze(1), keys, values, cache_seqlens=batch.context_lens,
                block_table=batch.page_table, softmax_scale=scale, causal=True,
            )
            return out.squeeze(1)
        out = self._varlen(
            q, keys, values,
            cu_seqlens_q=batch.query_start, cu_seqlens_k=self._cu_seqlens_k(batch),
            max_seqlen_q=max(batch.query_lens_host), max_seqlen_k=max(batch.context_lens_host),
            softmax_scale=scale, causal=True, block_table=batch.page_table,
        )
        return out

    def _cu_seqlens_k(self, batch: ForwardBatch) -> torch.Tensor:
        cached = self._cu_seqlens
        if cached is not None and cached[0] is batch:
            return cached[1]
        cumulative = torch.cumsum(batch.context_lens, 0, dtype=torch.int32)
        cu_seqlens = F.pad(cumulative, (1, 0))
        self._cu_seqlens = (batch, cu_seqlens)
        return cu_seqlens


def _flash_can_read(storage: KVStorage, q: torch.Tensor, batch: ForwardBatch) -> bool:
    return (storage.mode == "fp16" and q.dtype in (torch.float16, torch.bfloat16)
            and batch.page_size % FLASH_PAGE_MULTIPLE == 0)
