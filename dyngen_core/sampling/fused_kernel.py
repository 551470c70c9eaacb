"""Triton kernels of the fused compact draw (`dyngen_core.sampling.fused`): one program per
logits row does temperature, top_k, top_p and the Gumbel-max draw on the row's top ``bound``
candidates, and writes the chosen token id (-1 when the row has no finite candidate).

This module imports triton at the top: only `fused` imports it, lazily, when the draw runs on
CUDA with triton installed (or under ``TRITON_INTERPRET=1`` in tests). The integer hash is
`dyngen_core.sampling.rng`'s, in native uint32 arithmetic (wrapping multiplication is the
masked int64 product there), so the uniforms are bit for bit the torch ones; the float steps
follow the torch code's order, with IEEE division and (on CUDA) libdevice's ``logf``/``expf``,
the functions torch's CUDA kernels call.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra import libdevice


@triton.jit
def _mix32(x):
    """`rng._mix32` on uint32 values (its two multipliers, `rng._M1` and `rng._M2`)."""
    x ^= x >> 16
    x = x * tl.full(x.shape, 0x21F0AAAD, tl.uint32)
    x ^= x >> 15
    x = x * tl.full(x.shape, 0x735A2D97, tl.uint32)
    return x ^ (x >> 15)


@triton.jit
def _log(x, LIBDEVICE: tl.constexpr):
    if LIBDEVICE:
        return libdevice.log(x)
    return tl.log(x)


@triton.jit
def _exp(x, LIBDEVICE: tl.constexpr):
    if LIBDEVICE:
        return libdevice.exp(x)
    return tl.exp(x)


@triton.jit
def _uniform(token_ids, a, b):
    """The hashed uniforms of ``token_ids`` under row key words ``a``, ``b`` (uint32):
    `rng.open_uniform` of `rng._log_neg_log_uniform`'s hash, exact in float32."""
    h = _mix32(_mix32(token_ids.to(tl.uint32) + a) ^ b)
    return ((h >> 8) | 1).to(tl.float32) * (1.0 / 16777216.0)


@triton.jit
def _log_neg_log_uniform(token_ids, a, b, LIBDEVICE: tl.constexpr):
    """``log(-log(u))``: `rng._log_neg_log_uniform`, minus the Gumbel noise."""
    return _log(-_log(_uniform(token_ids, a, b), LIBDEVICE), LIBDEVICE)


@triton.jit
def uniform_noise_kernel(token_ids_ptr, keys_ptr, out_ptr, n, BLOCK: tl.constexpr,
                         NOISE: tl.constexpr, LIBDEVICE: tl.constexpr):
    """``out[row, i]``: the uniform of token ``token_ids[row, i]`` under ``keys[row]`` (both
    int64, contiguous; ``out`` float32 ``[rows, n]``), or with ``NOISE`` its
    ``log(-log(u))``: the kernels' randomness, for tests."""
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = cols < n
    tokens = tl.load(token_ids_ptr + row * n + cols, mask=inside, other=0)
    a = tl.load(keys_ptr + 2 * row).to(tl.uint32)
    b = tl.load(keys_ptr + 2 * row + 1).to(tl.uint32)
    if NOISE:
        out = _log_neg_log_uniform(tokens, a, b, LIBDEVICE)
    else:
        out = _uniform(tokens, a, b)
    tl.store(out_ptr + row * n + cols, out, mask=inside)


@triton.jit
def _top_p(v, inside, p_target, LIBDEVICE: tl.constexpr):
    """`filters.top_p` on one row whose finite values come first, in descending order (so it
    is its own sorted copy): keep tokens while the mass before them is below ``p_target``."""
    e = _exp(v - tl.max(v, 0), LIBDEVICE)
    p = tl.math.div_rn(e, tl.broadcast_to(tl.sum(e, 0), e.shape))
    before = tl.cumsum(p, 0) - p
    keep = tl.maximum(tl.sum(((before < p_target) & inside).to(tl.int32), 0), 1)
    cut = tl.max(tl.where(tl.arange(0, v.shape[0]) == keep - 1, p, -1.0), 0)
    return tl.where(p < cut, float("-inf"), v)


@triton.jit
def compact_draw_kernel(values_ptr, token_ids_ptr, keys_ptr, temps_ptr, top_k_ptr, top_p_ptr,
                        out_ptr, bound, stride_values, stride_ids, BLOCK: tl.constexpr,
                        LIBDEVICE: tl.constexpr):
    """Row ``program_id(0)``: its top ``bound`` logits ``values`` (descending, as
    ``torch.topk`` returns them; any float dtype) and their int64 ``token_ids``; its int64 key
    words ``keys[row]``, float32 temperature (1.0: none), int32 top_k (``bound``: none) and
    float32 top_p (>= 1.0: none). Writes the drawn token id to int64 ``out[row]``, or -1 when
    the drawn logit is not finite (every candidate removed) or the row holds a NaN."""
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    inside = cols < bound
    v = tl.load(values_ptr + row * stride_values + cols, mask=inside,
                other=float("-inf")).to(tl.float32)
    tokens = tl.load(token_ids_ptr + row * stride_ids + cols, mask=inside, other=0)
    temp = tl.load(temps_ptr + row)
    v = tl.math.div_rn(v, tl.broadcast_to(temp, v.shape))
    k = tl.load(top_k_ptr + row)
    kth = tl.max(tl.where(cols == k - 1, v, float("-inf")), 0)
    v = tl.where(v < kth, float("-inf"), v)
    p_target = tl.load(top_p_ptr + row)
    if p_target < 1.0:
        v = _top_p(v, inside, p_target, LIBDEVICE)
    a = tl.load(keys_ptr + 2 * row).to(tl.uint32)
    b = tl.load(keys_ptr + 2 * row + 1).to(tl.uint32)
    perturbed = v - _log_neg_log_uniform(tokens, a, b, LIBDEVICE)
    perturbed = tl.where(inside, perturbed, float("-inf"))
    best = tl.max(perturbed, 0)
    pick = tl.argmax(perturbed, 0)
    chosen = tl.sum(tl.where(cols == pick, tokens, 0), 0)
    has_nan = tl.sum((perturbed != perturbed).to(tl.int32), 0) > 0
    valid = (tl.abs(best) < float("inf")) & ~has_nan
    tl.store(out_ptr + row, tl.where(valid, chosen, -1))
