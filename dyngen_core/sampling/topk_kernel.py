"""A two-stage Triton top-k of float rows (`topk_rows`) for the fused draw's candidates
(`fused.launch_fused_draw`): what ``torch.topk(x, bound, dim=-1)`` returns (values widened to
float32), reading each row once (and ``k * group`` columns again); figures against torch.topk:
BENCHMARKS.md, "9. Sampler".

Keys: every float becomes an order-preserving int32 (`_ordered`), and a candidate one int64
key, that integer in the high word and ``0x7FFFFFFF - column`` in the low word: key order is
value order with ties to the lower column, and the column travels with the value (decoded
exactly: the values returned are the input's, bit for bit once widened).

Stage 1 (`group_max_kernel`, one program per row and chunk of ``chunk`` columns, streaming):
the largest ordered value of every group of ``group`` consecutive columns, and of every
super-group of ``super_group`` consecutive groups, into int32 scratch rows.
Stage 2 (`select_topk_kernel`, one program per row): the top ``k`` super-groups by (maximum,
lower index first) hold the top ``k`` groups, which hold the top ``k`` columns (an item
outside the top ``k`` of its level has ``k`` larger keys above it, one in each of the top
``k``), so the program sorts (``tl.topk``, bitonic) the super-group maxima, then the ``k *
super_group`` maxima of the chosen super-groups' groups, then the ``k * group`` keys of the
chosen groups' columns, and writes the first ``bound`` values and token ids, descending.
``k`` is the next power of two >= bound (tl.topk's k must be one).

Semantics: NaN (any sign) is the largest key, so a row with a NaN puts one first as
torch.topk does (and the fused draw reports that row: its NaN check sees it); -inf values are
ordinary keys (a row with fewer than ``bound`` finite values gets -inf candidates, lower
columns first); -0.0 orders just below +0.0. Columns past the row read as -inf past the
vocabulary, below every real column: never returned while ``bound <= vocab``.

Graph-capturable: no host sync; grids and scratch depend on shapes only. This module imports
triton through `ops.triton_support`; `fused` imports it lazily, on CUDA (or under
``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from dyngen_core.ops.triton_support import tl, triton

MAX_BOUND = 1024
DEFAULT_CHUNK = 8192
INT32_MIN = tl.constexpr(-(2**31))


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
    """Launch parameters of `topk_rows` (module docstring): ``k`` (the power of two >= bound
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
    (1 <= bound <= min(vocab, `MAX_BOUND`)); every option a power of two.

    chunk: columns per stage-1 program (None: `DEFAULT_CHUNK`, at most the vocabulary
        rounded up).
    group: columns per group (None: 16 for k <= 128, else 4).
    super_group: groups per super-group (None: 16 for k <= 128, else 8); halved (then
        ``group``) until a row has at least ``k`` super-groups.
    warps: stage-1 warps (None: one per 2048 columns, at least 4).
    select_warps: stage-2 warps (None: 8 while the largest sort is at most 4096 keys, else
        16).
    """
    if not 1 <= bound <= min(vocab, MAX_BOUND):
        raise ValueError(f"the Triton top-k takes 1 <= bound <= min(vocab, {MAX_BOUND}); "
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
    column, NaN first (module docstring). Written into ``values`` / ``ids`` when given
    ([rows, >= bound], contiguous columns); ``plan``: `topk_plan`'s (None: its defaults).
    Two launches and two scratch allocations; nothing waits for the device."""
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
