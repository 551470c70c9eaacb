"""The Triton paged-attention backend: reads fp16/bf16 or quantized (q8/q6/q4) pages in place.

`TritonPagedBackend.attend` writes the step's keys and values through the storage, then launches
`triton_kernels.paged_attention_kernel` over the page table: no gather of whole pages, no
dequantized copy of the cache. Quantized storage's exact rows (page heads, recent windows) are
read by the same kernel (`triton_exact`), and the step's rows enter the windows after it.
Decode-only batches take a launch whose shape depends on the batch size alone (one program per
sequence and KV head, the context split into a fixed number of parts merged by a second
kernel, or with ``merge_in_kernel`` by the last split program of each sequence and KV head,
`triton_decode_merge`), so it can be captured in a CUDA graph and replayed with new page
tables and context lengths. Batches with prefill chunks map query blocks to sequences with a
small table built once per forward on the host.

Shared prefixes: in a decode-only forward over unquantized pages, decodes whose page tables
begin with the same pages (prefix dedup) are planned into groups on the host (`shared_prefix`),
and each group's shared keys are read once for all its members (`triton_cascade_path` decides
and launches it), in eager forwards and in replayed CUDA graphs alike (`cascade_layout`,
`plan_cascade`). Quantized pages keep the plain path.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dyngen_core.engine.cascade import CascadePlan, CascadePolicy
from dyngen_core.engine.plan import StepPlan
from dyngen_core.kv.attention.base import ForwardBatch
from dyngen_core.kv.attention.triton.cascade import multiprocessors
from dyngen_core.kv.attention.triton.cascade_path import CascadeOptions, CascadePath
from dyngen_core.kv.attention.triton.cascade_tables import StaticCascadeLayout
from dyngen_core.kv.attention.triton.decode_merge import SplitCounters
from dyngen_core.kv.attention.triton.decode_options import DecodeOptions, split_buffers
from dyngen_core.kv.attention.triton.exact import ExactOperands, exact_operands
from dyngen_core.kv.attention.triton.kernels import launch_combine, paged_attention_kernel
from dyngen_core.kv.attention.triton.page_operands import (
    HeadShape,
    PageOperands,
    page_arguments,
    page_operands,
    triton_next_pow2,
)
from dyngen_core.kv.attention.triton.prefill import TiledPrefill, TiledPrefillOptions
from dyngen_core.kv.attention.triton.quant import (
    WORD_BITS,
    WordKernelFlags,
    attend_word_decode,
    deferred_word_write,
    word_counters,
    word_decode_fits,
)
from dyngen_core.kv.attention.triton.rotation import ROTATION_GROUP
from dyngen_core.kv.attention.triton.step_write import StepWrite, step_write_for
from dyngen_core.kv.quant.write import StepQuantWrite
from dyngen_core.kv.storage import KVStorage

LOG2_E = 1.4426950408889634


@dataclass(frozen=True)
class _QueryBlocks:
    """Query blocks of a batch with prefill chunks: block i is sequence ``seq[i]`` from its
    query token ``first[i]``."""

    seq: torch.Tensor
    first: torch.Tensor


class TritonPagedBackend:
    """Paged attention in Triton over any dyngen storage mode (CUDA, or the Triton interpreter).

    block_n: keys per inner-loop step.
    prefill_rows: query rows (tokens x heads of a KV group) per prefill program.
    max_splits: most parts the context of a decode (or a shared prefix) is split into.
    programs_per_sm: decode programs aimed for per multiprocessor when choosing the split count.
    decode_warps, prefill_warps: warps per program of decode-only and other batches. Decode:
        4 measured fastest on an H200 at 16k context (BENCHMARKS.md); prefill: 8 keeps its
        64-row tiles in registers without spills (ptxas, sm_90).
    word_block_n, word_warps: keys per loop step and warps per program of `triton_quant`'s
        kernel, which decode-only batches over q8/q4 pages take (it unpacks whole code words
        per field instead of reshaping them); ``word_block_n=None`` decodes them with the
        general kernel (for comparisons).
    word_launches: 1 runs that kernel's page programs and its exact-row ("tail") programs in
        one grid, 2 in two launches (neither's code then takes registers from the other),
        for batches above ``DecodeOptions.word_one_launch_max_seqs`` sequences.
    cascade_min_saved_keys, cascade_min_members, cascade_min_prefix_pages: when decode-only
        batches over unquantized pages use shared-prefix ("cascade") attention, as the fields
        of `shared_prefix.CascadePolicy` (whose defaults these are, with the reasons);
        ``cascade_min_saved_keys=None`` never cascades.
    cascade_rows: query rows (members x heads of a KV group) per shared-prefix program; each
        program reads its group's shared keys once for all of them.
    cascade_warps: warps per shared-prefix program (its tiles are prefill-sized).
    cascade_programs_per_sm: shared-prefix programs aimed for per multiprocessor when choosing
        how many parts a prefix is split into (each part adds partial results to merge).
        Defaults 64 rows x 4 warps x 2 programs: 65 us against 108 (the general kernel) per
        layer for 64 members over an 8k document on an H200 (benchmarks/cascade_kernel.py).
    word_flags: code paths of that kernel (`triton_quant.WordKernelFlags`; None: defaults).
    merge_in_kernel: decode-only launches over several splits merge them in the attention
        kernel (its last split program per sequence and KV head, `triton_decode_merge`)
        instead of a second launch (`combine_splits_kernel`): one kernel boundary less per
        layer, which is what a batch-1 CUDA-graph step pays for. The counters it needs are
        allocated by the first eager call of each batch size (``split_counters``).
    merge_rows: query rows x splits per load round of that merge (its splits are read
        ``merge_rows // group`` at a time).
    write_in_kernel: `attend` of a decode-only batch over unquantized pages on the plain
        path lets the attention kernel store the step's keys and values (`triton_step_write`)
        instead of a storage write launch before it, and over q8/q4 pages with a recent
        window the word kernel (`triton_quant.deferred_word_write`, unless
        ``WordKernelFlags.write_step`` is off); other batches write through the storage.
    in_kernel_max_seqs: merge and write in the kernel only for decode batches of at most this
        many sequences: on an H200 both save ~1.2 us a layer at batch 1 and cost up to 60 us
        at batch 256 x 16k (benchmarks/decode_attention.py).
    prefill_kernel: "tiled" runs prefill batches over unquantized pages with
        `triton_prefill`'s tiled causal kernel (``prefill_options`` tune it, see
        `TiledPrefillOptions`); "paged" runs them with the general paged kernel (as quantized
        pages always are).
    decode_options: the key loop of decode launches (`DecodeOptions`: page ids loaded ahead
        of the tiles, pipelining depth); None: its defaults.
    """

    name = "triton"

    def __init__(self, *, block_n: int = 64, prefill_rows: int = 64, max_splits: int = 32,
                 programs_per_sm: int = 4, decode_warps: int = 4, prefill_warps: int = 8,
                 cascade_min_saved_keys: int | None = CascadePolicy.min_saved_keys,
                 cascade_min_members: int = CascadePolicy.min_members,
                 cascade_min_prefix_pages: int = CascadePolicy.min_prefix_pages,
                 cascade_rows: int = 64, cascade_warps: int = 4,
                 cascade_programs_per_sm: int = 2, word_block_n: int | None = 64,
                 word_warps: int = 4, word_launches: int = 2,
                 word_flags: WordKernelFlags | None = None, merge_in_kernel: bool = True,
                 merge_rows: int = 64, write_in_kernel: bool = True, in_kernel_max_seqs: int = 4,
                 prefill_kernel: str = "tiled",
                 prefill_options: TiledPrefillOptions | None = None,
                 decode_options: DecodeOptions | None = None) -> None:
        if prefill_kernel not in ("tiled", "paged"):
            raise ValueError(f"prefill_kernel must be 'tiled' or 'paged', not {prefill_kernel!r}")
        self.tiled_prefill = TiledPrefill(prefill_options) if prefill_kernel == "tiled" else None
        self.block_n = block_n
        self.decode_options = decode_options or DecodeOptions()
        self.merge_in_kernel = merge_in_kernel
        self.merge_rows = merge_rows
        self.write_in_kernel = write_in_kernel
        self.in_kernel_max_seqs = in_kernel_max_seqs
        flags = word_flags or WordKernelFlags()
        # Per code width, built once: the decode path reads them every layer of every step.
        self.word_keywords = {bits: flags.keywords(bits) for bits in WORD_BITS}
        self.word_merge = flags.merge_in_kernel and merge_in_kernel
        self.word_write = flags.write_step
        self.split_counters = SplitCounters()
        self.word_block_n = word_block_n
        self.word_warps = word_warps
        self.word_launches = word_launches
        self.prefill_rows = prefill_rows
        self.max_splits = max_splits
        self.programs_per_sm = programs_per_sm
        self.decode_warps = decode_warps
        self.prefill_warps = prefill_warps
        self.cascade = CascadePath(CascadeOptions(
            policy=None if cascade_min_saved_keys is None else CascadePolicy(
                cascade_min_members, cascade_min_prefix_pages, cascade_min_saved_keys),
            rows=cascade_rows, warps=cascade_warps, programs_per_sm=cascade_programs_per_sm,
            block_n=block_n, max_splits=max_splits, decode_programs_per_sm=programs_per_sm))
        self._blocks: tuple[ForwardBatch, int, _QueryBlocks] | None = None
        self._rotations: dict[torch.device, torch.Tensor] = {}

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               storage: KVStorage, batch: ForwardBatch, scale: float) -> torch.Tensor:
        """Write k/v [T, Hkv, D] to storage, then attend q [T, H, D]; returns [T, H, D]."""
        deferred = (self.write_in_kernel and storage.mode == "fp16" and batch.is_decode_only
                    and batch.num_seqs <= self.in_kernel_max_seqs)
        quant_write = (deferred_word_write(storage, layer, k, v, batch, self.word_block_n)
                       if self.write_in_kernel and self.word_write else None)
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
        reads exactly (`triton_exact`); without them only page heads are exact.
        ``write_step``: ``step_rows`` are not written yet: the attention kernel stores them
        where it can (`triton_step_write`), else the storage writes them first.
        ``quant_write``: the quantized storage's write of ``step_rows`` left to the word
        kernel (`triton_quant.deferred_word_write`)."""
        ops = page_operands(storage, layer)
        heads = HeadShape.of(q, ops)
        tables = self.cascade.tables(batch, storage, heads, q.device)
        step_write = step_write_for(storage, layer, batch, step_rows, ops.keys,
                                    tables is None) if write_step else None
        exact = exact_operands(storage, layer, batch, step_rows)
        rotation = self._rotation(q.device) if ops.key_bits or ops.value_bits else q
        page_args = page_arguments(ops, rotation)
        if tables is not None:
            def launch_remainder(out: torch.Tensor, partials: tuple[torch.Tensor, torch.Tensor],
                                 splits: int, kv_start: torch.Tensor) -> None:
                self._launch_paged(q, ops, page_args, batch, heads, out, partials, scale,
                                   rows=max(16, heads.group_pad), block_q=1, blocks=None,
                                   splits=splits, kv_start=kv_start)

            return self.cascade.attend(q, ops, page_args, batch, tables, scale, heads,
                                       launch_remainder)
        word_block_n, small = self.word_block_n, self.decode_options.word_one_launch_max_seqs
        if (word_block_n is not None and exact is not None
                and word_decode_fits(batch, ops.key_bits, ops.value_bits, exact, word_block_n)):
            return attend_word_decode(
                q, page_args, batch, exact, scale * LOG2_E, key_bits=ops.key_bits,
                value_bits=ops.value_bits, num_kv_heads=heads.num_kv_heads,
                block_n=word_block_n, warps=self.word_warps,
                launches=1 if batch.num_seqs <= small else self.word_launches,
                splits=self._decode_splits(batch.num_seqs * heads.num_kv_heads, q.device),
                counters=word_counters(self.split_counters, batch, heads.num_kv_heads, q.device,
                                       self.word_merge, self.in_kernel_max_seqs),
                write=quant_write, **self.word_keywords[ops.value_bits])
        if quant_write is not None:
            raise RuntimeError("a quantized write was left to the word kernel, which this "
                               "batch does not take (deferred_word_write's rule is out of date)")
        num_tokens, num_heads, _ = q.shape
        out = torch.empty_like(q)
        if batch.is_decode_only:
            rows, block_q, blocks = max(16, heads.group_pad), 1, None
            splits = self._decode_splits(batch.num_seqs * heads.num_kv_heads, q.device)
        else:
            tiled = self.tiled_prefill
            if tiled is not None and tiled.takes(batch, q, ops.keys, ops.key_bits,
                                                 ops.value_bits):
                return tiled.attend(q, ops.keys, ops.values, batch, scale, out)
            rows = max(self.prefill_rows, heads.group_pad)
            block_q, splits = rows // heads.group_pad, 1
            blocks = self._query_blocks(batch, block_q, q.device)
        parts, lse = split_buffers(num_tokens, num_heads, splits, heads.head_pad, q.device)
        counters = None
        if (self.merge_in_kernel and blocks is None and splits > 1
                and batch.num_seqs <= self.in_kernel_max_seqs):
            counters = self.split_counters.for_launch(q.device,
                                                      batch.num_seqs * heads.num_kv_heads)
        self._launch_paged(q, ops, page_args, batch, heads, out, (parts, lse), scale,
                           rows=rows, block_q=block_q, blocks=blocks, splits=splits, exact=exact,
                           counters=counters, step_write=step_write)
        if splits > 1 and counters is None:
            launch_combine(parts, lse, out, splits, heads.head_dim, heads.head_pad)
        return out

    def cascade_layout(self, storage: KVStorage, num_heads: int, num_kv_heads: int,
                       capacity: int) -> StaticCascadeLayout | None:
        """Where CUDA graphs hold shared-prefix tables (`base.SharedPrefixGraphs`)."""
        return self.cascade.graph_layout(storage, num_heads, num_kv_heads, capacity)

    def plan_cascade(self, plan: StepPlan, storage: KVStorage) -> CascadePlan | None:
        """The shared-prefix groups of a decode-only ``plan`` (`base.SharedPrefixGraphs`)."""
        return self.cascade.plan_step(plan, storage)

    def _launch_paged(self, q: torch.Tensor, ops: PageOperands, page_args: tuple[object, ...],
                      batch: ForwardBatch, heads: HeadShape, out: torch.Tensor,
                      partials: tuple[torch.Tensor, torch.Tensor], scale: float, *, rows: int,
                      block_q: int, blocks: _QueryBlocks | None, splits: int,
                      kv_start: torch.Tensor | None = None,
                      exact: ExactOperands | None = None,
                      counters: torch.Tensor | None = None,
                      step_write: StepWrite | None = None) -> None:
        """One `paged_attention_kernel` launch; ``kv_start`` makes it a cascade's remainder,
        ``exact`` reads quantized storage's exact rows, ``counters`` (a decode over several
        splits) merges the splits in the kernel, ``step_write`` (a decode) stores the step's
        rows."""
        grid0 = batch.num_seqs if blocks is None else int(blocks.seq.shape[0])
        decode = self.decode_options
        parts, lse = partials
        unused = batch.query_start
        exact_args = exact.arguments() if exact is not None else (
            q, q, q, q, unused, unused, q, q, 0, 0)
        paged_attention_kernel[(grid0, heads.num_kv_heads, splits)](
            q, q.stride(0), q.stride(1), *page_args,
            batch.page_table, batch.page_table.stride(0), batch.context_lens, batch.query_start,
            blocks.seq if blocks is not None else unused,
            blocks.first if blocks is not None else unused,
            kv_start if kv_start is not None else unused,
            *exact_args,
            out, out.stride(0), out.stride(1),
            parts, lse, counters if counters is not None else unused,
            *(step_write.arguments() if step_write is not None else (q, q, 0, 0, 0, 0, unused, 0)),
            scale * LOG2_E,
            G=heads.group, G_PAD=heads.group_pad, BLOCK_Q=block_q, BLOCK_M=rows,
            BLOCK_N=self.block_n, HEAD_DIM=heads.head_dim, HEAD_PAD=heads.head_pad,
            PAGE_SIZE=batch.page_size, K_BITS=ops.key_bits, V_BITS=ops.value_bits,
            NUM_SPLITS=splits, DECODE=blocks is None, REMAINDER=kv_start is not None,
            WRITE_PARTIALS=splits > 1 or kv_start is not None,
            HEADS=exact is not None, WINDOW=exact.window if exact is not None else 0,
            num_warps=self.decode_warps if blocks is None else self.prefill_warps,
            num_stages=decode.stages if blocks is None else 3,
            PAGE_WINDOW=0 if blocks is not None else decode.window_for(
                batch.page_size, self.block_n, ops.key_bits > 0 or ops.value_bits > 0),
            DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
            MERGE=counters is not None, WRITE_STEP=step_write is not None,
            SPLIT_BLOCK=min(triton_next_pow2(splits),
                            max(1, self.merge_rows // heads.group_pad)),
        )

    def _decode_splits(self, programs: int, device: torch.device) -> int:
        """Split count from the batch shape only (never from context lengths), so a captured
        graph stays valid for every context length."""
        sms = multiprocessors(device)
        wanted = -(-self.programs_per_sm * sms // programs)
        return max(1, min(self.max_splits, wanted))

    def _query_blocks(self, batch: ForwardBatch, block_q: int,
                      device: torch.device) -> _QueryBlocks:
        cached = self._blocks
        if cached is not None and cached[0] is batch and cached[1] == block_q:
            return cached[2]
        seq: list[int] = []
        first: list[int] = []
        for index, qlen in enumerate(batch.query_lens_host):
            starts = range(0, qlen, block_q)
            seq.extend([index] * len(starts))
            first.extend(starts)
        blocks = _QueryBlocks(_to_device(seq, device), _to_device(first, device))
        self._blocks = (batch, block_q, blocks)
        return blocks

    def _rotation(self, device: torch.device) -> torch.Tensor:
        """The storage's 32x32 rotation R (row-major float32) on ``device``."""
        if device not in self._rotations:
            from dyngen_core.kv.quant.hadamard import hadamard_matrix

            self._rotations[device] = hadamard_matrix(ROTATION_GROUP).to(device).contiguous()
        return self._rotations[device]


def _to_device(values: list[int], device: torch.device) -> torch.Tensor:
    tensor = torch.tensor(values, dtype=torch.int32)
    if device.type == "cuda":
        tensor = tensor.pin_memory()
    return tensor.to(device, non_blocking=True)
