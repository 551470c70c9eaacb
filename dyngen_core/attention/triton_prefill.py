"""Host side of the tiled prefill kernel (`triton_prefill_kernels`): which batches it takes,
the tile shape per batch, the query-block table (heaviest blocks first) and the launch.

`TritonPagedBackend` hands it the non-decode batches over unquantized pages; quantized pages
and batches whose longest query is below ``min_query`` keep `triton_kernels`' paged kernel.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dyngen_core.attention.base import ForwardBatch
from dyngen_core.attention.triton_prefill_kernels import tiled_prefill_kernel

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

    rows: query rows (heads x tokens) per program for 16-bit pages; 128 fills two warpgroups'
        tensor-core tiles. short_rows: the rows used instead (when fewer) when every query of
        the batch fits in half a tile's tokens, so less of the tile is padding.
    heads_per_tile: query heads of one KV group per tile, sharing its key and value loads;
        None: the whole group (padded to a power of two), capped so a tile keeps 16 tokens.
    block_n: keys per loop step (a divisor of the page size). warps: per program of
        ``rows`` rows (half of them for ``short_rows``, at least 4). stages: software
        pipelining depth of the key loop.
    min_query: batches whose longest query is shorter take the paged kernel instead.
    float32_rows, float32_block_n, float32_stages: the smaller tile of float32 pages (their
        dots run without tensor-core tiles and their key tiles take twice the shared memory).
    """

    rows: int = 128
    short_rows: int = 64
    heads_per_tile: int | None = None
    block_n: int = 64
    warps: int = 8
    stages: int = 2
    min_query: int = 2
    float32_rows: int = 64
    float32_block_n: int = 32
    float32_stages: int = 1


@dataclass(frozen=True)
class _Blocks:
    """Query block i is sequence ``seq[i]`` from its query token ``first[i]``."""

    seq: torch.Tensor
    first: torch.Tensor


class TiledPrefill:
    """The tiled prefill path of one backend (it caches the current batch's block table)."""

    def __init__(self, options: TiledPrefillOptions | None = None) -> None:
        self.options = options or TiledPrefillOptions()
        self._blocks: tuple[ForwardBatch, int, _Blocks] | None = None

    def takes(self, batch: ForwardBatch, q: torch.Tensor, keys: torch.Tensor,
              key_bits: int, value_bits: int) -> bool:
        """Whether this path attends ``batch``: unquantized pages of the queries' dtype, a
        page size the key step divides, and a longest query of at least ``min_query``."""
        if key_bits or value_bits or keys.dtype != q.dtype or not batch.query_lens_host:
            return False
        tile = self.tile(batch, q.dtype, q.shape[1] // keys.shape[2])
        return (max(batch.query_lens_host) >= self.options.min_query
                and batch.page_size % tile.block_n == 0)

    def tile(self, batch: ForwardBatch, dtype: torch.dtype, group: int) -> PrefillTile:
        """The launch shape for ``batch`` (depends on its longest query, the dtype and the
        group size only)."""
        opts = self.options
        rows = opts.float32_rows if dtype == torch.float32 else opts.rows
        group_pad = _next_pow2(group)
        heads = opts.heads_per_tile or group_pad
        heads = max(1, min(heads, group_pad, rows // 16))
        if max(batch.query_lens_host) * 2 <= rows // heads and opts.short_rows < rows:
            rows = opts.short_rows
            heads = max(1, min(heads, rows // 16))
        warps = max(4, opts.warps * rows // opts.rows)
        if dtype == torch.float32:
            return PrefillTile(rows // heads, heads, opts.float32_block_n, 4,
                               opts.float32_stages)
        return PrefillTile(rows // heads, heads, opts.block_n, warps, opts.stages)

    def attend(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
               batch: ForwardBatch, scale: float, out: torch.Tensor) -> torch.Tensor:
        """Causal attention of q [T, H, D] over the pages (this step's keys already written)
        into ``out`` [T, H, D]; keys/values [pages, page_size, kv_heads, D]."""
        num_kv_heads, head_dim = keys.shape[2], keys.shape[3]
        group = q.shape[1] // num_kv_heads
        tile = self.tile(batch, q.dtype, group)
        if batch.page_size % tile.block_n:
            raise ValueError(f"the prefill key step ({tile.block_n}) must divide the page size "
                             f"({batch.page_size}): choose a smaller block_n")
        subgroups = -(-group // tile.heads_per_tile)
        blocks = self._query_blocks(batch, tile.block_q, q.device)
        head_programs = num_kv_heads * subgroups
        grid = (int(blocks.seq.shape[0]) * head_programs,)
        tiled_prefill_kernel[grid](
            q, q.stride(0), q.stride(1),
            keys, values, *keys.stride()[:3], *values.stride()[:3],
            batch.page_table, batch.page_table.stride(0), batch.context_lens, batch.query_start,
            blocks.seq, blocks.first,
            out, out.stride(0), out.stride(1),
            scale * LOG2_E, head_programs,
            G=group, SUBGROUPS=subgroups, HEADS_PER_TILE=tile.heads_per_tile,
            BLOCK_Q=tile.block_q, BLOCK_N=tile.block_n, HEAD_DIM=head_dim,
            HEAD_PAD=max(16, _next_pow2(head_dim)), PAGE_SIZE=batch.page_size,
            DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
            num_warps=tile.warps, num_stages=tile.stages,
        )
        return out

    def _query_blocks(self, batch: ForwardBatch, block_q: int,
                      device: torch.device) -> _Blocks:
        """Every sequence's query blocks, the ones with the most keys to read first (each
        layer of a forward reuses the table)."""
        cached = self._blocks
        if cached is not None and cached[0] is batch and cached[1] == block_q:
            return cached[2]
        work: list[tuple[int, int, int]] = []
        for seq, (qlen, ctx) in enumerate(zip(batch.query_lens_host, batch.context_lens_host,
                                              strict=True)):
            for first in range(0, qlen, block_q):
                work.append((ctx - qlen + min(first + block_q, qlen), seq, first))
        work.sort(key=lambda item: -item[0])
        blocks = _Blocks(_to_device([w[1] for w in work], device),
                         _to_device([w[2] for w in work], device))
        self._blocks = (batch, block_q, blocks)
        return blocks


def _next_pow2(n: int) -> int:
    return 1 << (max(1, n) - 1).bit_length()


def _to_device(values: list[int], device: torch.device) -> torch.Tensor:
    tensor = torch.tensor(values, dtype=torch.int32)
    if device.type == "cuda":
        tensor = tensor.pin_memory()
    return tensor.to(device, non_blocking=True)
