"""The Triton paged-attention backend: reads fp16/bf16 or quantized (q8/q6/q4) pages in place.

`TritonPagedBackend.attend` writes the step's keys and values (through the storage, or inside
the attention kernel for small decode batches over float pages and for q8/q4 decodes with a
recent window), then routes the call: decode-only batches over q8/q4 pages to the word kernel
(`quant_decode`), prefill batches over float pages to the tiled prefill (`prefill`), everything
else to the paged kernel (`decode`), which reads quantized storage's exact rows (page heads,
recent windows) too; the step's rows enter the windows after it. No gather of whole pages, no
dequantized copy of the cache. Decode-only launches have a shape that depends on the batch size
alone (`decode.decode_splits`), so they are captured in CUDA graphs and replayed with new page
tables and context lengths. Batches with prefill chunks map query blocks to sequences with a
small table built once per forward on the host.

Shared prefixes: in a decode-only forward over unquantized pages, decodes whose page tables
begin with the same pages (prefix dedup) are planned into groups on the host (`engine.cascade`),
and each group's shared keys are read once for all its members (`cascade_path` decides and
launches it), in eager forwards and in replayed CUDA graphs alike (`graph_tables`). Quantized
pages keep the plain path.
"""

from __future__ import annotations

import torch

from dyngen_core.engine.cascade import CascadePolicy
from dyngen_core.kv.attention.base import ForwardBatch, GraphTables
from dyngen_core.kv.attention.triton import decode
from dyngen_core.kv.attention.triton.cascade_path import CascadePath
from dyngen_core.kv.attention.triton.decode import (
    LOG2_E,
    HeadShape,
    QueryBlocks,
    decode_splits,
    exact_operands,
    launch_paged,
    merges_in_kernel,
    page_arguments,
    page_operands,
    step_write_for,
)
from dyngen_core.kv.attention.triton.merge import SplitCounters, launch_combine, split_buffers
from dyngen_core.kv.attention.triton.prefill import TiledPrefill
from dyngen_core.kv.attention.triton.quant_decode import (
    attend_word_decode,
    deferred_word_write,
    page_splits,
    word_decode_fits,
)
from dyngen_core.kv.quant.format import GROUP_SIZE, hadamard_matrix
from dyngen_core.kv.quant.write import StepQuantWrite
from dyngen_core.kv.storage import KVStorage


