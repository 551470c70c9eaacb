"""The Triton kernels of the skinny matrix product y = x @ W^T (+ bias) for few rows of x
(`skinny_matmul` launches them).

Both read W [N, K] row-major, as ``F.linear`` takes it, once per launch (when the rows of x fit
one row block) with 16-byte loads along K, accumulate in float32 and write y [M, N] in x's dtype:

- `skinny_reduce_kernel`: broadcast-multiply and sum over K, for 1 to a few rows (BLOCK_M of
  1, 2 or 4). Products accumulate element-wise in a [BLOCK_M, BLOCK_N, BLOCK_K] register tile
  and are summed over K once after the loop, so the loop body is loads and FMAs only.
  Two ways to keep loads in flight across the K loop: ``PREFETCH`` double-buffers the tiles in
  registers (16-byte global loads straight to registers); ``NUM_STAGES`` > 1 has Triton
  pipeline the loop through shared memory (cp.async), which it does for loads that feed no
  tl.dot only when the loop asks (``tl.range(num_stages=...)``); on sm_90 the tiles then come
  back from shared memory in 2-byte loads, so which is faster is for the sweep to say.
- `skinny_dot_kernel`: tensor-core products with the roles swapped (W's rows are the long side:
  acc[BLOCK_N, BLOCK_M] += W_tile @ x_tile^T), x padded to BLOCK_M = 16 rows.

Out-of-range rows of W (the N tail) and of x are clamped to the last valid row instead of masked,
so the K loop carries no row masks; their results are dropped by the masked store. A K tail is
masked only when K is not a multiple of BLOCK_K (``EVEN_K`` false).

This module imports triton at the top: only `skinny_matmul` imports it, lazily.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit(do_not_specialize=["M"])
def skinny_reduce_kernel(
    x_ptr, w_ptr, bias_ptr, y_ptr,
    M, N, K, stride_xm, stride_wn, stride_ym,
    HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    NUM_STAGES: tl.constexpr, PREFETCH: tl.constexpr,
):
    """Program (n, m) writes y[m*BLOCK_M : +BLOCK_M, n*BLOCK_N : +BLOCK_N]."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    rows_m = tl.minimum(offs_m, M - 1).to(tl.int64)
    rows_n = tl.minimum(offs_n, N - 1).to(tl.int64)
    x_ptrs = x_ptr + rows_m[:, None] * stride_xm + offs_k[None, :]
    w_ptrs = w_ptr + rows_n[:, None] * stride_wn + offs_k[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N, BLOCK_K), dtype=tl.float32)
    if PREFETCH:
        # The next tile's loads go out before this tile's FMAs (registers double-buffered).
        x, w = _load_tile(x_ptrs, w_ptrs, 0, K, offs_k, EVEN_K)
        for k0 in range(BLOCK_K, K, BLOCK_K):
            x_next, w_next = _load_tile(x_ptrs + k0, w_ptrs + k0, k0, K, offs_k, EVEN_K)
            acc += x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :]
            x, w = x_next, w_next
        acc += x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :]
    else:
        for k0 in tl.range(0, K, BLOCK_K, num_stages=NUM_STAGES):
            x, w = _load_tile(x_ptrs + k0, w_ptrs + k0, k0, K, offs_k, EVEN_K)
            acc += x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :]
    out = tl.sum(acc, axis=2)
    _store(out, bias_ptr, y_ptr, offs_m, offs_n, M, N, stride_ym, HAS_BIAS)


@triton.jit(do_not_specialize=["M"])
def skinny_dot_kernel(
    x_ptr, w_ptr, bias_ptr, y_ptr,
    M, N, K, stride_xm, stride_wn, stride_ym,
    HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    NUM_STAGES: tl.constexpr,
):
    """Program (n, m) writes y[m*BLOCK_M : +BLOCK_M, n*BLOCK_N : +BLOCK_N] through tl.dot
    (BLOCK_M and BLOCK_N at least 16)."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    rows_m = tl.minimum(offs_m, M - 1).to(tl.int64)
    rows_n = tl.minimum(offs_n, N - 1).to(tl.int64)
    x_ptrs = x_ptr + rows_m[:, None] * stride_xm + offs_k[None, :]
    w_ptrs = w_ptr + rows_n[:, None] * stride_wn + offs_k[None, :]
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k0 in tl.range(0, K, BLOCK_K, num_stages=NUM_STAGES):
        x, w = _load_tile(x_ptrs + k0, w_ptrs + k0, k0, K, offs_k, EVEN_K)
        acc = tl.dot(w, tl.trans(x), acc)
    _store(tl.trans(acc), bias_ptr, y_ptr, offs_m, offs_n, M, N, stride_ym, HAS_BIAS)


@triton.jit
def _load_tile(x_ptrs, w_ptrs, k0, K, offs_k, EVEN_K: tl.constexpr):
    """The x and W tiles at K offset ``k0`` (pointers already advanced there); columns past K
    read as 0 unless K is a multiple of the block (``EVEN_K``)."""
    if EVEN_K:
        return tl.load(x_ptrs), tl.load(w_ptrs)
    k_mask = (k0 + offs_k)[None, :] < K
    return tl.load(x_ptrs, mask=k_mask, other=0.0), tl.load(w_ptrs, mask=k_mask, other=0.0)


@triton.jit
def _store(out, bias_ptr, y_ptr, offs_m, offs_n, M, N, stride_ym, HAS_BIAS: tl.constexpr):
    """Add the bias (float32) to out [BLOCK_M, BLOCK_N] and store the in-range part."""
    n_mask = offs_n < N
    if HAS_BIAS:
        bias = tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0)
        out += bias.to(tl.float32)[None, :]
    y_ptrs = y_ptr + offs_m[:, None].to(tl.int64) * stride_ym + offs_n[None, :]
    mask = (offs_m[:, None] < M) & n_mask[None, :]
    tl.store(y_ptrs, out.to(y_ptr.dtype.element_ty), mask=mask)
