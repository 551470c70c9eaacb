"""The quantized row format of the q8 / q6 / q4 caches: the rotation applied before quantizing,
the codes and scales, and the torch codec (the CPU path; the Triton write follows it operation
for operation).

Rotation: ``R = H_32 · diag(s) / sqrt(32)`` (``H_32`` the Sylvester Hadamard matrix, ``s`` a
fixed ±1 sign pattern from an integer hash) on each group of 32 values spreads an outlier channel
over the group, so the group's scale is set by the typical magnitude rather than by one channel.
``R`` is orthogonal (``R⁻¹ = Rᵀ``) and every entry is ±1/sqrt(32); attention needs only dot
products, so a kernel may work in the rotated space (rotate q, un-rotate the output) without
un-rotating each cached row. The torch path applies ``R`` as a float32 matrix product
(`rotate`); the Triton write as the Walsh-Hadamard butterfly (`walsh_hadamard`: stage
``h = 1, 2, 4, ...``, pairs at distance ``h`` become ``(a + b, a - b)``); the two agree to
float32 rounding.

Codes: one cached row (one token, one kv head) of ``head_dim`` values is split into groups of
32, each rotated, then quantized with one float16 scale per group:

    m     = the rotated value of largest magnitude (the positive one on a tie)
    scale = fp16(m / -2**(bits-1))         # m itself lands exactly on the code -2**(bits-1)
    code  = clamp(round_half_even(v / scale), -2**(bits-1), 2**(bits-1) - 1)
            (0 when scale == 0)

The signed extreme (llama.cpp's Q4_0 trick) gives all 2**bits levels to a symmetric format at no
extra storage. Why groups of 32 and the rotation: BENCHMARKS.md, section 8.

Packing of the codes of one row (``packed_bytes = head_dim * bits / 8``):

- 8 bits: one int8 per value.
- 4 bits: ``u = code + 8``; byte ``i`` holds value ``2i`` in its low nibble, ``2i+1`` in its
  high nibble.
- 6 bits: ``u = code + 32``; bytes ``3i..3i+2`` hold the little-endian 24-bit word
  ``u[4i] | u[4i+1] << 6 | u[4i+2] << 12 | u[4i+3] << 18``.

So value ``d`` of a row always starts at bit ``d * bits`` of the row's bytes (little-endian).
Scales are stored as [..., head_dim / 32] float16.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

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


def quantize_rotated(rotated: torch.Tensor, fmt: QuantFormat) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize rotated rows (``rotate(x, rotation)``, float32) [..., head_dim]: packed codes
    [..., packed_bytes] in ``fmt.code_dtype`` and float16 scales [..., head_dim / 32]."""
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
    """Rows [..., head_dim] in ``dtype`` from packed codes and float16 scales
    (`quantize_rotated`'s output): codes times scale in float32, un-rotated, then cast."""
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


# The sign pattern comes from a fixed integer hash, not from a random generator, so it is the
# same on every machine, torch version and device. 256 covers every supported head_dim.
MAX_ROTATION_SIZE = 256


def rotation_signs(n: int) -> torch.Tensor:
    """The fixed ±1 float32 sign pattern of length ``n`` (a power of two, at most 256)."""
    if n <= 0 or n & (n - 1) or n > MAX_ROTATION_SIZE:
        raise ValueError(f"rotation size {n} must be a power of two in 1..{MAX_ROTATION_SIZE}")
    signs = [1.0 if _hash_bit(i) else -1.0 for i in range(n)]
    return torch.tensor(signs, dtype=torch.float32)


def _hash_bit(i: int) -> int:
    # splitmix64 finalizer: a well-mixed bit per index, fixed forever.
    z = (i + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return (z ^ (z >> 31)) & 1


def walsh_hadamard(x: torch.Tensor, n: int) -> torch.Tensor:
    """Unnormalized fast Walsh-Hadamard transform over consecutive blocks of ``n`` values of
    the last dimension (``x.shape[-1]`` must be a multiple of ``n``, a power of two)."""
    shape = x.shape
    blocks = x.reshape(-1, shape[-1] // n, n)
    h = 1
    while h < n:
        pairs = blocks.reshape(blocks.shape[0], blocks.shape[1], n // (2 * h), 2, h)
        a, b = pairs[..., 0, :], pairs[..., 1, :]
        blocks = torch.stack((a + b, a - b), dim=-2).reshape(blocks.shape)
        h *= 2
    return blocks.reshape(shape)


def rotate(x: torch.Tensor, rotation: torch.Tensor) -> torch.Tensor:
    """Apply ``R`` (`hadamard_matrix`) to each block of ``n`` values of the last dimension of
    ``x``, in float32 (a matrix product, the fast form on CPUs)."""
    n = rotation.shape[0]
    blocks = x.to(torch.float32).reshape(-1, n)
    return (blocks @ rotation.T.to(x.device)).reshape(x.shape)


def unrotate(y: torch.Tensor, rotation: torch.Tensor) -> torch.Tensor:
    """Apply ``R⁻¹ = Rᵀ`` (the inverse of `rotate`) to float32 ``y``."""
    n = rotation.shape[0]
    return (y.reshape(-1, n) @ rotation.to(y.device)).reshape(y.shape)


def round_query_codes(q: torch.Tensor, rotation: torch.Tensor) -> torch.Tensor:
    """Queries [..., head_dim] as the q8/q4 decode kernel dots them with keys: rotated, each
    group of 32 rounded to int8 codes times one scale (its largest magnitude / 127; a code
    is ``floor(v / scale + 0.5)``), rotated back; float32. A reference for what that rounding
    costs (the kernel also multiplies by the softmax scale first, which changes nothing)."""
    rotated = rotate(q, rotation)
    groups = rotated.reshape(*q.shape[:-1], q.shape[-1] // GROUP_SIZE, GROUP_SIZE)
    amax = groups.abs().amax(dim=-1, keepdim=True)
    scale = torch.where(amax > 0, amax / 127, torch.ones_like(amax))
    codes = torch.floor(groups / scale + 0.5)
    return unrotate((codes * scale).reshape(q.shape), rotation)


def hadamard_matrix(n: int) -> torch.Tensor:
    """The normalized rotation ``R = H_n · diag(s) / sqrt(n)`` as an [n, n] float32 matrix
    (``rotate(x) = x @ Rᵀ``), computed with the butterfly."""
    signs = rotation_signs(n)
    rows = walsh_hadamard(torch.diag(signs), n) * inv_sqrt(n)  # row j: R applied to e_j
    return rows.T.contiguous()


def inv_sqrt(n: int) -> float:
    """``1 / sqrt(n)`` rounded to float32 (exactly representable as a Python float): the
    normalization of `hadamard_matrix`, the same value the Triton kernels use."""
    return float(torch.tensor(1.0 / math.sqrt(n), dtype=torch.float32))
