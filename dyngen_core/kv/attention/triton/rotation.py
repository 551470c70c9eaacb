"""The group rotation of quantized pages inside the Triton kernels: queries into the pages'
space, outputs back out of it.

Quantized pages hold keys and values rotated by ``R = H diag(s) / sqrt(32)`` on each group of
32 dims (`storage.hadamard`; rows ``k' = k R^T``). Attention needs only dot products, so a
kernel rotates the query once (``q . k = (q R^T) . k'``) and its output once
(``sum p v = (sum p v') R``) instead of every cached row. Every entry of ``R`` is
``+-1/sqrt(32)``: a 16-bit tile times the sign matrix ``sqrt(32) R`` is a tensor-core dot
whose operands are exact and whose sums are float32, scaled by ``1/sqrt(32)`` after. The
float32 FMA product it replaced (Triton's ``ieee`` dot of [rows x groups, 32] x [32, 32],
through its blocked layouts) took ~4 us of a q4 decode program's ~21 (H200, one layer at
batch 1 and 16k context: 25.1 -> 20.7 us). Float32 queries keep the exact product (a 16-bit
dot would round them).

Outputs are float32 accumulators and keep the float32 product: splitting one into two bfloat16
terms (value and remainder) for two sign dots measured slower in the same kernel (22.1 against
20.7 us: 250 registers a thread against 205).
"""

from __future__ import annotations

import triton
import triton.language as tl

ROTATION_GROUP = 32
_INV_SQRT_GROUP: tl.constexpr = tl.constexpr(ROTATION_GROUP ** -0.5)


@triton.jit
def rotate_rows(x, rot, BLOCK_M: tl.constexpr, HEAD_PAD: tl.constexpr):
    """x [BLOCK_M, HEAD_PAD] times ``rot`` [32, 32] (x's dtype) in each group of 32 columns, in
    float32: the exact float32 product for float32 x, a tensor-core dot for 16-bit x (exact
    for the +-1 sign matrix: exact products summed in float32)."""
    groups = tl.reshape(x, (BLOCK_M * (HEAD_PAD // 32), 32))
    if x.dtype == tl.float32:
        out = tl.dot(groups, rot, input_precision="ieee")
    else:
        out = tl.dot(groups, rot)
    return tl.reshape(out, (BLOCK_M, HEAD_PAD))


@triton.jit
def rotated_queries(q, rot_ptr, scale, BLOCK_M: tl.constexpr, HEAD_PAD: tl.constexpr):
    """Query rows q [BLOCK_M, HEAD_PAD] (as loaded) rotated into the pages' space (times
    ``R^T``, ``rot_ptr``: R row-major float32 [32, 32]) and times ``scale``, in float32.
    16-bit queries take the sign dot (module docstring), float32 ones the exact product."""
    r32 = tl.arange(0, 32)
    rot_t = tl.load(rot_ptr + r32[None, :] * 32 + r32[:, None])  # R^T
    if q.dtype == tl.float32:
        out = rotate_rows(q, rot_t, BLOCK_M, HEAD_PAD) * scale
    else:
        signs = tl.where(rot_t > 0, 1.0, -1.0).to(q.dtype)
        out = rotate_rows(q, signs, BLOCK_M, HEAD_PAD) * (scale * _INV_SQRT_GROUP)
    return out


@triton.jit
def rotated_back(acc, rot_ptr, BLOCK_M: tl.constexpr, HEAD_PAD: tl.constexpr):
    """Float32 output rows acc [BLOCK_M, HEAD_PAD] rotated back out of the pages' space (times
    ``R``), as the exact float32 product (module docstring)."""
    r32 = tl.arange(0, 32)
    rot = tl.load(rot_ptr + r32[:, None] * 32 + r32[None, :])
    return rotate_rows(acc, rot, BLOCK_M, HEAD_PAD)
