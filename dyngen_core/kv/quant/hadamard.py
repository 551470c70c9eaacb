"""The fixed orthogonal rotation applied to keys and values before they are quantized.

A rotation ``R = H_n · diag(s) / sqrt(n)`` (``H_n`` the Sylvester Hadamard matrix, ``s`` a fixed
±1 sign pattern) spreads an outlier channel evenly over ``n`` values, so the per-group scale is
set by the typical magnitude rather than by one channel. ``R`` is orthogonal: ``R⁻¹ = Rᵀ =
diag(s) · H_n / sqrt(n)``, and since attention only needs dot products, a kernel may work in the
rotated space (rotate q, un-rotate the output) without un-rotating each cached row.

The torch path applies ``R`` as a float32 matrix product. The Triton write computes the
same transform as a fast Walsh-Hadamard butterfly (stage ``h = 1, 2, 4, ...``: pairs at distance
``h`` become ``(a + b, a - b)``, see `walsh_hadamard`); the two
agree to float32 rounding.
"""

from __future__ import annotations

import math

import torch

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
    ``x``, in float32 (a matrix product: much faster on CPUs than the butterfly)."""
    n = rotation.shape[0]
    blocks = x.to(torch.float32).reshape(-1, n)
    return (blocks @ rotation.T.to(x.device)).reshape(x.shape)


def unrotate(y: torch.Tensor, rotation: torch.Tensor) -> torch.Tensor:
    """Apply ``R⁻¹ = Rᵀ`` (the inverse of `rotate`) to float32 ``y``."""
    n = rotation.shape[0]
    return (y.reshape(-1, n) @ rotation.to(y.device)).reshape(y.shape)


def hadamard_matrix(n: int) -> torch.Tensor:
    """The normalized rotation ``R = H_n · diag(s) / sqrt(n)`` as an [n, n] float32 matrix
    (``rotate(x) = x @ Rᵀ``), computed with the butterfly."""
    signs = rotation_signs(n)
    rows = walsh_hadamard(torch.diag(signs), n) * inv_sqrt(n)  # row j: R applied to e_j
    return rows.T.contiguous()


def inv_sqrt(n: int) -> float:
    """``1 / sqrt(n)`` rounded to float32 (exactly representable as a Python float): the
    normalization of `hadamard_matrix`, the same value the CUDA and Triton kernels use."""
    return float(torch.tensor(1.0 / math.sqrt(n), dtype=torch.float32))
