"""The quantized row format of the q8 / q6 / q4 caches, and its torch reference codec.

One cached row (one token, one kv head) of ``head_dim`` values is split into groups of 32.
Each group is rotated by `hadamard.rotate` (normalized Hadamard of size 32 with fixed signs),
then quantized with one float16 scale per group:

    m     = the rotated value of largest magnitude (the positive one on a tie)
    scale = fp16(m / -2**(bits-1))         # m itself lands exactly on the code -2**(bits-1)
    code  = clamp(round_half_even(v / scale), -2**(bits-1), 2**(bits-1) - 1)
            (0 when scale == 0)

Why these choices (measured on the demo model's real keys, 4 bits, KL of the attention
probabilities averaged over layers): rotating each group of 32 gives 2.2e-2, rotating the whole
head_dim (64) 2.6e-2, no rotation 5.5e-2. Groups of 32 also work for any head_dim that is a
multiple of 32, and are five warp shuffles in CUDA. The fixed signs cost nothing on these keys
and stop a constant offset across a group from collapsing into one huge rotated value.
Using the signed extreme (llama.cpp's Q4_0 trick) gives all 2**bits levels to a symmetric format
at no extra storage: for 4 bits it cuts the round-trip error by ~11% against ``max|v| / 7``.

Packing of the codes of one row (``packed_bytes = head_dim * bits / 8``):

- 8 bits: one int8 per value.
- 4 bits: ``u = code + 8``; byte ``i`` holds value ``2i`` in its low nibble, ``2i+1`` in its
  high nibble.
- 6 bits: ``u = code + 32``; bytes ``3i..3i+2`` hold the little-endian 24-bit word
  ``u[4i] | u[4i+1] << 6 | u[4i+2] << 12 | u[4i+3] << 18``.

So value ``d`` of a row always starts at bit ``d * bits`` of the row's bytes (little-endian).
Scales are stored as [..., head_dim / 32] float16. This module is the CPU path; the Triton write
follows it operation for operation (only the rotation's float32 rounding differs: a butterfly
there, a matrix product here).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dyngen_core.kv.quant.hadamard import rotate, unrotate

GROUP_SIZE = 32
FP16_MAX = 65504.0


@dataclass(frozen=True)
class QuantFormat:
    """The code width of one tensor (keys or values): 4, 6 or 8 bits per value."""

    bits: int

    def __post_init__(self) -> None:
        if self.bits not in (4, 6, 8):
            raise ValueError(f"quantized cache supports 4, 6 or 8 bits, not {self.bits}")

    @property
    def code_dtype(self) -> torch.dtype:
        return torch.int8 if self.bits == 8 else torch.uint8

    @property
    def lowest(self) -> int:
        return -(1 << (self.bits - 1))

    @property
    def highest(self) -> int:
        return (1 << (self.bits - 1)) - 1

    def packed_bytes(self, head_dim: int) -> int:
        """Bytes of codes for one row of ``head_dim`` values."""
        return head_dim * self.bits // 8

    def bytes_per_row(self, head_dim: int) -> int:
        """Codes plus float16 scales of one row."""
        return self.packed_bytes(head_dim) + 2 * (head_dim // GROUP_SIZE)


def check_head_dim(head_dim: int) -> None:
    """Raise a clear error when rows of ``head_dim`` values cannot be grouped by 32."""
    if head_dim % GROUP_SIZE or head_dim <= 0:
        raise ValueError(
            f"quantized cache modes need head_dim to be a multiple of {GROUP_SIZE}; this model "
            f"has head_dim={head_dim}. Use mode='fp16' for it."
        )


def quantize(x: torch.Tensor, fmt: QuantFormat,
             rotation: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize rows ``x`` [..., head_dim] (any float dtype).

    Returns packed codes [..., packed_bytes] in ``fmt.code_dtype`` and float16 scales
    [..., head_dim / 32]. ``rotation`` is `hadamard.hadamard_matrix(32)`.
    """
    return quantize_rotated(rotate(x, rotation), fmt)


def quantize_rotated(rotated: torch.Tensor, fmt: QuantFormat) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize` of rows already rotated (``hadamard.rotate(x, rotation)``, float32): what
    a caller that also needs the rotated rows (the storage's exact rows) quantizes."""
    shape = rotated.shape
    groups = rotated.reshape(*shape[:-1], shape[-1] // GROUP_SIZE, GROUP_SIZE)
    amax = groups.abs().amax(dim=-1, keepdim=True)
    extreme = torch.where((groups == amax).any(dim=-1, keepdim=True), amax, -amax)
    scales16 = (extreme / float(fmt.lowest)).clamp(-FP16_MAX, FP16_MAX).to(torch.float16)
    scales = scales16.to(torch.float32)
    nonzero = scales != 0
    ratio = torch.where(nonzero, groups / torch.where(nonzero, scales, 1.0), 0.0)
    codes = ratio.round().clamp(fmt.lowest, fmt.highest).to(torch.int32)
    return pack(codes.reshape(shape), fmt), scales16.squeeze(-1)


def dequantize(packed: torch.Tensor, scales: torch.Tensor, fmt: QuantFormat,
               rotation: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows [..., head_dim] in ``dtype`` from packed codes and float16 scales (`quantize`'s
    output): codes times scale in float32, un-rotated, then cast."""
    codes = unpack(packed, fmt).to(torch.float32)
    groups = codes.reshape(*codes.shape[:-1], codes.shape[-1] // GROUP_SIZE, GROUP_SIZE)
    values = (groups * scales.to(torch.float32).unsqueeze(-1)).reshape(codes.shape)
    return unrotate(values, rotation).to(dtype)


def pack(codes: torch.Tensor, fmt: QuantFormat) -> torch.Tensor:
    """Signed integer codes [..., n] (int32, within the format's range) to packed bytes."""
    if fmt.bits == 8:
        return codes.to(torch.int8)
    unsigned = codes - fmt.lowest
    if fmt.bits == 4:
        pairs = unsigned.reshape(*codes.shape[:-1], -1, 2)
        return (pairs[..., 0] | (pairs[..., 1] << 4)).to(torch.uint8)
    quads = unsigned.reshape(*codes.shape[:-1], -1, 4)
    word = quads[..., 0] | (quads[..., 1] << 6) | (quads[..., 2] << 12) | (quads[..., 3] << 18)
    triple = torch.stack((word & 0xFF, (word >> 8) & 0xFF, (word >> 16) & 0xFF), dim=-1)
    return triple.reshape(*codes.shape[:-1], -1).to(torch.uint8)


def unpack(packed: torch.Tensor, fmt: QuantFormat) -> torch.Tensor:
    """Packed bytes [..., packed_bytes] back to signed int32 codes [..., n]."""
    if fmt.bits == 8:
        return packed.to(torch.int32)
    raw = packed.to(torch.int32)
    if fmt.bits == 4:
        unsigned = torch.stack((raw & 0xF, raw >> 4), dim=-1)
    else:
        triple = raw.reshape(*packed.shape[:-1], -1, 3)
        word = triple[..., 0] | (triple[..., 1] << 8) | (triple[..., 2] << 16)
        unsigned = torch.stack([(word >> shift) & 0x3F for shift in (0, 6, 12, 18)], dim=-1)
    return unsigned.reshape(*packed.shape[:-1], -1) + fmt.lowest
