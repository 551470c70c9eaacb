"""The quantized storage's write as it was before `quant_write`: the torch ops around the native
quantize-on-write kernel of csrc/ (or, without it, the torch codec). Kept as the CPU path, the
A/B baseline (``QuantStorage(triton_write=False)``) and the oracle of the Triton write's tests.

Per layer: `step_rows.prepare_rows` (offsets, rotation as a float32 matrix product, casts),
`write_pages` (codes and scales), and an ``index_copy_`` of the exact rows into the head rows at
`step_rows.head_index`.
"""

from __future__ import annotations

import torch

from dyngen_core.kv.quant import native
from dyngen_core.kv.quant.format import QuantFormat, quantize_rotated


def write_pages(pages: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
                formats: tuple[QuantFormat, QuantFormat], stored: torch.Tensor,
                rotated: torch.Tensor, slot_mapping: torch.Tensor,
                kernels: native.NativeKernels | None, signs: torch.Tensor) -> None:
    """Quantize a step's rows into ``pages`` (key codes, key scales, value codes, value scales)
    at flat ``slot_mapping`` [T]: with the native ``kernels`` from ``stored`` [2, T, H, D]
    (which they rotate with ``signs``), else with the torch codec from ``rotated``."""
    key_codes, key_scales, value_codes, value_scales = pages
    if kernels is not None:
        kernels.quantize_write(stored[0], stored[1], slot_mapping, key_codes, key_scales,
                               value_codes, value_scales, signs, formats[0].bits,
                               formats[1].bits)
        return
    slots = slot_mapping.to(torch.int64)
    for rows, codes, scales, fmt in ((rotated[0], key_codes, key_scales, formats[0]),
                                     (rotated[1], value_codes, value_scales, formats[1])):
        packed, row_scales = quantize_rotated(rows, fmt)
        codes.view(-1, *codes.shape[2:]).index_copy_(0, slots, packed)
        scales.view(-1, *scales.shape[2:]).index_copy_(0, slots, row_scales)


def write_heads(head_rows: torch.Tensor, index: torch.Tensor, exact: torch.Tensor) -> None:
    """Copy the step's exact rows ``exact`` [2, T, H, D] into ``head_rows``
    [2, num_pages + 1, H, D] at `step_rows.head_index` ``index`` [2T]."""
    flat = head_rows.view(-1, *head_rows.shape[2:])
    flat.index_copy_(0, index, exact.view(-1, *head_rows.shape[2:]))
