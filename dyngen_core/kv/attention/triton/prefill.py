"""Prefill over unquantized pages: the tiled causal kernel (`tiled_prefill_kernel`) and its host
side (`TiledPrefill`: which batches it takes, the tile shape per batch, the query-block table,
heaviest blocks first, and the launch). Quantized pages and batches whose longest query is below
`MIN_QUERY` keep `decode.paged_attention_kernel`.

One program attends a tile of ``HEADS_PER_TILE`` query heads of one KV group x ``BLOCK_Q``
consecutive query tokens of one sequence (rows head-major: row r is head r // BLOCK_Q, token
r % BLOCK_Q), so the heads of a group share every key and value tile they load and a short chunk
(a 30-token question) still fills the tile. Keys are read in place through the page table, one
page lookup per key block (``BLOCK_N`` divides the page size). The keys every row of the tile
sees run in a loop without any masking; only the last block or two, on the causal diagonal, are
masked; keys past the tile's last position are never visited. Softmax in the log2 domain: the
scale times log2(e) is applied to the fp32 scores (one FMA with the max subtraction), and P is
cast to the pages' dtype for the PV product.

The tile shapes are module constants that production reads and the kernel benchmarks patch
(benchmarks/kernels/prefill_attention.py; figures in BENCHMARKS.md, section 3).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

import torch

from dyngen_core.kv.attention.base import ForwardBatch
from dyngen_core.kv.attention.triton.decode import LOG2_E
from dyngen_core.kv.storage import KVStorage
from dyngen_core.ops.triton_support import tl, triton

# Query rows (heads x tokens) per program over 16-bit pages; 128 fills two warpgroups'
# tensor-core tiles. While a launch's longest query fits in half a tile's tokens its rows are
# halved, down to MIN_ROWS, so short chunks are not mostly padding.
ROWS = 128
MIN_ROWS = 16
# Query heads of one KV group per tile, sharing its key and value loads; None: the whole group
# (padded to a power of two), capped so a full tile keeps 16 tokens.
HEADS_PER_TILE: int | None = None
# Keys per loop step (a divisor of the page size), warps per program of ROWS rows (fewer rows:
# proportionally fewer, at least 4), software-pipelining depth of the key loop.
BLOCK_N = 32
WARPS = 8
STAGES = 3
# In a batch that also holds longer chunks, sequences of at most this many queries (decodes,
# draft verification) run in a second launch with their own small tile.
SHORT_QUERY = 16
# Batches whose longest query is shorter take the paged kernel.
MIN_QUERY = 2
# The smaller tile of float32 pages (no tensor-core tiles; twice the shared memory a key tile).
FLOAT32_ROWS = 64
FLOAT32_BLOCK_N = 32
FLOAT32_STAGES = 1


@dataclass(frozen=True)
class PrefillTile:
    """One launch shape: ``heads_per_tile`` heads of a KV group x ``block_q`` query tokens
    per program, ``block_n`` keys per loop step, ``warps`` and software-pipeline ``stages``."""

    block_q: int
    heads_per_tile: int
    block_n: int
    warps: int
    stages: int

    @property
    def rows(self) -> int:
        return self.block_q * self.heads_per_tile


@dataclass(frozen=True)
class _Launch:
    """One kernel launch: its tile, and query block i = sequence ``seq[i]`` from its query
    token ``first[i]``."""

    tile: PrefillTile
    seq: torch.Tensor
    first: torch.Tensor


class TiledPrefill:
    """The tiled prefill path of one backend (a batch's launches are kept in its ``memo``)."""

    def takes(self, batch: ForwardBatch, q: torch.Tensor, keys: torch.Tensor,
              key_bits: int, value_bits: int) -> bool:
        """Whether this path attends ``batch``: unquantized pages of the queries' dtype, a
        page size the key step divides, and a longest query of at least `MIN_QUERY`."""
        if key_bits or value_bits or keys.dtype != q.dtype or not batch.query_lens_host:
            return False
        longest = max(batch.query_lens_host)
        return longest >= MIN_QUERY and _steps_pages(batch.page_size, q.dtype)

    @staticmethod
    def serves(storage: KVStorage, dtype: torch.dtype) -> bool:
        """Whether prefills over ``storage`` for a model of ``dtype`` can take this path: float
        pages (the model's dtype) of a page size the key step divides."""
        return storage.mode == "fp16" and _steps_pages(storage.page_size, dtype)

    def tile(self, longest: int, dtype: torch.dtype, group: int) -> PrefillTile:
        """The launch shape for sequences whose longest query is ``longest`` tokens, of
        ``group`` query heads per KV head."""
        full = FLOAT32_ROWS if dtype == torch.float32 else ROWS
        group_pad = _next_pow2(group)
        heads = max(1, min(HEADS_PER_TILE or group_pad, group_pad, full // 16))
        rows = full
        while rows > MIN_ROWS and longest * 2 <= rows // heads:
            rows //= 2
            heads = min(heads, rows)
        if dtype == torch.float32:
            return PrefillTile(rows // heads, heads, FLOAT32_BLOCK_N, 4, FLOAT32_STAGES)
        warps = max(4, WARPS * rows // full)
        return PrefillTile(rows // heads, heads, BLOCK_N, warps, STAGES)

    def short_query_lengths(self, dtype: torch.dtype, group: int) -> tuple[int, ...]:
        """One query length per launch shape that `tile` gives chunks shorter than a full
        tile (from `MIN_QUERY` tokens), the longest of each, ascending: a prefill of each
        compiles every shape a short prompt, or a short chunk beside longer ones, can take (a
        long prefill takes the full tile)."""
        full = self.tile(ROWS, dtype, group)
        longest: dict[PrefillTile, int] = {}
        for length in range(MIN_QUERY, ROWS + 1):
            tile = self.tile(length, dtype, group)
            if tile != full:
                longest[tile] = length
        return tuple(sorted(longest.values()))

    def attend(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
               batch: ForwardBatch, scale: float, out: torch.Tensor) -> torch.Tensor:
        """Causal attention of q [T, H, D] over the pages (this step's keys already written)
        into ``out`` [T, H, D]; keys/values [pages, page_size, kv_heads, D]."""
        num_kv_heads, head_dim = keys.shape[2], keys.shape[3]
        group = q.shape[1] // num_kv_heads
        if not _steps_pages(batch.page_size, q.dtype):
            raise ValueError(f"the prefill key step ({_block_n(q.dtype)}) must divide the page "
                             f"size ({batch.page_size}); this batch is for the paged kernel "
                             f"(`takes` says which batches this path serves)")
        for launch in self.launches(batch, q.dtype, group, q.device):
            tile = launch.tile
            subgroups = -(-group // tile.heads_per_tile)
            head_programs = num_kv_heads * subgroups
            tiled_prefill_kernel[(int(launch.seq.shape[0]) * head_programs,)](
                q, q.stride(0), q.stride(1),
                keys, values, *keys.stride()[:3], *values.stride()[:3],
                batch.page_table, batch.page_table.stride(0), batch.context_lens,
                batch.query_start, launch.seq, launch.first,
                out, out.stride(0), out.stride(1),
                scale * LOG2_E, head_programs,
                G=group, SUBGROUPS=subgroups, HEADS_PER_TILE=tile.heads_per_tile,
                BLOCK_Q=tile.block_q, BLOCK_N=tile.block_n, HEAD_DIM=head_dim,
                HEAD_PAD=max(16, _next_pow2(head_dim)), PAGE_SIZE=batch.page_size,
                DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
                num_warps=tile.warps, num_stages=tile.stages,
            )
        return out

    def launches(self, batch: ForwardBatch, dtype: torch.dtype, group: int,
                 device: torch.device) -> list[_Launch]:
        """The batch's launches (built once per forward, reused by every layer): one, or two
        when short sequences (`SHORT_QUERY`) sit beside longer chunks; each lists its
        query blocks with the most keys to read first, so the long tiles start first."""
        key = ("tiled_prefill", dtype, group)
        cached = batch.memo.get(key)
        if cached is not None:
            return cast(list[_Launch], cached)
        lens = batch.query_lens_host
        short = [i for i, qlen in enumerate(lens) if qlen <= SHORT_QUERY]
        long = [i for i, qlen in enumerate(lens) if qlen > SHORT_QUERY]
        parts = [part for part in (long, short) if part]
        launches = []
        for seqs in parts:
            tile = self.tile(max(lens[i] for i in seqs), dtype, group)
            seq, first = _query_blocks(batch, seqs, tile.block_q)
            launches.append(_Launch(tile, _to_device(seq, device), _to_device(first, device)))
        batch.memo[key] = launches
        return launches


def _block_n(dtype: torch.dtype) -> int:
    return FLOAT32_BLOCK_N if dtype == torch.float32 else BLOCK_N


def _steps_pages(page_size: int, dtype: torch.dtype) -> bool:
    """Whether the key step of ``dtype`` divides the page size (every key block in one page)."""
    return page_size % _block_n(dtype) == 0


def _query_blocks(batch: ForwardBatch, seqs: list[int],
                  block_q: int) -> tuple[list[int], list[int]]:
    """(sequence, first query token) of every ``block_q``-token block of ``seqs``, those
    whose last position is furthest first (their tiles read the most keys)."""
    work: list[tuple[int, int, int]] = []
    for seq in seqs:
        qlen, ctx = batch.query_lens_host[seq], batch.context_lens_host[seq]
        for first in range(0, qlen, block_q):
            work.append((ctx - qlen + min(first + block_q, qlen), seq, first))
    work.sort(key=lambda item: -item[0])
    return [w[1] for w in work], [w[2] for w in work]


def _next_pow2(n: int) -> int:
    return 1 << (max(1, n) - 1).bit_length()


def _to_device(values: list[int], device: torch.device) -> torch.Tensor:
    tensor = torch.tensor(values, dtype=torch.int32)
    if device.type == "cuda":
        tensor = tensor.pin_memory()
    return tensor.to(device, non_blocking=True)


@triton.jit
def _key_block(k_ptr, v_ptr, table_row, n0, kv_head, offs_n, dims, kv_end,
               stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh,
               MASKED: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr,
               PAGE_SIZE: tl.constexpr):
    """Key and value rows [BLOCK_N, HEAD_PAD] of keys n0.. (one page). MASKED: keys from
    ``kv_end`` on read as 0 (the tile's last blocks); padded head columns always do."""
    page = tl.load(table_row + n0 // PAGE_SIZE).to(tl.int64)
    slot = n0 % PAGE_SIZE + offs_n
    k_rows = (page * stride_kp + kv_head * stride_kh + slot * stride_ks)[:, None] + dims[None, :]
    v_rows = (page * stride_vp + kv_head * stride_vh + slot * stride_vs)[:, None] + dims[None, :]
    if MASKED:
        mask = (n0 + offs_n < kv_end)[:, None] & (dims < HEAD_DIM)[None, :]
        k = tl.load(k_ptr + k_rows, mask=mask, other=0.0)
        v = tl.load(v_ptr + v_rows, mask=mask, other=0.0)
    elif HEAD_PAD != HEAD_DIM:
        mask = (dims < HEAD_DIM)[None, :]
        k = tl.load(k_ptr + k_rows, mask=mask, other=0.0)
        v = tl.load(v_ptr + v_rows, mask=mask, other=0.0)
    else:
        k = tl.load(k_ptr + k_rows)
        v = tl.load(v_ptr + v_rows)
    return k, v


@triton.jit
def _attend_keys(q, m_i, l_i, acc, table_row, kv_lo, kv_hi, kv_end, position, kv_head,
                 k_ptr, v_ptr, stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh,
                 qk_scale, MASKED: tl.constexpr, BLOCK_N: tl.constexpr,
                 HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr, PAGE_SIZE: tl.constexpr,
                 DOT_PRECISION: tl.constexpr):
    """Online softmax of the tile's rows over key blocks [kv_lo, kv_hi) (block-aligned
    starts). MASKED: each row sees keys up to its ``position`` (the causal diagonal); else
    every row sees every key (no mask work at all). Returns the new (m, l, acc)."""
    offs_n = tl.arange(0, BLOCK_N)
    dims = tl.arange(0, HEAD_PAD)
    for n0 in range(kv_lo, kv_hi, BLOCK_N):
        k, v = _key_block(k_ptr, v_ptr, table_row, n0, kv_head, offs_n, dims, kv_end,
                          stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh,
                          MASKED, HEAD_DIM, HEAD_PAD, PAGE_SIZE)
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
        if MASKED:
            visible = (n0 + offs_n)[None, :] <= position[:, None]
            qk = tl.where(visible, qk * qk_scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(qk, 1))
            qk = qk - m_new[:, None]
        else:
            m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
            qk = qk * qk_scale - m_new[:, None]
        p = tl.exp2(qk)
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION)
        m_i = m_new
    return m_i, l_i, acc


# The page table's width changes with the longest sequence of each batch: not specialized,
# or each new width would compile the kernel again inside a step.
@triton.jit(do_not_specialize=["stride_pt"])
def tiled_prefill_kernel(
    q_ptr, stride_qt, stride_qh,
    k_ptr, v_ptr, stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh,
    page_table_ptr, stride_pt, context_lens_ptr, query_start_ptr,
    block_seq_ptr, block_first_ptr,
    out_ptr, stride_ot, stride_oh,
    qk_scale, head_programs,
    G: tl.constexpr, SUBGROUPS: tl.constexpr, HEADS_PER_TILE: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
    HEAD_PAD: tl.constexpr, PAGE_SIZE: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """1-D grid of (query blocks x ``head_programs``) programs, ``head_programs`` = kv_heads x
    SUBGROUPS: program i is query block i // head_programs (sequence ``block_seq``, first
    query token ``block_first``; the host orders blocks heaviest first, so the long tiles
    start in the first wave) for KV head (i % head_programs) // SUBGROUPS and its group's
    heads from ((i % head_programs) % SUBGROUPS) x HEADS_PER_TILE on.

    q [T, H, D] and out (strides ``stride_qt``/``stride_qh``, last dim contiguous); pages
    [pages, PAGE_SIZE, kv_heads, D]; page_table [B, width] (row stride ``stride_pt``);
    context_lens [B] (keys once this step is written, the chunk's own included);
    query_start [B + 1]. qk_scale: softmax scale x log2(e). Query token t of a sequence
    with q_len queries and ctx keys sits at position ctx - q_len + t and sees keys 0..that.
    G: query heads per KV head. DOT_PRECISION: "ieee" for float32 (exact), else "tf32"."""
    BLOCK_M: tl.constexpr = BLOCK_Q * HEADS_PER_TILE
    pid = tl.program_id(0)
    block = pid // head_programs
    kv_head = (pid % head_programs) // SUBGROUPS
    subgroup = (pid % head_programs) % SUBGROUPS
    seq = tl.load(block_seq_ptr + block)
    first = tl.load(block_first_ptr + block)
    q_start = tl.load(query_start_ptr + seq)
    q_len = tl.load(query_start_ptr + seq + 1) - q_start
    step_start = tl.load(context_lens_ptr + seq) - q_len

    rows = tl.arange(0, BLOCK_M)
    token = first + rows % BLOCK_Q
    head_in_group = subgroup * HEADS_PER_TILE + rows // BLOCK_Q
    row_valid = (token < q_len) & (head_in_group < G)
    head = kv_head * G + head_in_group
    position = step_start + token
    dims = tl.arange(0, HEAD_PAD)
    io_mask = row_valid[:, None] & (dims < HEAD_DIM)[None, :]
    q_rows = (q_start + token).to(tl.int64) * stride_qt + head * stride_qh
    q = tl.load(q_ptr + q_rows[:, None] + dims[None, :], mask=io_mask, other=0.0)

    # Keys below the tile's first position are seen by every row; its diagonal ends at its
    # last token's position.
    kv_end = step_start + tl.minimum(first + BLOCK_Q, q_len)
    full_hi = (step_start + first + 1) // BLOCK_N * BLOCK_N
    table_row = page_table_ptr + seq.to(tl.int64) * stride_pt
    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_PAD], tl.float32)
    m_i, l_i, acc = _attend_keys(
        q, m_i, l_i, acc, table_row, 0, full_hi, kv_end, position, kv_head,
        k_ptr, v_ptr, stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh,
        qk_scale, False, BLOCK_N, HEAD_DIM, HEAD_PAD, PAGE_SIZE, DOT_PRECISION)
    m_i, l_i, acc = _attend_keys(
        q, m_i, l_i, acc, table_row, full_hi, kv_end, kv_end, position, kv_head,
        k_ptr, v_ptr, stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh,
        qk_scale, True, BLOCK_N, HEAD_DIM, HEAD_PAD, PAGE_SIZE, DOT_PRECISION)
    acc = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    out_rows = (q_start + token).to(tl.int64) * stride_ot + head * stride_oh
    tl.store(out_ptr + out_rows[:, None] + dims[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=io_mask)
