"""The fused compact draw: on CUDA with triton, the compact draw's candidates come from one
top-k, and everything after it (temperature, top_k, top_p, the counter-based Gumbel noise, the
argmax and the validity check) is one Triton kernel, `compact_draw_kernel`. The top-k is
``torch.topk`` or this module's two-stage Triton top-k, `topk_rows` (which reads each row once).

The torch compact draw (`draw.draw_compact`) stays the CPU path, the path for any other stage,
and the oracle the kernel is tested against (the same integer hash, so the same uniforms bit for
bit). Where the two can differ: top_p sums probabilities (softmax, cumulative sum) in a
different order than torch's kernels, so a token whose preceding mass is within float rounding
of top_p may be kept by one and cut by the other. The compact and full-width torch draws
already differ in the same way (their softmax sums run over different widths).

Which top-k finds the candidates is ``topk`` (`TOPK_CHOICES`; the sampler's ``fused_topk``
option). Both give the candidates descending with a NaN first (so a NaN row is still
reported); equal logits come in column order from the Triton one and in an unspecified order
from torch.topk, so where equal logits straddle the bound the two may keep different ones.
torch.topk stays for bounds past `TRITON_TOPK_MAX_BOUND`. "auto" (the default) takes the
Triton top-k up to `AUTO_TRITON_MAX_BOUND`, where it measured faster (BENCHMARKS.md,
"9. Sampler").

The kernels take triton from `ops.triton_support`: this module imports without it (CI has
none), and the kernels launch only on CUDA or under ``TRITON_INTERPRET=1``.
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
# The most candidates the Triton top-k takes (one program sorts a row's candidates).
TRITON_TOPK_MAX_BOUND = 1024
# "auto": the Triton top-k up to this bound (its sort grows with the bound; torch.topk's
# radix select hardly does; BENCHMARKS.md, "9. Sampler").
AUTO_TRITON_MAX_BOUND = 256
# Columns per program of the Triton top-k's first stage (`topk_plan`).
DEFAULT_CHUNK = 8192
INT32_MIN = tl.constexpr(-(2**31))


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
    rows ``dropped`` (ascending) and with new rows from ``start`` on (`rows.carry_rows`):
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
    (``keys`` int64 [rows, 2]); what `draw.DrawGraphs` captures.

    topk: "torch" (``torch.topk``), "triton" (`topk_rows`; torch.topk for
        bounds past `TRITON_TOPK_MAX_BOUND`) or "auto" (Triton up to
        `AUTO_TRITON_MAX_BOUND`, else torch): the same candidates either way, up to which
        of equal logits at the bound are kept (module docstring).
    """
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


# The Triton top-k: `topk_rows`, its two kernels and its launch plan.


@triton.jit
def _ordered(v):
    """float32 -> int32 in the same order; every NaN -> 0x7FFFFFFF, above +inf."""
    bits = v.to(tl.int32, bitcast=True)
    ordered = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    return tl.where(v != v, 0x7FFFFFFF, ordered)


@triton.jit
def _key(ordered, index):
    """One int64 key per (ordered value, index): the value first, then the lower index."""
    return (ordered.to(tl.int64) << 32) | (0x7FFFFFFF - index).to(tl.int64)


@triton.jit
def _index(keys):
    """The index `_key` put in ``keys``, int32."""
    return (0x7FFFFFFF - (keys & 0x7FFFFFFF)).to(tl.int32)


