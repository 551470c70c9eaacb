"""Host side of the tiled prefill kernel (`triton_prefill_kernels`): which batches it takes,
the tile shape per batch, the query-block table (heaviest blocks first) and the launch.

`TritonPagedBackend` hands it the non-decode batches over unquantized pages; quantized pages
and batches whose longest query is below ``min_query`` keep `triton_kernels`' paged kernel.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dyngen_core.kv.attention.base import ForwardBatch
from dyngen_core.kv.attention.triton.prefill_kernels import tiled_prefill_kernel

LOG2_E = 1.4426950408889634


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
class TiledPrefillOptions:
    """How the tiled prefill picks its tiles.

    rows: query rows (heads x tokens) per program of 16-bit pages; 128 fills two warpgroups'
        tensor-core tiles. While a launch's longest query fits in half a tile's tokens, its
        rows are halved, down to ``min_rows``, so short chunks are not mostly padding.
    heads_per_tile: query heads of one KV group per tile, sharing its key and value loads;
        None: the whole group (padded to a power of two), capped so a full tile keeps 16
        tokens.
    block_n: keys per loop step (a divisor of the page size). warps: per program of
        ``rows`` rows (fewer rows: proportionally fewer, at least 4). stages: software
        pipelining depth of the key loop. 32 keys x 3 stages (two programs a multiprocessor)
        measured fastest on an H200 for 256 x 512 and 4 x 2,048 tokens (256 x 512: 2.6 ms a
        layer against 3.4 at 64 keys x 2 stages), within 7 % of 128-key tiles on an 8k
        document (benchmarks/prefill_attention.py).
    short_query: in a batch that also holds longer chunks, sequences of at most this many
        queries (decodes, draft verification) run in a second launch with their own small
        tile instead of padding a large one.
    min_query: batches whose longest query is shorter take the paged kernel instead.
    float32_rows, float32_block_n, float32_stages: the smaller tile of float32 pages (their
        dots run without tensor-core tiles and their key tiles take twice the shared memory).
    """

    rows: int = 128
    min_rows: int = 16
    heads_per_tile: int | None = None
    block_n: int = 32
    warps: int = 8
    stages: int = 3
    short_query: int = 16
    min_query: int = 2
    float32_rows: int = 64
    float32_block_n: int = 32
    float32_stages: int = 1


@dataclass(frozen=True)
class _Launch:
    """One kernel launch: its tile, and query block i = sequence ``seq[i]`` from its query
    token ``first[i]``."""

    tile: PrefillTile
    seq: torch.Tensor
    first: torch.Tensor


class TiledPrefill:
    """The tiled prefill path of one backend (it caches the current batch's launches)."""

    def __init__(self, options: TiledPrefillOptions | None = None) -> None:
        self.options = options or TiledPrefillOptions()
        self._launches: tuple[ForwardBatch, torch.dtype, int, list[_Launch]] | None = None

    def takes(self, batch: ForwardBatch, q: torch.Tensor, keys: torch.Tensor,
              key_bits: int, value_bits: int) -> bool:
        """Whether this path attends ``batch``: unquantized pages of the queries' dtype, a
        page size the key step divides, and a longest query of at least ``min_query``."""
        if key_bits or value_bits or keys.dtype != q.dtype or not batch.query_lens_host:
            return False
        return (max(batch.query_lens_host) >= self.options.min_query
                and batch.page_size % self._block_n(q.dtype) == 0)

    def tile(self, longest: int, dtype: torch.dtype, group: int) -> PrefillTile:
        """The launch shape for sequences whose longest query is ``longest`` tokens, of
        ``group`` query heads per KV head."""
        opts = self.options
        full = opts.float32_rows if dtype == torch.float32 else opts.rows
        group_pad = _next_pow2(group)
        heads = max(1, min(opts.heads_per_tile or group_pad, group_pad, full // 16))
        rows = full
        while rows > opts.min_rows and longest * 2 <= rows // heads:
            rows //= 2
            heads = min(heads, rows)
        if dtype == torch.float32:
            return PrefillTile(rows // heads, heads, opts.float32_block_n, 4,
                               opts.float32_stages)
        warps = max(4, opts.warps * rows // full)
        return PrefillTile(rows // heads, heads, opts.block_n, warps, opts.stages)

    def attend(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
               batch: ForwardBatch, scale: float, out: torch.Tensor) -> torch.Tensor:
        """Causal attention of q [T, H, D] over the pages (this step's keys already written)
        into ``out`` [T, H, D]; keys/values [pages, page_size, kv_heads, D]."""
        num_kv_heads, head_dim = keys.shape[2], keys.shape[3]
        group = q.shape[1] // num_kv_heads
        if batch.page_size % self._block_n(q.dtype):
            raise ValueError(f"the prefill key step ({self._block_n(q.dtype)}) must divide "
                             f"the page size ({batch.page_size}): choose a smaller block_n")
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
        when short sequences (``short_query``) sit beside longer chunks; each lists its
        query blocks with the most keys to read first, so the long tiles start first."""
        cached = self._launches
        if cached is not None and cached[0] is batch and cached[1:3] == (dtype, group):
            return cached[3]
        lens = batch.query_lens_host
        short = [i for i, qlen in enumerate(lens) if qlen <= self.options.short_query]
        long = [i for i, qlen in enumerate(lens) if qlen > self.options.short_query]
        parts = [part for part in (long, short) if part]
        launches = []
        for seqs in parts:
            tile = self.tile(max(lens[i] for i in seqs), dtype, group)
            seq, first = _query_blocks(batch, seqs, tile.block_q)
            launches.append(_Launch(tile, _to_device(seq, device), _to_device(first, device)))
        self._launches = (batch, dtype, group, launches)
        return launches

    def _block_n(self, dtype: torch.dtype) -> int:
        return self.options.float32_block_n if dtype == torch.float32 else self.options.block_n


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
