"""The fused compact draw: on CUDA with triton, everything the compact draw does after its one
top-k (temperature, top_k, top_p, the counter-based Gumbel noise and the argmax, and the
validity check) is one Triton kernel, `fused.compact_draw_kernel`.

Why: the torch compact draw (`draw.draw_compact`) is about 45 small kernels per step (the
integer hash alone is 26), each a few microseconds of host time to launch; this is one launch.
The torch draw stays the CPU path, the path for any other stage, and the oracle the kernel is
tested against (the same integer hash, so the same uniforms bit for bit).

Where the two can differ: top_p sums probabilities (softmax, cumulative sum) in a different
order than torch's kernels, so a token whose preceding mass is within float rounding of top_p
may be kept by one and cut by the other. The compact and full-width torch draws already differ
in the same way (their softmax sums run over different widths).

The top-k itself is ``torch.topk`` or a two-stage Triton top-k (`topk_kernel.topk_rows`,
which reads each row once), chosen by ``topk`` (`TOPK_CHOICES`; the sampler's ``fused_topk``
option). Both give the candidates descending with a NaN first (so a NaN row is still
reported); equal logits come in column order from the Triton one and in an unspecified order
from torch.topk, so where equal logits straddle the bound the two may keep different ones.
torch.topk stays for bounds past `TRITON_TOPK_MAX_BOUND`. "auto" (the default) takes the
Triton top-k up to `AUTO_TRITON_MAX_BOUND`, where it measured faster (BENCHMARKS.md,
"9. Sampler").

triton is imported only when the fused draw runs (CI has none).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal, NamedTuple

import numpy as np
import torch

from dyngen_core.ops.triton_support import libdevice, require_triton, tl, triton, triton_by_default
from dyngen_core.sampling.rows import Row, RowList
from dyngen_core.sampling.upload import Staging

# Stages the fused draw handles: the edits run before the top-k, on the full rows.
FUSED_STAGES = frozenset({"bias", "penalties", "dry", "temperature", "top_k", "top_p"})
# One program holds a row's candidates in registers.
MAX_FUSED_BOUND = 1024
NO_TOP_P = 2.0  # a top_p no mass reaches: the row is not cut
TopkChoice = Literal["torch", "triton", "auto"]
TOPK_CHOICES: tuple[TopkChoice, ...] = ("torch", "triton", "auto")
# The fused draw's top-k when the sampler is not told.
DEFAULT_TOPK: TopkChoice = "auto"
TRITON_TOPK_MAX_BOUND = 1024  # `topk_kernel.MAX_BOUND`, without importing triton here
# "auto": the Triton top-k up to this bound (its sort grows with the bound; torch.topk's
# radix select hardly does; BENCHMARKS.md, "9. Sampler").
AUTO_TRITON_MAX_BOUND = 256


def fused_draw_default(device: torch.device) -> bool:
    """Whether ``device`` uses the kernel when not told (`triton_support.triton_by_default`)."""
    return triton_by_default(device)


def check_fused_device(device: torch.device) -> None:
    """Raise ValueError when the kernel cannot run on ``device``."""
    require_triton(device, "fused_draw")


def check_topk_choice(topk: str) -> TopkChoice:
    """``topk`` as a `TopkChoice`; ValueError naming the choices when it is none."""
    for choice in TOPK_CHOICES:
        if topk == choice:
            return choice
    raise ValueError(f"fused_topk must be one of {TOPK_CHOICES} (or None); got {topk!r}")


def fusable(rows: RowList, bound: int) -> bool:
    """Whether the compact draw of ``rows`` with ``bound`` candidates can be fused: every row's
    stages are `FUSED_STAGES`, and no row needs its final logits back (probabilities, top
    tokens: those read whole rows)."""
    return (bound <= MAX_FUSED_BOUND and not rows.prob_rows and not rows.any_top_tokens
            and not rows.any_early_dynamic_temperature
            and all(used <= FUSED_STAGES for used in rows.groups))


class FusedColumns(NamedTuple):
    """Per-row parameters of the kernel, on the device: float32 ``temps`` (1.0: none), int64
    ``top_k`` (clamped to the bound) and float32 ``top_p`` (2.0: none)."""

    temps: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor


HostColumns = tuple[np.ndarray, np.ndarray, np.ndarray]


def host_columns(rows: Sequence[Row], bound: int) -> HostColumns:
    """The rows' `FusedColumns` on the host: float32 temps, int64 top_k, float32 top_p."""
    temps, top_k, top_p = [], [], []
    # By settings object (a row's stages come from its settings): rows usually share a few,
    # and these columns are rebuilt whenever the set of sampled jobs changes.
    seen: dict[int, tuple[float, int, float]] = {}
    for row in rows:
        settings = row.settings
        values = seen.get(id(settings))
        if values is None:
            stages = row.stages
            values = seen[id(settings)] = (
                settings.temperature if "temperature" in stages else 1.0,
                min(max(settings.top_k, 1), bound),
                settings.top_p if "top_p" in stages else NO_TOP_P)
        temps.append(values[0])
        top_k.append(values[1])
        top_p.append(values[2])
    return (np.array(temps, np.float32), np.array(top_k, np.int64),
            np.array(top_p, np.float32))


def _keys_and_columns(rows: RowList, staging: Staging,
                      bound: int) -> tuple[torch.Tensor, FusedColumns]:
    """This step's row keys on the device, and the rows' columns: sent with the keys (one
    copy) the first time, then kept in ``rows.memo`` while the rows are reused."""
    keys = rows.keys()
    columns = rows.memo.get(("fused", bound))
    if columns is None:
        temps, top_k, top_p = _host_columns_of(rows, bound)
        (keys_on, top_k_on), (temps_on, top_p_on) = staging.send([keys, top_k], [temps, top_p])
        columns = rows.memo[("fused", bound)] = FusedColumns(temps_on, top_k_on, top_p_on)
        return keys_on, columns
    return staging.send_ints(keys), columns