@triton.jit
def group_max_kernel(x_ptr, group_ptr, super_ptr, vocab, stride_row, stride_col,
                     CHUNK: tl.constexpr, GROUP: tl.constexpr, SUPER: tl.constexpr):
    """Row ``program_id(0)``, chunk ``program_id(1)`` of ``x`` (any float dtype): the int32
    maxima (`_ordered`) of its groups into ``group_ptr`` and of its super-groups into
    ``super_ptr`` (contiguous rows of ``grid[1] * CHUNK // GROUP`` and ``// SUPER``)."""
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    groups: tl.constexpr = CHUNK // GROUP
    group = chunk * groups + tl.arange(0, groups)
    cols = group[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
    pointers = x_ptr + row.to(tl.int64) * stride_row + cols * stride_col
    if (chunk + 1) * CHUNK <= vocab:  # unmasked: wide loads whatever the vocabulary
        v = tl.load(pointers)
    else:
        v = tl.load(pointers, mask=cols < vocab, other=float("-inf"))
    best = tl.max(_ordered(v.to(tl.float32)), axis=1)
    tl.store(group_ptr + row.to(tl.int64) * tl.num_programs(1) * groups + group, best)
    supers: tl.constexpr = groups // SUPER
    top = tl.max(tl.reshape(best, (supers, SUPER)), axis=1)
    tl.store(super_ptr + (row.to(tl.int64) * tl.num_programs(1) + chunk) * supers
             + tl.arange(0, supers), top)


@triton.jit(do_not_specialize=["bound", "stride_values", "stride_ids"])  # vary with top_k
def select_topk_kernel(x_ptr, group_ptr, super_ptr, values_ptr, ids_ptr, vocab, bound,
                       groups_per_row, supers_per_row, stride_row, stride_col, stride_values,
                       stride_ids, SUPERS: tl.constexpr, GROUP: tl.constexpr,
                       SUPER: tl.constexpr, K: tl.constexpr):
    """Row ``program_id(0)``: its top ``K`` columns from the scratch of `group_max_kernel`
    (``SUPERS``: ``supers_per_row`` rounded up to a power of two), the first ``bound``
    written to float32 ``values`` and int64 ``ids``, descending."""
    row = tl.program_id(0).to(tl.int64)
    index = tl.arange(0, SUPERS)
    maxima = tl.load(super_ptr + row * supers_per_row + index, mask=index < supers_per_row,
                     other=INT32_MIN)
    chosen = _index(tl.topk(_key(maxima, index), K))
    group = chosen[:, None] * SUPER + tl.arange(0, SUPER)[None, :]
    maxima = tl.load(group_ptr + row * groups_per_row + group, mask=group < groups_per_row,
                     other=INT32_MIN)
    chosen = _index(tl.topk(tl.reshape(_key(maxima, group), (K * SUPER,)), K))
    cols = chosen[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
    v = tl.load(x_ptr + row * stride_row + cols * stride_col, mask=cols < vocab,
                other=float("-inf"))
    top = tl.topk(tl.reshape(_key(_ordered(v.to(tl.float32)), cols), (K * GROUP,)), K)
    ordered = (top >> 32).to(tl.int32)
    bits = tl.where(ordered < 0, ordered ^ 0x7FFFFFFF, ordered)
    rank = tl.arange(0, K)
    inside = rank < bound
    tl.store(values_ptr + row * stride_values + rank, bits.to(tl.float32, bitcast=True),
             mask=inside)
    tl.store(ids_ptr + row * stride_ids + rank, _index(top).to(tl.int64), mask=inside)


class TopkPlan(NamedTuple):
    """Launch parameters of `topk_rows`: ``k`` (the power of two >= bound
    sorted for), ``chunk`` columns per stage-1 program, ``group`` columns per group,
    ``super_group`` groups per super-group, ``chunks`` per row, and each stage's warps."""

    k: int
    chunk: int
    group: int
    super_group: int
    chunks: int
    warps: int
    select_warps: int

    @property
    def supers_per_row(self) -> int:
        return self.chunks * (self.chunk // (self.group * self.super_group))


def _pow2_at_least(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def topk_plan(vocab: int, bound: int, *, chunk: int | None = None, group: int | None = None,
              super_group: int | None = None, warps: int | None = None,
              select_warps: int | None = None) -> TopkPlan:
    """The launch of `topk_rows` for rows of ``vocab`` columns and ``bound`` candidates
    (1 <= bound <= min(vocab, `TRITON_TOPK_MAX_BOUND`)); every option a power of two.

    chunk: columns per stage-1 program (None: `DEFAULT_CHUNK`, at most the vocabulary
        rounded up).
    group: columns per group (None: 16 for k <= 128, else 4).
    super_group: groups per super-group (None: 16 for k <= 128, else 8); halved (then
        ``group``) until a row has at least ``k`` super-groups.
    warps: stage-1 warps (None: one per 2048 columns, at least 4).
    select_warps: stage-2 warps (None: 8 while the largest sort is at most 4096 keys, else
        16).
    """
    if not 1 <= bound <= min(vocab, TRITON_TOPK_MAX_BOUND):
        raise ValueError(f"the Triton top-k takes 1 <= bound <= min(vocab, "
                         f"{TRITON_TOPK_MAX_BOUND}); "
                         f"got bound {bound} for {vocab} columns (use torch.topk)")
    k = max(2, _pow2_at_least(bound))
    chunk = chunk or min(DEFAULT_CHUNK, max(_pow2_at_least(vocab), k))
    group = group or (16 if k <= 128 else 4)
    super_group = super_group or (16 if k <= 128 else 8)
    for name, value in (("chunk", chunk), ("group", group), ("super_group", super_group)):
        if value < 1 or value & (value - 1):
            raise ValueError(f"{name} must be a power of two; got {value}")
    chunks = -(-vocab // chunk)
    while (super_group > 1 or group > 1) and (
            group * super_group > chunk
            or _pow2_at_least(chunks * (chunk // (group * super_group))) < k):
        if super_group > 1:
            super_group //= 2
        else:
            group //= 2
    if _pow2_at_least(chunks * chunk // (group * super_group)) < k:
        raise ValueError(f"chunk {chunk} leaves fewer than k={k} super-groups")
    largest = max(_pow2_at_least(chunks * chunk // (group * super_group)), k * super_group,
                  k * group)
    return TopkPlan(k, chunk, group, super_group, chunks, warps or max(4, chunk // 2048),
                    select_warps or (8 if largest <= 4096 else 16))


def topk_rows(x: torch.Tensor, bound: int, *, values: torch.Tensor | None = None,
              ids: torch.Tensor | None = None, plan: TopkPlan | None = None,
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch.topk(x, bound, dim=-1)`` of ``x`` [rows, vocab] (float32, bfloat16 or float16,
    any strides): (float32 values, int64 ids) [rows, bound], descending, ties to the lower
    column, NaN first. Written into ``values`` / ``ids`` when given ([rows, >= bound],
    contiguous columns); ``plan``: `topk_plan`'s (None: its defaults). Two launches and two
    scratch allocations; nothing waits for the device, and grids and scratch depend on shapes
    only (graph-capturable). Each row is read once, and ``k * group`` of its columns again
    (figures against torch.topk: BENCHMARKS.md, "9. Sampler").

    Keys: every float becomes an order-preserving int32 (`_ordered`), and a candidate one
    int64 key, that integer in the high word and ``0x7FFFFFFF - column`` in the low word: key
    order is value order with ties to the lower column, and the column travels with the value
    (decoded exactly: the values returned are the input's, bit for bit once widened).

    Stage 1 (`group_max_kernel`, one program per row and chunk of ``chunk`` columns,
    streaming): the largest ordered value of every group of ``group`` consecutive columns, and
    of every super-group of ``super_group`` consecutive groups, into int32 scratch rows.
    Stage 2 (`select_topk_kernel`, one program per row): the top ``k`` super-groups by
    (maximum, lower index first) hold the top ``k`` groups, which hold the top ``k`` columns
    (an item outside the top ``k`` of its level has ``k`` larger keys above it, one in each of
    the top ``k``), so the program sorts (``tl.topk``, bitonic) the super-group maxima, then
    the ``k * super_group`` maxima of the chosen super-groups' groups, then the ``k * group``
    keys of the chosen groups' columns, and writes the first ``bound`` values and token ids,
    descending. ``k`` is the next power of two >= bound (tl.topk's k must be one).

    Semantics: NaN (any sign) is the largest key, so a row with a NaN puts one first as
    torch.topk does (and the fused draw reports that row: its NaN check sees it); -inf values
    are ordinary keys (a row with fewer than ``bound`` finite values gets -inf candidates,
    lower columns first); -0.0 orders just below +0.0. Columns past the row read as -inf past
    the vocabulary, below every real column: never returned while ``bound <= vocab``.
    """
    if x.ndim != 2 or x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"topk_rows takes 2-D float32/bfloat16/float16 rows; got "
                         f"{tuple(x.shape)} {x.dtype}")
    rows, vocab = x.shape
    plan = plan or topk_plan(vocab, bound)
    if values is None:
        values = torch.empty(rows, bound, dtype=torch.float32, device=x.device)
    if ids is None:
        ids = torch.empty(rows, bound, dtype=torch.int64, device=x.device)
    if values.stride(-1) != 1 or ids.stride(-1) != 1:
        raise ValueError("topk_rows writes rows with contiguous columns")
    if rows == 0:
        return values, ids
    groups_per_row = plan.chunks * (plan.chunk // plan.group)
    group_max = torch.empty(rows, groups_per_row, dtype=torch.int32, device=x.device)
    super_max = torch.empty(rows, plan.supers_per_row, dtype=torch.int32, device=x.device)
    group_max_kernel[(rows, plan.chunks)](
        x, group_max, super_max, vocab, x.stride(0), x.stride(1), CHUNK=plan.chunk,
        GROUP=plan.group, SUPER=plan.super_group, num_warps=plan.warps)
    select_topk_kernel[(rows,)](
        x, group_max, super_max, values, ids, vocab, bound, groups_per_row,
        plan.supers_per_row, x.stride(0), x.stride(1), values.stride(0), ids.stride(0),
        SUPERS=_pow2_at_least(plan.supers_per_row), GROUP=plan.group, SUPER=plan.super_group,
        K=plan.k, num_warps=plan.select_warps)
    return values, ids
