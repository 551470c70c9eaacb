"""The paged decode kernel (`paged_attention_kernel`), its host launch (`launch_paged`), the
rules the backend decodes by (split count, page window, merge and write in the kernel), and the
operands every paged kernel of this backend reads.

One program serves one block of query rows of one sequence against one KV head: the rows are
``BLOCK_Q`` tokens x ``G_PAD`` query heads of that KV head's group (GQA), so a program reads each
key and value of the group once for all its query heads. A third grid axis splits the context
(flash-decoding): each split writes a partial result with its log-sum-exp, merged by a second
launch or, for small decode batches, by the last split program in the same launch (`merge`).
The same kernel runs prefill chunks over quantized pages (query blocks mapped to sequences by a
host table), the decodes the q8/q4 kernel does not take (q6 pages, and q8/q4 pages whose size
the word kernel's block does not divide).

Pages are read in place through the page table (`key_loop`): float pages [num_pages, page_size,
num_kv_heads, head_dim] in fp16/bf16/fp32, or quantized codes and scales in the rotated space.
Decode launches have a shape that depends on the batch size alone (`decode_splits`), so they are
captured in CUDA graphs and replayed with new page tables and context lengths.

In small decode batches over float pages the kernel also stores the step's key and value rows
itself (`StepWrite`, `store_step_row`): the program of each (sequence, KV head) whose split holds
the sequence's last position stores that position's rows at its slot, exactly as the storage's
write does (same slot, same conversion, nothing for a slot outside the pages), then reads its
keys; a barrier orders the store before its loads. Other programs never read that row (each
(sequence, KV head) row is read by the one split that writes it); CUDA-graph padding rows repeat
a real sequence, so their programs store identical bytes to the same place.

Operands, built by the backend once per layer and call and read by every paged kernel (this one,
`quant_decode`, the cascade's): the page tensors, scales, strides and rotation (`PageOperands`,
`page_operands`, `page_arguments`, in the order every paged kernel takes them), the head layout
of one call (`HeadShape`), and the exact rows of quantized storage (`ExactOperands`,
`exact_operands`: page heads, recent windows and this step's own rows, read by the rule of
`attention.sdpa`'s window reader).

The launch shapes are module constants that production reads and the kernel benchmarks patch
(benchmarks/kernels/decode_attention.py; figures in BENCHMARKS.md, sections 1 and 4).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dyngen_core.kv.attention.base import ForwardBatch
from dyngen_core.kv.attention.triton.key_loop import (
    attend_exact_rows,
    attend_keys,
    initial_state,
    load_scaled_queries,
    log2_sum_exp,
    normalized_rows,
)
from dyngen_core.kv.attention.triton.merge import count_in_and_merge, split_block
from dyngen_core.kv.quant.format import GROUP_SIZE
from dyngen_core.kv.quant.storage import QuantStorage
from dyngen_core.kv.storage import KVStorage
from dyngen_core.ops.triton_support import tl, triton

LOG2_E = 1.4426950408889634

# Keys per inner-loop step.
BLOCK_N = 64
# Warps per program of decode-only launches, and of prefill launches (8 keeps their 64-row
# tiles in registers without spills), and query rows per prefill program.
DECODE_WARPS = 4
PREFILL_WARPS = 8
PREFILL_ROWS = 64
# Software-pipelining depth of the key loop.
STAGES = 3
# Page ids loaded ahead of their tiles in decodes over float pages (a power of two), where the
# key tile divides the page size (`decode_page_window`); quantized pages keep the per-tile loop.
PAGE_WINDOW = 16
# Most parts a decode's context is split into, and decode programs aimed for per multiprocessor
# when choosing the split count (`decode_splits`).
MAX_SPLITS = 32
PROGRAMS_PER_SM = 4
# 32-bit registers of a multiprocessor, shared by its resident programs' threads (64K on every
# NVIDIA GPU since Kepler).
REGISTERS_PER_SM = 65536
# Decode batches of at most this many sequences merge their splits in the attention kernel,
# and over float pages store the step's rows in it (`merges_in_kernel`); larger ones run the
# storage's write and a second merge launch.
IN_KERNEL_MAX_SEQS = 4


def multiprocessors(device: torch.device) -> int:
    """Streaming multiprocessors of ``device``; 4 for the Triton interpreter on the CPU (a few
    splits still exercise the merges)."""
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).multi_processor_count)
    return 4


def decode_splits(programs: int, device: torch.device, *, one_wave: bool = False) -> int:
    """Split count of a decode launch of ``programs`` (sequence, KV head) pairs: enough to give
    every multiprocessor `PROGRAMS_PER_SM` programs (rounded up), or with ``one_wave`` at most
    that many (rounded down: the q8/q4 kernel in one launch, `quant_decode.page_splits`), at
    most `MAX_SPLITS`. From the batch shape only (never from context lengths), so a captured
    graph stays valid for every length."""
    slots = PROGRAMS_PER_SM * multiprocessors(device)
    wanted = slots // programs if one_wave else -(-slots // programs)
    return max(1, min(MAX_SPLITS, wanted))


def register_cap(programs: int, warps: int, device: torch.device) -> int | None:
    """The ``maxnreg`` of a launch of ``programs`` programs of ``warps`` warps: the registers a
    thread may hold for `PROGRAMS_PER_SM` programs to share a multiprocessor, where the launch
    has more programs than ``PROGRAMS_PER_SM - 1`` a multiprocessor (a kernel compiled to more
    registers than the cap, as q8's is, would have only that many resident); else None, the
    compiler's choice: a launch that small gains nothing from the instructions a cap costs."""
    if programs <= (PROGRAMS_PER_SM - 1) * multiprocessors(device):
        return None
    return REGISTERS_PER_SM // (PROGRAMS_PER_SM * warps * 32)


def decode_page_window(page_size: int, quantized: bool) -> int:
    """The kernel's PAGE_WINDOW for a decode over ``page_size``-slot pages: `PAGE_WINDOW` for
    float pages whose size the key tile divides, else 0 (the per-tile loop)."""
    return 0 if quantized or page_size % BLOCK_N else PAGE_WINDOW


def merges_in_kernel(batch: ForwardBatch) -> bool:
    """Whether a decode-only ``batch`` merges its splits (and, over float pages, writes its
    step's rows) in the attention kernel: at most `IN_KERNEL_MAX_SEQS` sequences."""
    return batch.is_decode_only and batch.num_seqs <= IN_KERNEL_MAX_SEQS


def next_pow2(n: int) -> int:
    """The smallest power of two >= n (n >= 1)."""
    return 1 << (max(1, n) - 1).bit_length()


@dataclass(frozen=True)
class PageOperands:
    """What the kernel reads for one layer: page tensors (codes as int32 words, or bytes for
    6-bit codes), their float16 scales (None for float pages) and the code widths (0: float)."""

    keys: torch.Tensor
    values: torch.Tensor
    key_scales: torch.Tensor | None
    value_scales: torch.Tensor | None
    key_bits: int
    value_bits: int


def page_operands(storage: KVStorage, layer: int) -> PageOperands:
    """The page tensors of ``layer`` for the storage modes dyngen ships (fp16 and q8/q6/q4)."""
    if storage.mode == "fp16":
        return PageOperands(storage.keys[layer], storage.values[layer],  # type: ignore[attr-defined]
                            None, None, 0, 0)
    pages = storage.layers[layer]  # type: ignore[attr-defined]
    key_bits = storage.key_format.bits  # type: ignore[attr-defined]
    value_bits = storage.value_format.bits  # type: ignore[attr-defined]
    return PageOperands(_code_view(pages.key_codes, key_bits),
                        _code_view(pages.value_codes, value_bits),
                        pages.key_scales, pages.value_scales, key_bits, value_bits)


def _code_view(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """4- and 8-bit codes as int32 words (the kernel loads whole words), 6-bit ones as bytes."""
    as_bytes = codes.view(torch.uint8)
    return as_bytes if bits == 6 else as_bytes.view(torch.int32)


@dataclass(frozen=True)
class HeadShape:
    """Head layout of one attention call: query heads per KV head (and its power-of-two pad),
    head_dim and the padded width the kernels use."""

    num_kv_heads: int
    group: int
    group_pad: int
    head_dim: int
    head_pad: int

    @staticmethod
    def of(q: torch.Tensor, ops: PageOperands) -> HeadShape:
        num_heads, head_dim = q.shape[1], q.shape[2]
        num_kv_heads = ops.keys.shape[2]
        group = num_heads // num_kv_heads
        head_pad = max(next_pow2(head_dim), GROUP_SIZE if ops.key_bits else 16)
        return HeadShape(num_kv_heads, group, next_pow2(group), head_dim, head_pad)


def page_arguments(ops: PageOperands, rotation: torch.Tensor) -> tuple[object, ...]:
    """The page tensors, scales, their strides and the rotation, in the order every paged
    kernel takes them (scales default to the page tensors, unread, for float pages)."""
    ks, vs = ops.key_scales, ops.value_scales
    return (ops.keys, ops.values, *ops.keys.stride()[:3], *ops.values.stride()[:3],
            ks if ks is not None else ops.keys, vs if vs is not None else ops.values,
            *_strides3(ks), *_strides3(vs), rotation)


def _strides3(t: torch.Tensor | None) -> tuple[int, int, int]:
    return (0, 0, 0) if t is None else (t.stride(0), t.stride(1), t.stride(2))


@dataclass(frozen=True)
class ExactOperands:
    """Kernel arguments for the exact rows of one layer: head rows, window rows and their
    positions, the batch's sequence slots, and this step's own rows in the stored form
    (rotated, minus the key offsets). ``window`` 0: head rows only (the other tensors are then
    placeholders the kernel never reads)."""

    head_keys: torch.Tensor
    head_values: torch.Tensor
    ring_keys: torch.Tensor
    ring_values: torch.Tensor
    ring_positions: torch.Tensor
    seq_slots: torch.Tensor
    fresh_keys: torch.Tensor
    fresh_values: torch.Tensor
    window: int

    def arguments(self) -> tuple[object, ...]:
        """In the kernel's order: head, ring, slot and fresh pointers, then the row strides
        (every exact-row tensor is [rows, kv_heads, head_dim], contiguous)."""
        return (self.head_keys, self.head_values, self.ring_keys, self.ring_values,
                self.ring_positions, self.seq_slots, self.fresh_keys, self.fresh_values,
                self.head_keys.stride(0), self.head_keys.stride(1))


def exact_operands(storage: KVStorage, layer: int, batch: ForwardBatch,
                   step_rows: tuple[torch.Tensor, torch.Tensor] | None) -> ExactOperands | None:
    """The exact rows of ``layer`` (None for unquantized storage). ``step_rows``: this step's
    keys and values [T, kv_heads, head_dim] as computed; without them (or without sequence
    slots in the batch, or a window in the storage) only the head rows are read."""
    if not isinstance(storage, QuantStorage):
        return None
    pages = storage.layers[layer]
    heads = (pages.key_heads, pages.value_heads)
    recent = storage.recent
    if recent is None or step_rows is None or batch.seq_slots is None:
        unused = batch.query_start
        return ExactOperands(*heads, heads[0], heads[1], unused, unused, heads[0], heads[1], 0)
    ring = recent.layers[layer]
    # The rows the storage's write just prepared for these tensors: no kernel runs here.
    fresh_keys, fresh_values = storage.exact_rows(layer, *step_rows)
    return ExactOperands(*heads, ring.keys, ring.values, ring.positions, batch.seq_slots,
                         fresh_keys.contiguous(), fresh_values.contiguous(), recent.window)


@dataclass(frozen=True)
class QueryBlocks:
    """Query blocks of a batch with prefill chunks: block i is sequence ``seq[i]`` from its
    query token ``first[i]``."""

    seq: torch.Tensor
    first: torch.Tensor


@dataclass(frozen=True)
class StepWrite:
    """This step's rows `paged_attention_kernel` stores before reading its keys (WRITE_STEP):
    keys and values [T, kv_heads, head_dim] (last dimension contiguous), their flat slots [T]
    (int64) and the pages' slot count."""

    keys: torch.Tensor
    values: torch.Tensor
    slots: torch.Tensor
    num_slots: int

    @staticmethod
    def of(keys: torch.Tensor, values: torch.Tensor, slots: torch.Tensor,
           pages: torch.Tensor) -> StepWrite:
        """The write of rows ``keys``/``values`` at ``slots`` into ``pages`` (a layer's
        [pages, page_size, kv_heads, head_dim] key or value tensor)."""
        return StepWrite(_last_dim_contiguous(keys), _last_dim_contiguous(values), slots,
                         pages.shape[0] * pages.shape[1])

    def arguments(self) -> tuple[object, ...]:
        """In the kernel's order: rows, their strides, slots, slot count."""
        k, v = self.keys, self.values
        return (k, v, k.stride(0), k.stride(1), v.stride(0), v.stride(1), self.slots,
                self.num_slots)


def step_write_for(storage: KVStorage, layer: int, batch: ForwardBatch,
                   step_rows: tuple[torch.Tensor, torch.Tensor] | None, pages: torch.Tensor,
                   plain_decode: bool) -> StepWrite | None:
    """The write of this step's rows ``step_rows`` for the attention kernel to do, when it
    can: unquantized storage (``pages``: the layer's key pages) and ``plain_decode`` (a
    decode-only batch taking the plain kernel, no shared-prefix pass). Otherwise the storage
    writes them now, and None comes back. Raises ValueError without ``step_rows``."""
    if step_rows is None:
        raise ValueError("a step write needs step_rows: the step's keys and values to write")
    if plain_decode and storage.mode == "fp16" and batch.is_decode_only:
        return StepWrite.of(*step_rows, batch.slot_mapping, pages)
    storage.write(layer, *step_rows, batch.slot_mapping)
    return None


def launch_paged(q: torch.Tensor, ops: PageOperands, page_args: tuple[object, ...],
                 batch: ForwardBatch, heads: HeadShape, out: torch.Tensor,
                 partials: tuple[torch.Tensor, torch.Tensor], scale: float, *, rows: int,
                 block_q: int, blocks: QueryBlocks | None, splits: int,
                 exact: ExactOperands | None = None,
                 counters: torch.Tensor | None = None,
                 step_write: StepWrite | None = None) -> None:
    """One `paged_attention_kernel` launch over q [T, H, D] into ``out`` (or, with several
    splits, into ``partials``: `merge.split_buffers`). ``blocks`` None: a decode; else the query
    blocks of prefill chunks. ``exact`` reads quantized storage's exact rows, ``counters`` (a
    decode over several splits) merges the splits in the kernel, ``step_write`` (a decode over
    float pages) stores the step's rows."""
    grid0 = batch.num_seqs if blocks is None else int(blocks.seq.shape[0])
    parts, lse = partials
    unused = batch.query_start
    exact_args = exact.arguments() if exact is not None else (
        q, q, q, q, unused, unused, q, q, 0, 0)
    write_args = (step_write.arguments() if step_write is not None
                  else (q, q, 0, 0, 0, 0, unused, 0))
    decode = blocks is None
    paged_attention_kernel[(grid0, heads.num_kv_heads, splits)](
        q, q.stride(0), q.stride(1), *page_args,
        batch.page_table, batch.page_table.stride(0), batch.context_lens, batch.query_start,
        blocks.seq if blocks is not None else unused,
        blocks.first if blocks is not None else unused,
        *exact_args,
        out, out.stride(0), out.stride(1),
        parts, lse, counters if counters is not None else unused,
        *write_args,
        scale * LOG2_E,
        G=heads.group, G_PAD=heads.group_pad, BLOCK_Q=block_q, BLOCK_M=rows,
        BLOCK_N=BLOCK_N, HEAD_DIM=heads.head_dim, HEAD_PAD=heads.head_pad,
        PAGE_SIZE=batch.page_size, K_BITS=ops.key_bits, V_BITS=ops.value_bits,
        DECODE=decode, WRITE_PARTIALS=splits > 1,
        HEADS=exact is not None, WINDOW=exact.window if exact is not None else 0,
        num_warps=DECODE_WARPS if decode else PREFILL_WARPS, num_stages=STAGES,
        PAGE_WINDOW=decode_page_window(batch.page_size, ops.key_bits > 0 or ops.value_bits > 0)
        if decode else 0,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        MERGE=counters is not None, WRITE_STEP=step_write is not None,
        SPLIT_BLOCK=split_block(splits, heads.group_pad) if counters is not None else 1,
    )


def _last_dim_contiguous(rows: torch.Tensor) -> torch.Tensor:
    return rows if rows.stride(-1) == 1 else rows.contiguous()


# The page table's width changes with the longest sequence of each batch: not specialized, or
# each new width (Triton specializes 1, multiples of 16 and the rest) would compile again.
@triton.jit(do_not_specialize=["stride_pt"])
def paged_attention_kernel(
    q_ptr, stride_qt, stride_qh,
    k_ptr, v_ptr, stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh,
    ks_ptr, vs_ptr, stride_ksp, stride_kss, stride_ksh, stride_vsp, stride_vss, stride_vsh,
    rot_ptr,
    page_table_ptr, stride_pt, context_lens_ptr, query_start_ptr,
    block_seq_ptr, block_first_ptr,
    head_k_ptr, head_v_ptr, ring_k_ptr, ring_v_ptr, ring_pos_ptr, seq_slots_ptr,
    fresh_k_ptr, fresh_v_ptr, stride_er, stride_eh,
    out_ptr, stride_ot, stride_oh,
    part_out_ptr, part_lse_ptr, counter_ptr,
    step_k_ptr, step_v_ptr, stride_skt, stride_skh, stride_svt, stride_svh, slot_ptr, num_slots,
    scale_log2,
    G: tl.constexpr, G_PAD: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr, PAGE_SIZE: tl.constexpr,
    K_BITS: tl.constexpr, V_BITS: tl.constexpr,
    DECODE: tl.constexpr, WRITE_PARTIALS: tl.constexpr,
    HEADS: tl.constexpr, WINDOW: tl.constexpr, DOT_PRECISION: tl.constexpr,
    MERGE: tl.constexpr = False, SPLIT_BLOCK: tl.constexpr = 1, WRITE_STEP: tl.constexpr = False,
    PAGE_WINDOW: tl.constexpr = 0,
):
    """Grid (query blocks, kv heads, splits): the split count is the grid's, a run-time value,
    so batch sizes of different splits share a compiled kernel. DECODE: block i is sequence i,
    one query token; else block i is sequence ``block_seq[i]`` from its query token
    ``block_first[i]``.
    WRITE_PARTIALS: write each split's output and log-sum-exp for a later merge (required with
    more than one split) instead of the output itself.
    MERGE (DECODE with WRITE_PARTIALS): the last split program of each
    (sequence, KV head) to finish merges the partials into the output, ``SPLIT_BLOCK`` splits
    at a time (`merge.count_in_and_merge`; ``counter_ptr``: one zeroed int32 per (sequence,
    KV head), row-major).
    WRITE_STEP (DECODE, float pages): first store this step's key/value rows (``step_k`` /
    ``step_v`` [T, kv_heads, head_dim], at flat ``slot_ptr[t]``) into the pages, by the split
    holding the last position (`store_step_row`).
    HEADS, WINDOW: the exact rows of quantized storage (`key_loop.attend_key_range`,
    `key_loop.attend_exact_rows`; the reference rule is `attention.sdpa`'s): head rows, and with
    WINDOW > 0 each sequence's recent window (slot per sequence in ``seq_slots``, -1: none)
    plus this step's rows ``fresh_k`` / ``fresh_v`` [T, kv_heads, head_dim], all in the
    rotated space; every exact-row tensor has strides (``stride_er``, ``stride_eh``, 1).
    The exact window rows are attended in a second loop on the last split.
    DOT_PRECISION: "ieee" for float32 inputs (exact, like torch), "tf32" otherwise.
    PAGE_WINDOW > 0 (a power of two; BLOCK_N must divide PAGE_SIZE): the key loop loads the
    page ids of that many pages ahead of their tiles, so its tile loads pipeline
    (`key_loop.attend_key_windows`); 0: each tile loads its page ids."""
    block = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    num_splits = tl.num_programs(2)
    if DECODE:
        seq = block
        first = block * 0
    else:
        seq = tl.load(block_seq_ptr + block)
        first = tl.load(block_first_ptr + block)
    q_start = tl.load(query_start_ptr + seq)
    q_len = tl.load(query_start_ptr + seq + 1) - q_start
    ctx = tl.load(context_lens_ptr + seq)

    rows = tl.arange(0, BLOCK_M)
    token = first + rows // G_PAD
    head_in_group = rows % G_PAD
    row_valid = (token < q_len) & (head_in_group < G) & (rows < BLOCK_Q * G_PAD)
    head = kv_head * G + head_in_group
    position = ctx - q_len + token
    dims = tl.arange(0, HEAD_PAD)
    q_rows = (q_start + token).to(tl.int64) * stride_qt + head * stride_qh
    q = load_scaled_queries(q_ptr, q_rows, row_valid, dims, rot_ptr, scale_log2, K_BITS,
                            HEAD_DIM, BLOCK_M, HEAD_PAD)

    last_token = tl.minimum(first + BLOCK_Q, q_len)
    kv_end = ctx - q_len + last_token
    chunk = tl.cdiv(tl.cdiv(kv_end, num_splits), BLOCK_N) * BLOCK_N
    kv_lo = split * chunk
    kv_hi = tl.minimum(kv_lo + chunk, kv_end)
    table_row = page_table_ptr + seq.to(tl.int64) * stride_pt
    if WRITE_STEP:
        store_step_row(step_k_ptr, step_v_ptr, stride_skt, stride_skh, stride_svt, stride_svh,
                       slot_ptr, num_slots, q_start.to(tl.int64),
                       (kv_lo < kv_end) & (kv_end <= kv_hi), kv_head, dims, k_ptr, v_ptr,
                       stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh,
                       PAGE_SIZE, HEAD_DIM)
    step_start = ctx - q_len
    near_lo = step_start + first - WINDOW + 1
    if WINDOW > 0:
        seq_slot = tl.load(seq_slots_ptr + seq)
        ring_base = tl.where(seq_slot >= 0, seq_slot * WINDOW, -1)
    else:
        ring_base = ctx * 0 - 1
    m_i, l_i, acc = initial_state(BLOCK_M, HEAD_PAD)
    # Keys below near_lo are never read exactly: the bulk of the range runs without the
    # window's per-block work, the last block or two with it.
    if WINDOW > 0:
        window_lo = (tl.maximum(near_lo, 0) // BLOCK_N) * BLOCK_N
        bulk_hi = tl.minimum(kv_hi, tl.maximum(kv_lo, window_lo))
    else:
        bulk_hi = kv_hi
    m_i, l_i, acc = attend_keys(
        q, m_i, l_i, acc, table_row, kv_lo, bulk_hi, position, kv_head, dims,
        k_ptr, v_ptr, stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh,
        ks_ptr, vs_ptr, stride_ksp, stride_kss, stride_ksh, stride_vsp, stride_vss, stride_vsh,
        head_k_ptr, head_v_ptr, stride_er, stride_eh, ring_pos_ptr, ring_base, step_start,
        near_lo,
        BLOCK_M, BLOCK_N, HEAD_DIM, HEAD_PAD, PAGE_SIZE, K_BITS, V_BITS, HEADS, 0, DOT_PRECISION,
        PAGE_WINDOW)
    if WINDOW > 0:
        m_i, l_i, acc = attend_keys(
            q, m_i, l_i, acc, table_row, bulk_hi, kv_hi, position, kv_head, dims,
            k_ptr, v_ptr, stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh,
            ks_ptr, vs_ptr, stride_ksp, stride_kss, stride_ksh, stride_vsp, stride_vss,
            stride_vsh, head_k_ptr, head_v_ptr, stride_er, stride_eh, ring_pos_ptr, ring_base,
            step_start, near_lo,
            BLOCK_M, BLOCK_N, HEAD_DIM, HEAD_PAD, PAGE_SIZE, K_BITS, V_BITS, HEADS, WINDOW,
            DOT_PRECISION, PAGE_WINDOW)
    if WINDOW > 0:
        if split == num_splits - 1:
            m_i, l_i, acc = attend_exact_rows(
                q, m_i, l_i, acc, tl.maximum(near_lo, 0), kv_end, position, kv_head, dims,
                fresh_k_ptr, fresh_v_ptr, ring_k_ptr, ring_v_ptr, ring_pos_ptr, stride_er,
                stride_eh, ring_base, step_start, q_start, BLOCK_N, HEAD_DIM, WINDOW,
                DOT_PRECISION)
    acc = normalized_rows(acc, l_i, rot_ptr, V_BITS, BLOCK_M, HEAD_PAD)
    out_token = (q_start + token).to(tl.int64)
    if WRITE_PARTIALS:
        # Partials: [T, H, splits, HEAD_PAD] and log2-sum-exp [T, H, splits].
        part_row = (out_token * tl.num_programs(1) * G + head) * num_splits + split
        tl.store(part_out_ptr + part_row[:, None] * HEAD_PAD + dims[None, :], acc,
                 mask=row_valid[:, None])
        tl.store(part_lse_ptr + part_row, log2_sum_exp(m_i, l_i), mask=row_valid)
        if MERGE:
            # Splits past the last non-empty one hold no key; the window's exact rows are
            # attended by the last split, so then all are read.
            if WINDOW > 0:
                splits_read = num_splits
            else:
                splits_read = tl.cdiv(kv_end, tl.maximum(chunk, 1))
            count_in_and_merge(
                counter_ptr + seq * tl.num_programs(1) + kv_head, part_out_ptr, part_lse_ptr,
                out_ptr, q_start.to(tl.int64) * stride_ot, stride_oh,
                (q_start.to(tl.int64) * tl.num_programs(1) + kv_head) * G, kv_head * G,
                splits_read, num_splits, G, G_PAD, SPLIT_BLOCK, HEAD_DIM, HEAD_PAD)
    else:
        o_ptrs = out_ptr + (out_token * stride_ot + head * stride_oh)[:, None] + dims[None, :]
        tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty),
                 mask=row_valid[:, None] & (dims < HEAD_DIM)[None, :])


@triton.jit
def store_step_row(step_k_ptr, step_v_ptr, stride_skt, stride_skh, stride_svt, stride_svh,
                   slot_ptr, num_slots, token, holds, kv_head, dims, k_ptr, v_ptr, stride_kp,
                   stride_ks, stride_kh, stride_vp, stride_vs, stride_vh,
                   PAGE_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr):
    """When ``holds`` (this program's split holds the token's position), store token
    ``token``'s key and value rows of ``kv_head`` at its slot (converted to the pages' dtype;
    nothing for a slot outside [0, num_slots)); then a barrier, so this program's later loads
    of that row see the store."""
    slot = tl.load(slot_ptr + token).to(tl.int64)
    valid = holds & (slot >= 0) & (slot < num_slots)
    slot = tl.where(valid, slot, 0)  # even masked addresses stay inside the pages
    page = slot // PAGE_SIZE
    offset = slot % PAGE_SIZE
    mask = valid & (dims < HEAD_DIM)
    key = tl.load(step_k_ptr + token * stride_skt + kv_head * stride_skh + dims, mask=mask)
    value = tl.load(step_v_ptr + token * stride_svt + kv_head * stride_svh + dims, mask=mask)
    tl.store(k_ptr + page * stride_kp + offset * stride_ks + kv_head * stride_kh + dims,
             key.to(k_ptr.dtype.element_ty), mask=mask)
    tl.store(v_ptr + page * stride_vp + offset * stride_vs + kv_head * stride_vh + dims,
             value.to(v_ptr.dtype.element_ty), mask=mask)
    tl.debug_barrier()