def fused_columns(rows: RowList, staging: Staging, bound: int) -> FusedColumns:
    """The rows' `FusedColumns` on the device, kept in ``rows.memo`` as `_keys_and_columns`
    keeps them (sent alone, one copy, when missing)."""
    columns = rows.memo.get(("fused", bound))
    if columns is None:
        temps, top_k, top_p = _host_columns_of(rows, bound)
        (top_k_on,), (temps_on, top_p_on) = staging.send([top_k], [temps, top_p])
        columns = rows.memo[("fused", bound)] = FusedColumns(temps_on, top_k_on, top_p_on)
    return columns


def _host_columns_of(rows: RowList, bound: int) -> HostColumns:
    """The rows' columns on the host, kept in ``rows.memo`` (a list carried over from this
    one cuts them instead of recomputing: `carry_host_columns`)."""
    host = rows.memo.get(("fused-host", bound))
    if host is None:
        host = rows.memo[("fused-host", bound)] = host_columns(rows, bound)
    return host


def carry_host_columns(host: HostColumns, rows: Sequence[Row], dropped: Sequence[int],
                       start: int, bound: int) -> HostColumns:
    """`host_columns(rows, bound)` from ``host``, those of a list that ``rows`` is without its
    rows ``dropped`` (ascending) and with new rows from ``start`` on (`row_cache.carry_rows`):
    the survivors' values cut out, the new rows' computed. Selecting rows of the old device
    columns instead would cost kernels of their own; sent with the step's keys, these are a
    few more bytes in a copy that happens anyway."""
    added = host_columns(rows[start:], bound)
    temps, top_k, top_p = (np.concatenate([np.delete(old, dropped), new])
                           for old, new in zip(host, added, strict=True))
    return temps, top_k, top_p


def draw_fused(x: torch.Tensor, rows: RowList, staging: Staging, bound: int,
               topk: TopkChoice = DEFAULT_TOPK) -> torch.Tensor:
    """The compact draw of ``x`` ``[rows, vocab]`` (edited logits, any float dtype; not
    modified) with ``bound`` candidates per row, fused: int64 ``[rows]`` on the device, each
    row's token, or -1 for a row with no allowed token (or a NaN logit). ``topk``: which
    top-k finds the candidates (`launch_fused_draw`)."""
    keys, columns = _keys_and_columns(rows, staging, bound)
    out = torch.empty(x.shape[0], dtype=torch.int64, device=x.device)
    launch_fused_draw(x, keys, columns, bound, out, topk=topk)
    return out


def launch_fused_draw(x: torch.Tensor, keys: torch.Tensor, columns: FusedColumns, bound: int,
                      out: torch.Tensor, *, topk: TopkChoice = DEFAULT_TOPK) -> None:
    """The top-k of ``x`` and the kernel over it, each row's token into ``out`` [rows]
    (``keys`` int64 [rows, 2]); what `draw_graph` captures.

    topk: "torch" (``torch.topk``), "triton" (`topk_kernel.topk_rows`; torch.topk for
        bounds past `TRITON_TOPK_MAX_BOUND`) or "auto" (Triton up to
        `AUTO_TRITON_MAX_BOUND`, else torch): the same candidates either way, up to which
        of equal logits at the bound are kept (module docstring).
    """
    from dyngen_core.sampling.fused import compact_draw_kernel

    values, token_ids = candidates(x, bound, topk)
    block = max(16, 1 << (bound - 1).bit_length())
    compact_draw_kernel[(x.shape[0],)](
        values, token_ids, keys, columns.temps, columns.top_k, columns.top_p, out, bound,
        values.stride(0), token_ids.stride(0), BLOCK=block, LIBDEVICE=x.device.type == "cuda",
        num_warps=1 if block <= 256 else 4)


def candidates(x: torch.Tensor, bound: int,
               topk: TopkChoice = DEFAULT_TOPK) -> tuple[torch.Tensor, torch.Tensor]:
    """The top ``bound`` (values, int64 token ids) of every row of ``x``, descending, by the
    ``topk`` of `launch_fused_draw` (values float32 from "triton", ``x``'s dtype from
    "torch")."""
    most = AUTO_TRITON_MAX_BOUND if topk == "auto" else TRITON_TOPK_MAX_BOUND
    if topk != "torch" and bound <= min(most, x.shape[1]):
        from dyngen_core.sampling.topk_kernel import topk_rows

        return topk_rows(x, bound)
    values, token_ids = torch.topk(x, bound, dim=-1)
    return values, token_ids


def hashed_uniforms(keys: torch.Tensor, token_ids: torch.Tensor, *,
                    noise: bool = False) -> torch.Tensor:
    """What the kernel draws for ``token_ids`` int64 ``[rows, n]`` under ``keys`` int64
    ``[rows, 2]``, float32 ``[rows, n]`` (for tests against `rng`).

    noise: False gives the uniforms ``u`` (`rng.open_uniform` of the hash); True gives
        ``log(-log(u))`` (`rng._log_neg_log_uniform`).
    """
    from dyngen_core.sampling.fused import uniform_noise_kernel

    token_ids, keys = token_ids.contiguous(), keys.contiguous()
    rows, n = token_ids.shape
    out = torch.empty(rows, n, dtype=torch.float32, device=token_ids.device)
    block = 128
    uniform_noise_kernel[(rows, (n + block - 1) // block)](
        token_ids, keys, out, n, BLOCK=block, NOISE=noise,
        LIBDEVICE=token_ids.device.type == "cuda")
    return out


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
    """`shaping.top_p` on one row whose finite values come first, in descending order (so it
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
