"""Merging the split partials of decode attention. A decode launch splits each sequence's context
into parts, its splits (flash-decoding), each writing a float32 partial output and its
log2-sum-exp; the parts are merged either by a second kernel (`combine_splits_kernel`,
`launch_combine`) or inside the attention kernel itself (`count_in_and_merge`), which saves a
kernel boundary per layer (the backend's rule says when: `decode.merges_in_kernel`).

In-kernel merge: each split program, once its partial is stored, counts in at its (sequence, KV
head) counter; the program that counts last merges every split's partial into the output and
puts the counter back to 0, so the counters are zero between launches, also across replays of a
captured graph. Ordering: the program's threads all store their partials before a barrier, then
one thread's acquire-release atomic publishes them (release) and, in the last program, makes
every other program's partials visible (acquire) before it reads them, from L2 (``.cg``: never
a line an earlier launch left in this multiprocessor's L1).

Counters (`SplitCounters`): one int32 per (sequence, KV head) of the largest decode batch seen,
per device, zeroed when allocated. A captured graph holds their address, so a buffer is never
freed or replaced in place: a larger batch adds a larger buffer, and all earlier ones stay. They
must exist before a capture uses them (CUDA-graph runners warm up eagerly first, which allocates
them). Launches sharing one device's counters must not run concurrently (one stream per device,
as the runner does).
"""

from __future__ import annotations

import torch

from dyngen_core.ops.triton_support import tl, triton

MIN_COUNTERS = 256
# The fewest partials `combine_splits_kernel` loads a row: split counts up to it share one
# compiled kernel (each power of two above it compiles its own).
MIN_COMBINE_PAD = 8
# Query rows x partials per load round of the in-kernel merge (`split_block`).
MERGE_ROWS = 64