class TritonPagedBackend:
    """Paged attention in Triton over any dyngen storage mode (CUDA, or the Triton interpreter).
    Its launch shapes are the module constants of `decode`, `prefill` and `quant_decode`.

    cascade_min_saved_keys, cascade_min_members, cascade_min_prefix_pages: when decode-only
        batches over unquantized pages use shared-prefix ("cascade") attention, as the fields
        of `engine.cascade.CascadePolicy` (whose defaults these are, with the reasons);
        ``cascade_min_saved_keys=None`` never cascades. The cascade's launch settings are
        `cascade_path`'s module constants.
    """

    name = "triton"

    def __init__(self, *, cascade_min_saved_keys: int | None = CascadePolicy.min_saved_keys,
                 cascade_min_members: int = CascadePolicy.min_members,
                 cascade_min_prefix_pages: int = CascadePolicy.min_prefix_pages) -> None:
        self.tiled_prefill = TiledPrefill()
        # The counters of in-kernel split merges (`merge.SplitCounters`).
        self.split_counters = SplitCounters()
        self.cascade = CascadePath(
            None if cascade_min_saved_keys is None else CascadePolicy(
                cascade_min_members, cascade_min_prefix_pages, cascade_min_saved_keys),
            block_n=decode.BLOCK_N, max_splits=decode.MAX_SPLITS,
            decode_programs_per_sm=decode.PROGRAMS_PER_SM)
        self._rotations: dict[torch.device, torch.Tensor] = {}

    def short_prefill_lengths(self, storage: KVStorage, dtype: torch.dtype,
                              group: int) -> tuple[int, ...]:
        """`base.PrefillShapesBackend`: the tiled prefill's short tiles over float pages of
        the model's dtype whose page size its key step divides (the paged kernel that serves
        every other prefill has one shape)."""
        if not TiledPrefill.serves(storage, dtype):
            return ()
        return self.tiled_prefill.short_query_lengths(dtype, group)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               storage: KVStorage, batch: ForwardBatch, scale: float) -> torch.Tensor:
        """Write k/v [T, Hkv, D] to storage, then attend q [T, H, D]; returns [T, H, D]."""
        deferred = storage.mode == "fp16" and merges_in_kernel(batch)
        quant_write = deferred_word_write(storage, layer, k, v, batch)
        if not deferred and quant_write is None:
            storage.write(layer, k, v, batch.slot_mapping, decode_window=batch.decode_window)
        out = self.attend_cached(layer, q, storage, batch, scale, step_rows=(k, v),
                                 write_step=deferred, quant_write=quant_write)
        if batch.token_seq_slots is not None:
            storage.write_recent(layer, k, v, batch.positions, batch.token_seq_slots)
        return out

    def attend_cached(self, layer: int, q: torch.Tensor, storage: KVStorage,
                      batch: ForwardBatch, scale: float,
                      step_rows: tuple[torch.Tensor, torch.Tensor] | None = None,
                      write_step: bool = False,
                      quant_write: StepQuantWrite | None = None) -> torch.Tensor:
        """Attention of q [T, H, D] over the pages already in storage (keys written).
        ``step_rows``: this step's keys and values, which quantized storage with a recent window
        reads exactly (`decode.exact_operands`); without them only page heads are exact.
        ``write_step``: ``step_rows`` are not written yet: the attention kernel stores them
        where it can (`decode.StepWrite`), else the storage writes them first.
        ``quant_write``: the quantized storage's write of ``step_rows`` left to the word
        kernel (`quant_decode.deferred_word_write`)."""
        ops = page_operands(storage, layer)
        heads = HeadShape.of(q, ops)
        tables = self.cascade.tables(batch, storage, heads, q.device)
        step_write = step_write_for(storage, layer, batch, step_rows, ops.keys,
                                    tables is None) if write_step else None
        exact = exact_operands(storage, layer, batch, step_rows)
        rotation = self._rotation(q.device) if ops.key_bits or ops.value_bits else q
        page_args = page_arguments(ops, rotation)
        if tables is not None:
            return self.cascade.attend(q, ops, page_args, batch, tables, scale, heads)
        if exact is not None and word_decode_fits(batch, ops.key_bits, ops.value_bits, exact):
            return attend_word_decode(
                q, page_args, batch, exact, scale * LOG2_E, key_bits=ops.key_bits,
                value_bits=ops.value_bits, num_kv_heads=heads.num_kv_heads,
                splits=page_splits(batch.num_seqs, heads.num_kv_heads, q.device),
                write=quant_write)
        if quant_write is not None:
            raise RuntimeError("a quantized write was left to the word kernel, which this "
                               "batch does not take (deferred_word_write's rule is out of date)")
        out = torch.empty_like(q)
        if not batch.is_decode_only and self.tiled_prefill.takes(batch, q, ops.keys,
                                                                 ops.key_bits, ops.value_bits):
            return self.tiled_prefill.attend(q, ops.keys, ops.values, batch, scale, out)
        if batch.is_decode_only:
            rows, block_q, blocks = max(16, heads.group_pad), 1, None
            splits = decode_splits(batch.num_seqs * heads.num_kv_heads, q.device)
        else:
            rows = max(decode.PREFILL_ROWS, heads.group_pad)
            block_q, splits = rows // heads.group_pad, 1
            blocks = self._query_blocks(batch, block_q, q.device)
        num_tokens, num_heads, _ = q.shape
        parts, lse = split_buffers(num_tokens, num_heads, splits, heads.head_pad, q.device)
        counters = None
        if blocks is None and splits > 1 and merges_in_kernel(batch):
            counters = self.split_counters.for_launch(q.device,
                                                      batch.num_seqs * heads.num_kv_heads)
        launch_paged(q, ops, page_args, batch, heads, out, (parts, lse), scale, rows=rows,
                     block_q=block_q, blocks=blocks, splits=splits, exact=exact,
                     counters=counters, step_write=step_write)
        if splits > 1 and counters is None:
            launch_combine(parts, lse, out, splits, heads.head_dim, heads.head_pad)
        return out

    def graph_tables(self, storage: KVStorage, num_heads: int, num_kv_heads: int,
                     capacity: int) -> GraphTables | None:
        """The shared-prefix tables of one set of CUDA graphs (`base.GraphTablesBackend`;
        `cascade_path.GraphCascade`)."""
        return self.cascade.graph_tables(storage, num_heads, num_kv_heads, capacity)

    def _query_blocks(self, batch: ForwardBatch, block_q: int,
                      device: torch.device) -> QueryBlocks:
        key = ("paged_blocks", block_q)
        cached = batch.memo.get(key)
        if isinstance(cached, QueryBlocks):
            return cached
        seq: list[int] = []
        first: list[int] = []
        for index, qlen in enumerate(batch.query_lens_host):
            starts = range(0, qlen, block_q)
            seq.extend([index] * len(starts))
            first.extend(starts)
        blocks = QueryBlocks(_to_device(seq, device), _to_device(first, device))
        batch.memo[key] = blocks
        return blocks

    def _rotation(self, device: torch.device) -> torch.Tensor:
        """The storage's 32x32 rotation R (row-major float32) on ``device``."""
        if device not in self._rotations:
            self._rotations[device] = hadamard_matrix(GROUP_SIZE).to(device).contiguous()
        return self._rotations[device]


def _to_device(values: list[int], device: torch.device) -> torch.Tensor:
    tensor = torch.tensor(values, dtype=torch.int32)
    if device.type == "cuda":
        tensor = tensor.pin_memory()
    return tensor.to(device, non_blocking=True)
