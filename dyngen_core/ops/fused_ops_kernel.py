"""The Triton kernels of the fused element-wise ops (`fused_ops` launches them): RMSNorm with an
optional residual add in front, and SiLU-and-mul over the fused gate/up product.

Both round exactly where the torch ops they replace round (float32 arithmetic on half inputs,
one rounding per torch op), so only the order of the norm's sum of squares differs:

- `rms_norm_kernel`: h = x + out rounded to the dtype (written when ``HAS_RESIDUAL``), then
  normed = (h32 * rsqrt(mean(h32^2) + eps)) rounded to the dtype, then y = weight * normed
  rounded. A program holds ``BLOCK_M`` whole rows in registers (one read, one write each).
  Input rows are addressed as (row // inner) * stride_xo + (row % inner) * stride_xi, so a
  3-D view [A, B, N] (per-head q/k of a fused projection) needs no copy; outputs are contiguous.
- `silu_mul_kernel`: y = (silu(gate) rounded) * up rounded, gate and up the two halves of each
  [2 * I] row; program (row, block) writes ``BLOCK`` columns of one row.

The norm's row count is not specialized on (``do_not_specialize``) and SiLU-and-mul takes none
(rows are its grid): prefill chunks of every length share one compile. This module imports
triton at the top: only `fused_ops` imports it, lazily.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit(do_not_specialize=["rows"])
def rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, h_ptr, y_ptr,
    rows, n, inner, stride_xo, stride_xi, stride_res, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """Program m normalizes rows [m * BLOCK_M, (m + 1) * BLOCK_M)."""
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    mask = (offs_m < rows)[:, None] & (offs_n < n)[None, :]
    row = offs_m.to(tl.int64)
    x_rows = (row // inner) * stride_xo + (row % inner) * stride_xi
    x = tl.load(x_ptr + x_rows[:, None] + offs_n[None, :], mask=mask, other=0.0)
    out_rows = row[:, None] * n + offs_n[None, :]
    if HAS_RESIDUAL:
        res = tl.load(res_ptr + row[:, None] * stride_res + offs_n[None, :], mask=mask,
                      other=0.0)
        x = (x.to(tl.float32) + res.to(tl.float32)).to(y_ptr.dtype.element_ty)
        tl.store(h_ptr + out_rows, x, mask=mask)
    x32 = x.to(tl.float32)
    mean_square = tl.sum(x32 * x32, axis=1) / n
    normed = (x32 * tl.math.rsqrt(mean_square + eps)[:, None]).to(y_ptr.dtype.element_ty)
    weight = tl.load(w_ptr + offs_n, mask=offs_n < n, other=0.0)
    y = normed.to(tl.float32) * weight.to(tl.float32)[None, :]
    tl.store(y_ptr + out_rows, y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def silu_mul_kernel(x_ptr, y_ptr, inter, stride_x, stride_y, BLOCK: tl.constexpr):
    """Program (row, b) writes y[row, b * BLOCK : (b + 1) * BLOCK]."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    x_row = x_ptr + row * stride_x
    gate = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_row + inter + cols, mask=mask, other=0.0)
    silu = (gate / (1.0 + tl.exp(-gate))).to(y_ptr.dtype.element_ty)
    y = silu.to(tl.float32) * up.to(tl.float32)
    tl.store(y_ptr + row * stride_y + cols, y.to(y_ptr.dtype.element_ty), mask=mask)