def split_block(splits: int, group_pad: int) -> int:
    """Partials the in-kernel merge loads per round for ``group_pad`` query rows: `MERGE_ROWS`
    rows x partials, at most the splits' power of two."""
    return min(1 << (max(1, splits) - 1).bit_length(), max(1, MERGE_ROWS // group_pad))


def split_buffers(tokens: int, heads: int, splits: int, head_pad: int,
                  device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Partials [T, H, splits, head_pad] and log2-sum-exp [T, H, splits] (float32); with one
    split, placeholders (the kernel writes the output directly)."""
    if splits == 1:
        empty = torch.empty(1, dtype=torch.float32, device=device)
        return empty, empty
    parts = torch.empty(tokens, heads, splits, head_pad, dtype=torch.float32, device=device)
    lse = torch.empty(tokens, heads, splits, dtype=torch.float32, device=device)
    return parts, lse


@triton.jit(do_not_specialize=["num_splits"])
def combine_splits_kernel(part_out_ptr, part_lse_ptr, out_ptr, stride_ot, stride_oh,
                          num_heads, num_splits, SPLITS_PAD: tl.constexpr,
                          HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr):
    """Grid (tokens, heads): merge the ``num_splits`` (at most SPLITS_PAD) split partials of
    one query row into the output."""
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    splits = tl.arange(0, SPLITS_PAD)
    dims = tl.arange(0, HEAD_PAD)
    row = (token * num_heads + head) * num_splits
    lse = tl.load(part_lse_ptr + row + splits, mask=splits < num_splits, other=float("-inf"))
    top = tl.max(lse, 0)
    weight = tl.exp2(lse - top)
    parts = tl.load(part_out_ptr + (row + splits)[:, None] * HEAD_PAD + dims[None, :],
                    mask=(splits < num_splits)[:, None], other=0.0)
    out = tl.sum(parts * weight[:, None], 0) / tl.sum(weight, 0)
    tl.store(out_ptr + token * stride_ot + head * stride_oh + dims,
             out.to(out_ptr.dtype.element_ty), mask=dims < HEAD_DIM)


def launch_combine(parts: torch.Tensor, lse: torch.Tensor, out: torch.Tensor, splits: int,
                   head_dim: int, head_pad: int) -> None:
    """`combine_splits_kernel` over the partials ``parts`` [T, H, splits, head_pad] and ``lse``
    [T, H, splits] of a decode launch, into ``out`` [T, H, head_dim]."""
    num_tokens, num_heads = out.shape[0], out.shape[1]
    combine_splits_kernel[(num_tokens, num_heads)](
        parts, lse, out, out.stride(0), out.stride(1), num_heads,
        splits, SPLITS_PAD=max(MIN_COMBINE_PAD, 1 << (splits - 1).bit_length()),
        HEAD_DIM=head_dim, HEAD_PAD=head_pad, num_warps=4,
    )


@triton.jit
def count_in_and_merge(counter_ptr, part_out_ptr, part_lse_ptr, out_ptr, out_base,
                       stride_oh, first_row, first_head, splits_read, num_splits,
                       G: tl.constexpr, G_PAD: tl.constexpr,
                       SPLIT_BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr,
                       HEAD_PAD: tl.constexpr):
    """Count this program in at ``counter_ptr``; the last of the ``num_splits`` programs of
    one (sequence, KV head) merges the partials of splits [0, splits_read) of its ``G`` query
    rows into the output and resets the counter.

    Partials: [rows, num_splits, HEAD_PAD] float32 at ``part_out_ptr`` and log2-sum-exp
    [rows, num_splits] at ``part_lse_ptr``; this KV head's rows start at ``first_row`` (int64).
    Output row g goes to ``out_ptr + out_base + (first_head + g) * stride_oh``. Splits past
    ``splits_read`` are never read (empty ones: they hold no key, so weigh 0)."""
    tl.debug_barrier()  # every thread's partial stores come before the release below
    arrived = tl.atomic_add(counter_ptr, 1, sem="acq_rel")
    if arrived == num_splits - 1:
        _merge_partials(part_out_ptr, part_lse_ptr, out_ptr, out_base, stride_oh, first_row,
                        first_head, splits_read, num_splits, G, G_PAD, SPLIT_BLOCK, HEAD_DIM,
                        HEAD_PAD)
        tl.store(counter_ptr, 0)


@triton.jit
def fold_partials(m_i, l_i, acc, part_ptr, lse_ptr, first_row, count, valid, dims,
                  SPLIT_BLOCK: tl.constexpr, HEAD_PAD: tl.constexpr):
    """Fold ``count`` partials of each row into the online-softmax state (m_i, l_i, acc):
    row r's partials are rows ``first_row[r] + s`` (s < count) of the float32 outputs
    [*, HEAD_PAD] at ``part_ptr`` (normalized) with their log2-sum-exp at ``lse_ptr``; a
    normalized partial with log2-sum-exp L is the state (L, 1, output). ``SPLIT_BLOCK`` of them
    are loaded per round (one round of loads in flight instead of one per partial); rows not
    ``valid`` load nothing. Loads bypass L1 (``.cg``): another program may have just written
    them."""
    for s0 in range(0, count, SPLIT_BLOCK):
        splits = s0 + tl.arange(0, SPLIT_BLOCK)
        mask = valid[:, None] & (splits < count)[None, :]
        rows = first_row[:, None] + splits[None, :]
        lse = tl.load(lse_ptr + rows, mask=mask, other=float("-inf"), cache_modifier=".cg")
        m_new = tl.maximum(m_i, tl.max(lse, 1))
        weight = tl.exp2(lse - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        parts = tl.load(part_ptr + rows[:, :, None] * HEAD_PAD + dims[None, None, :],
                        mask=mask[:, :, None], other=0.0, cache_modifier=".cg")
        acc = acc * alpha[:, None] + tl.sum(parts * weight[:, :, None], 1)
        l_i = l_i * alpha + tl.sum(weight, 1)
        m_i = m_new
    return m_i, l_i, acc


@triton.jit
def _merge_partials(part_out_ptr, part_lse_ptr, out_ptr, out_base, stride_oh, first_row,
                    first_head, splits_read, num_splits, G: tl.constexpr,
                    G_PAD: tl.constexpr, SPLIT_BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr,
                    HEAD_PAD: tl.constexpr):
    """Log-sum-exp merge of the splits of all G rows (`fold_partials` from an empty state),
    stored to the output."""
    group = tl.arange(0, G_PAD)
    dims = tl.arange(0, HEAD_PAD)
    _, total, acc = fold_partials(
        tl.full([G_PAD], -1.0e30, tl.float32), tl.zeros([G_PAD], tl.float32),
        tl.zeros([G_PAD, HEAD_PAD], tl.float32), part_out_ptr, part_lse_ptr,
        (first_row + group) * num_splits, splits_read, group < G, dims, SPLIT_BLOCK, HEAD_PAD)
    out = acc / tl.where(total > 0, total, 1.0)[:, None]
    o_ptrs = out_ptr + out_base + (first_head + group)[:, None] * stride_oh + dims[None, :]
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty),
             mask=(group < G)[:, None] & (dims < HEAD_DIM)[None, :])


class SplitCounters:
    """The zeroed int32 counters of in-kernel split merges, per device (module docstring)."""

    def __init__(self) -> None:
        self._buffers: dict[torch.device, list[torch.Tensor]] = {}

    def for_launch(self, device: torch.device, count: int) -> torch.Tensor:
        """At least ``count`` zeroed counters on ``device``; allocates (outside a CUDA-graph
        capture only) when none held is large enough. Raises RuntimeError when a capture
        would need a new buffer (run the same batch eagerly once before capturing it)."""
        held = self._buffers.get(device)
        if held and held[-1].numel() >= count:
            return held[-1]
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                f"decode split counters for {count} (sequence, KV head) pairs are needed "
                f"inside a CUDA-graph capture but were never allocated: run the batch eagerly "
                f"once before capturing it (a warm-up forward allocates them)")
        size = max(MIN_COUNTERS, 1 << (max(1, count) - 1).bit_length())
        buffer = torch.zeros(size, dtype=torch.int32, device=device)
        self._buffers.setdefault(device, []).append(buffer)  # captured graphs keep older ones
        return buffer

    def held(self, device: torch.device) -> list[torch.Tensor]:
        """Every counter buffer allocated on ``device``, oldest first (all zero between
        launches)."""
        return list(self._buffers.get(device, []))
