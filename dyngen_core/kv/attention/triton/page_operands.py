"""What the Triton paged kernels read of one layer (`PageOperands`, `page_arguments`: the page
tensors, scales, strides and rotation in the order every paged kernel takes them) and the head
layout of one attention call (`HeadShape`); shared by `triton_paged` and the shared-prefix
path."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dyngen_core.kv.attention.triton.rotation import ROTATION_GROUP
from dyngen_core.kv.storage import KVStorage


@dataclass(frozen=True)
class PageOperands:
    """What the kernel reads for one layer: page tensors (codes as int32 words, or bytes for
    6-bit codes), their float16 scales (None for float pages) and the code widths (0: float)."""

    keys: torch.Tensor
    values: torch.Tensor
    key_scales: torch.Tensor | None
    value_scales: torch.Tensor | None
    key_bits: int
    value_bits: int


def page_operands(storage: KVStorage, layer: int) -> PageOperands:
    """The page tensors of ``layer`` for the storage modes dyngen ships (fp16 and q8/q6/q4)."""
    if storage.mode == "fp16":
        return PageOperands(storage.keys[layer], storage.values[layer],  # type: ignore[attr-defined]
                            None, None, 0, 0)
    pages = storage.layers[layer]  # type: ignore[attr-defined]
    key_bits = storage.key_format.bits  # type: ignore[attr-defined]
    value_bits = storage.value_format.bits  # type: ignore[attr-defined]
    return PageOperands(_code_view(pages.key_codes, key_bits),
                        _code_view(pages.value_codes, value_bits),
                        pages.key_scales, pages.value_scales, key_bits, value_bits)


def _code_view(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """4- and 8-bit codes as int32 words (the kernel loads whole words), 6-bit ones as bytes."""
    as_bytes = codes.view(torch.uint8)
    return as_bytes if bits == 6 else as_bytes.view(torch.int32)


@dataclass(frozen=True)
class HeadShape:
    """Head layout of one attention call: query heads per KV head (and its power-of-two pad),
    head_dim and the padded width the kernels use."""

    num_kv_heads: int
    group: int
    group_pad: int
    head_dim: int
    head_pad: int

    @staticmethod
    def of(q: torch.Tensor, ops: PageOperands) -> HeadShape:
        num_heads, head_dim = q.shape[1], q.shape[2]
        num_kv_heads = ops.keys.shape[2]
        group = num_heads // num_kv_heads
        head_pad = max(triton_next_pow2(head_dim), ROTATION_GROUP if ops.key_bits else 16)
        return HeadShape(num_kv_heads, group, triton_next_pow2(group), head_dim, head_pad)


def page_arguments(ops: PageOperands, rotation: torch.Tensor) -> tuple[object, ...]:
    """The page tensors, scales, their strides and the rotation, in the order every paged
    kernel takes them (scales default to the page tensors, unread, for float pages)."""
    ks, vs = ops.key_scales, ops.value_scales
    return (ops.keys, ops.values, *ops.keys.stride()[:3], *ops.values.stride()[:3],
            ks if ks is not None else ops.keys, vs if vs is not None else ops.values,
            *_strides3(ks), *_strides3(vs), rotation)


def triton_next_pow2(n: int) -> int:
    """The smallest power of two >= n (n >= 1)."""
    return 1 << (max(1, n) - 1).bit_length()


def _strides3(t: torch.Tensor | None) -> tuple[int, int, int]:
    return (0, 0, 0) if t is None else (t.stride(0), t.stride(1), t.stride(2))
