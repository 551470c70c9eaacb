"""Decode over 4- and 8-bit quantized pages with `triton_quant_kernels.quant_decode_kernel`.

`TritonPagedBackend` routes decode-only batches over q8/q4 pages here (`word_decode_fits`);
prefill and mixed batches, and q6 pages, keep `triton_kernels.paged_attention_kernel`. The
launch depends on the batch shape only (grid: sequences x KV heads x (splits + tail parts), the
tail parts per sequence and head attending the exact rows and the window's blocks), so it can be
captured in a CUDA graph.
Its splits are merged by a second kernel, or (``counters``) in the same launch, which saves a
kernel boundary per layer in a batch-1 CUDA-graph step (`triton_decode_merge`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch

from dyngen_core.kv.attention.base import ForwardBatch
from dyngen_core.kv.attention.triton.decode_merge import SplitCounters
from dyngen_core.kv.attention.triton.exact import ExactOperands
from dyngen_core.kv.attention.triton.kernels import launch_combine
from dyngen_core.kv.attention.triton.quant_kernels import quant_decode_kernel
from dyngen_core.kv.quant.storage import QuantStorage
from dyngen_core.kv.quant.write import StepQuantWrite
from dyngen_core.kv.storage import KVStorage

WORD_BITS = (4, 8)
# Tail parts the kernel splits its exact-row work into (`triton_quant_programs.tail_program`):
# more than 4 would only add empty programs (the window's keys span at most two blocks).
MAX_TAIL_PARTS = 4
# Registers a thread of the one-launch kernel with its tail in parts is held to by default: 3
# programs of 4 warps then share a multiprocessor's 64K (q4 64 x 4 with the backend's options,
# ptxas sm_90: 183 registers uncapped, 2 a multiprocessor, so batch 1's 8 x (32 + 3) programs
# overflow the 264 slots of 132 of them; at 168: no spills, 41 KB of shared memory).
PARTS_MAX_REGISTERS = 168
# tl.dot needs 16 along every dimension: 16 words of codes per tile at least.
MIN_TILE = 16


@dataclass(frozen=True)
class WordKernelFlags:
    """Code paths of `attend_word_decode` a backend turns on (the keywords of the same names
    there); ``join_values`` applies to 4-bit values only unless ``join_8bit_values``.

    Defaults: what measured fastest on an H200 at 16k context, batch 32. One layer
    (benchmarks/quant_decode.py, us): q4 1047 as before, 846 joined values, 804 with float16
    dots and the fast unpack too, 963 with wide scales as well; q8 1001 before, 980 with float16
    dots and the fast unpack, 2494 with wide scales. Whole decode step (benchmarks/
    long_context.py, ms): q4 41.3 -> 33.8; q8 39.7 -> 53.3 with joined values, so 8-bit values
    are not joined. Page ids loaded 4 pages ahead with scales read as rows (sixth session, one
    layer, us, batch 1 one launch / batch 32 two launches): q4 43.6 / 811.6 -> **28.6 / 448.9**
    (fp16 30.2 / 499.5), q8 57.4 / 987.7 -> 44.2 / 661.1 (two launches at batch 1); a window
    of 8 pages measured the same, 4 stages slower at batch 32 (476.2), so ``stages`` stays
    Triton's default. ``tail_parts`` None: the tail's three phases run as three programs in
    the two-launch form when the cache has a recent window (H200, 16k, one layer, q4 batch 4:
    110.0 -> 95.9 us), one program in the one-launch form (batch 1: 28.2 us with one, 31.5
    with three parts; whole runner step 5.602 vs 5.635 ms); ``max_registers`` None holds a
    one-launch kernel with its tail in parts to 3 programs a multiprocessor.
    ``merge_in_kernel``: merge the splits in the attention kernel (`attend_word_decode`'s
    ``counters``) where the backend merges fp16 decodes in theirs; off, as it measured slower
    than the second kernel (H200, 16k, one layer, us, batch 1 / 4: 27.3 / 100.0 with
    `combine_splits_kernel`, 29.3 / 103.9 merged in the kernel).
    ``lazy_sum``, ``paired_values``, ``swapped_values``, ``small_tail_rows``: fewer
    shared-memory round trips and bank conflicts in the key loop and a smaller one-launch
    kernel (`attend_word_decode`); all on, as they measured fastest at every batch (H200,
    16k, one layer, us, batch 1 / 4 / 32: q4 26.6 / 95.6 / 511.0 off, 24.9 / 85.5 / 420.9 on;
    fp16 28.1 / 80.7 / 495.9; q8, whose values are not joined so only lazy_sum and
    small_tail_rows act, 34.4 / 112.1 / 662.5 off, 33.1 / 108.2 / 621.2 on).
    ``write_step``: with a recent window, the kernel does the storage's write of a decode
    step's rows (`attend_word_decode`'s ``write``, the backend's ``write_in_kernel``) and the
    layer runs no write launch: on, as it measured faster (H200, Llama-3-8B shape at 16k, ms a
    q4 step, batch 1 / 32: 5.309 / 18.74 with the write launch, 5.207 / 18.25 without).
    ``merge_rows``: query rows x partials per load round of the in-kernel merge.
    """

    join_keys: bool = False
    join_values: bool = True
    join_8bit_values: bool = False
    half_dot: bool = True
    fast_unpack: bool = True
    wide_scales: bool = False
    page_window: int = 4
    scale_rows: bool = True
    stages: int | None = None
    tail_parts: int | None = None
    max_registers: int | None = None
    merge_in_kernel: bool = False
    lazy_sum: bool = True
    paired_values: bool = True
    swapped_values: bool = True
    small_tail_rows: bool = True
    write_step: bool = True
    merge_rows: int = 64

    def keywords(self, value_bits: int) -> dict[str, Any]:
        """The flags as `attend_word_decode` keywords for pages of ``value_bits``-bit values
        (``merge_in_kernel`` and ``write_step`` are the backend's to apply: it passes the
        counters and the write)."""
        flags = asdict(self)
        flags.pop("merge_in_kernel")
        flags.pop("write_step")
        join_8bit = flags.pop("join_8bit_values")
        flags["join_values"] = self.join_values and (value_bits == 4 or join_8bit)
        return flags


def word_decode_fits(batch: ForwardBatch, key_bits: int, value_bits: int,
                     exact: ExactOperands | None, block_n: int) -> bool:
    """Whether `attend_word_decode` serves this attention call: a decode-only batch over q8/q4
    pages (with their exact rows), whose pages hold whole blocks of ``block_n`` keys."""
    return (batch.is_decode_only and exact is not None
            and word_pages_fit(key_bits, value_bits, block_n, batch.page_size))


def word_pages_fit(key_bits: int, value_bits: int, block_n: int, page_size: int) -> bool:
    """Whether the kernel reads these pages: q8/q4 codes, whole blocks of ``block_n`` (at
    least `MIN_TILE`) keys a page."""
    return (key_bits in WORD_BITS and value_bits in WORD_BITS and block_n >= MIN_TILE
            and page_size % block_n == 0)


def deferred_word_write(storage: KVStorage, layer: int, key: torch.Tensor,
                        value: torch.Tensor, batch: ForwardBatch,
                        block_n: int | None) -> StepQuantWrite | None:
    """The storage's write of this step's ``key``/``value`` rows, left to `attend_word_decode`
    (its ``write``), where the batch will take that kernel with a recent window: a
    decode-only batch with sequence slots over q8/q4 pages whose storage keeps a window and
    writes with Triton (`QuantStorage.deferred_write`). The storage then counts the rows as
    written. None (nothing done) elsewhere: the caller writes through the storage."""
    if (block_n is None or not isinstance(storage, QuantStorage) or not batch.is_decode_only
            or batch.seq_slots is None or storage.recent is None):
        return None
    if not word_pages_fit(storage.key_format.bits, storage.value_format.bits, block_n,
                          batch.page_size):
        return None  # `word_decode_fits` sends the batch elsewhere
    return storage.deferred_write(layer, key, value, batch.slot_mapping, batch.decode_window)


def word_dim_pad(head_dim: int, key_bits: int, value_bits: int) -> int:
    """Columns the kernel works on: a power of two >= head_dim, with >= 16 words per row."""
    return max(1 << (head_dim - 1).bit_length(), MIN_TILE * 32 // min(key_bits, value_bits))


def check_scale_rows(page_args: tuple[Any, ...], groups: int) -> None:
    """Raise ValueError unless the scales (`triton_page_operands.page_arguments`: tensors at
    8 and 9, strides at 10 to 15) put every row of ``groups`` scales at a multiple of
    ``groups`` elements, as the kernel's scale_rows path tells Triton (for one vector copy a
    row)."""
    tensors, strides = page_args[8:10], page_args[10:16]
    aligned = (all(int(stride) % groups == 0 for stride in strides)
               and all(t.data_ptr() % (2 * groups) == 0 for t in tensors))
    if not aligned:
        raise ValueError(f"scale_rows needs scale rows aligned to {groups} scales (strides "
                         f"{tuple(strides)}); pass scale_rows=False for this layout")


def attend_word_decode(q: torch.Tensor, page_args: tuple[object, ...], batch: ForwardBatch,
                       exact: ExactOperands, scale_log2: float, *, key_bits: int,
                       value_bits: int, num_kv_heads: int, block_n: int, splits: int,
                       warps: int, launches: int = 1, join_keys: bool = False,
                       join_values: bool = False, half_dot: bool = False,
                       fast_unpack: bool = False, wide_scales: bool = False,
                       page_window: int = 0, scale_rows: bool = False,
                       stages: int | None = None, counters: torch.Tensor | None = None,
                       merge_rows: int = 64, tail_parts: int | None = None,
                       max_registers: int | None = None, lazy_sum: bool = False,
                       paired_values: bool = False, swapped_values: bool = False,
                       small_tail_rows: bool = False,
                       write: StepQuantWrite | None = None) -> torch.Tensor:
    """Attention of the decode queries q [B, H, D] over their q8/q4 pages and exact rows.

    page_args: `triton_page_operands.page_arguments` of the layer (codes as int32 words, scales,
        strides, rotation).
    scale_log2: softmax scale times log2(e).
    block_n: keys per loop step (divides the page size); splits: parts the keys before the
        window are split into (from the batch shape only, for CUDA graphs); warps: per program.
    launches: 1 runs the page programs and the tail programs in one grid, 2 in two launches
        (each kernel then holds only its own code's registers).
    join_keys, join_values: dequantize a block's keys / values to whole rows for one dot,
        instead of one dot per code field. Joined values give one [rows, head_dim] dot that
        Triton spreads over the warps (per field, a [16, 16] q4 dot ran on every warp: 4x the
        HMMA, 252 registers a thread at 64 keys x 4 warps against 128 joined; ptxas, sm_90).
        Joined keys cost more shared-memory stores than they save (kept for measurements).
    half_dot: the page blocks' dots in float16 for bfloat16 queries too, so 8-bit codes also
        take the exponent trick in halves instead of float32 (the exact rows keep the query's
        dtype). Dequantized rows must stay within float16 range, as their scales already do.
    fast_unpack: where the dots run in float16 (float16 queries, or half_dot), unpack two
        codes per instruction in inline PTX (`triton_quant_unpack`; CUDA only, not the Triton
        interpreter): q4 64x4 loop 1,103 -> 900 instructions a thread with joined values.
    wide_scales: load the scales as int32 pairs (head_dim a multiple of 64; ignored otherwise),
        which Triton pipelines with the code words (cp.async) instead of a synchronous 2-byte
        gather per loop step; costs registers (q4 64x4 joined, fast: 128 -> 141).
    page_window: 0 loads each block's page id inside the key loop (that load feeds the block's
        addresses, so Triton's pipeliner waits for every copy in flight each step: one
        memory round trip a block); a power of two loads that many page ids as one vector
        before the loop over their blocks, so the next blocks' code words stay in flight
        while a block is computed (sm_90 TTGIR: ``async_wait {num = 0}`` becomes
        ``num > 0``). The page programs only; the tail's one or two blocks keep the load.
    scale_rows: load each key's row of scales (contiguous: 8 bytes at head_dim 128, one
        cp.async that pipelines like the code words) and widen it to the columns in registers
        (joins), instead of a gather per column (synchronous at 2 bytes; one 4-byte copy per
        element with wide_scales, which it overrides).
    stages: software-pipelining stages of the key loop (None: Triton's default, 3); with
        page_window 0 the per-block page id load makes extra stages useless. With launches=2
        the tail launch keeps the default. Each stage holds one more block of code words
        (and scale rows) in shared memory: at 64 keys x 4 warps, 4 stages take 168
        registers a thread instead of 128 (ptxas, sm_90), 3 programs a multiprocessor.
    counters: None merges the splits + tail_parts partials in a second kernel
        (`combine_splits_kernel`); else at least batch.num_seqs x num_kv_heads zeroed int32
        counters (`triton_decode_merge.SplitCounters.for_launch`, left zeroed), and the
        program of each sequence and KV head that finishes last merges them in the attention
        kernel (with two launches: the last tail part, the tail launch counting in after every
        page program): one kernel launch less (that launch: 2.8 us a layer at batch 1,
        H200). Launches sharing counters must not run concurrently (one stream).
    merge_rows: query rows x partials per load round of that in-kernel merge.
    tail_parts: programs per sequence and KV head that attend what the page programs leave
        (`triton_quant_programs.tail_program`): (a) the last one or two blocks under the
        window rule, (b) every page's head row, (c) the window's and the step's exact rows.
        1: one program runs (a), (b), (c) one after the other (each phase waits on its own
        loads); 2: (a) and (b)+(c) side by side; 3: one program each; 4: (a)'s blocks in two
        programs too. Each writes its own partial. None: 3 when ``exact`` carries a recent
        window and the tail has a launch of its own (launches=2), else 1 (without a window
        (a) and (c) are empty; in one launch the parts measured no faster, see
        `WordKernelFlags`). The parts attend the window's rows in 16-row tiles where the
        window has at most 16 positions (the single tail in key blocks, as before).
    max_registers: registers a thread of the one-launch kernel (launches=1) may use (ptxas's
        maxnreg), so that more of its programs share a multiprocessor; two launches are
        never capped. None: `PARTS_MAX_REGISTERS` (3 programs a multiprocessor) with warps 4
        and the tail in parts, else no cap; 0: no cap.
    lazy_sum: the key loop keeps a [rows, block_n] tile of running softmax sums and reduces
        it once after the loop, instead of a row sum per block: with 16 query rows Triton
        spreads the 4 warps over the keys, so each row sum crossed the warps through shared
        memory (q4 64 x 4 page loop, ptxas sm_90, per block: bar.sync 8 -> 5, shared stores
        and loads of 32 bits 6 + 6 -> 3 + 3, shuffles 16 -> 10; 8 more registers a thread).
    paired_values: with joined values, join each word's fields in the order the inline-PTX
        unpack pairs them in 32-bit registers ((0, 4), (1, 5), ...) instead of dim order, so
        the dequantized tile is stored for its dot without byte permutes (PRMT 64 -> 32 a
        block); the accumulator's columns are put back in dim order once after the loop.
    swapped_values: with joined values, swap the 2nd and 3rd quarters of the value tile's
        columns (and back in the accumulator after the loop): at head_dim 128 in 4 warps the
        two threads of a row then store their 16-byte pieces to different banks of Triton's
        swizzled layout; in dim order the tile's 8 stores a block were 2-way bank conflicts.
    small_tail_rows: the single tail (tail_parts 1) reads the recent window in the parts'
        16-row tiles (a window of at most 16 positions): the one-launch q4 kernel then needs
        41 KB of shared memory instead of 88 (with lazy_sum and paired_values: 168 registers
        instead of 204 and no spills), so 3 programs share a multiprocessor (4 at
        max_registers 128, which spills 32 bytes a thread outside the page loop), and a
        batch-1 grid of 8 x (48 + 1) (or 8 x (64 + 1)) programs is one wave.
    write: the storage's write of this step's rows, left to this launch
        (`QuantStorage.deferred_write`; one token per sequence, a recent window): the tail
        program of each (sequence, KV head) that reads the window's rows stores its head's
        codes, scales, head row, window row and fresh exact rows first, so the layer runs no
        write launch of its own (the fp16 storage's step write does the same in its kernel,
        `triton_step_write`). ``exact`` must then name the write's exact rows as its fresh
        rows. None: the storage wrote them before this call.
    """
    if launches not in (1, 2):
        raise ValueError(f"launches must be 1 or 2, not {launches}")
    if counters is not None and counters.numel() < batch.num_seqs * num_kv_heads:
        raise ValueError(f"counters hold {counters.numel()} int32, fewer than the "
                         f"{batch.num_seqs * num_kv_heads} (sequence, KV head) pairs; take "
                         f"them from SplitCounters.for_launch")
    if page_window < 0 or page_window & (page_window - 1):
        raise ValueError(f"page_window must be 0 (off) or a power of two, not {page_window}")
    if tail_parts is None:
        tail_parts = 3 if exact.window > 0 and launches == 2 else 1
    if not 1 <= tail_parts <= MAX_TAIL_PARTS:
        raise ValueError(f"tail_parts must be 1 to {MAX_TAIL_PARTS} (or None: 3 with a "
                         f"recent window in two launches, else 1), not {tail_parts}")
    if q.shape[0] != batch.num_seqs:
        raise ValueError(f"a decode batch has one query row per sequence: {q.shape[0]} rows "
                         f"for {batch.num_seqs} sequences (word_decode_fits tells which "
                         f"batches this kernel serves)")
    cap = _register_cap(max_registers, tail_parts, warps)
    write_args, write_shape = _write_operands(write, exact, q)
    tokens, num_heads, head_dim = q.shape
    group = num_heads // num_kv_heads
    dim_pad = word_dim_pad(head_dim, key_bits, value_bits)
    if scale_rows and dim_pad == head_dim:
        check_scale_rows(page_args, head_dim // 32)
    partials = splits + tail_parts
    parts = torch.empty(tokens, num_heads, partials, dim_pad, dtype=torch.float32,
                        device=q.device)
    lse = torch.empty(tokens, num_heads, partials, dtype=torch.float32, device=q.device)
    out = torch.empty_like(q)
    arguments = (q, q.stride(0), q.stride(1), *page_args,
                 batch.page_table, batch.page_table.stride(0), batch.context_lens,
                 *exact.arguments(), parts, lse, out, out.stride(0),
                 out.stride(1), counters if counters is not None else batch.context_lens,
                 scale_log2, *write_args)
    group_pad = 1 << (group - 1).bit_length()
    shape = {"G": group, "BLOCK_M": max(16, group_pad), "BLOCK_N": block_n,
             "HEAD_DIM": head_dim, "DIM_PAD": dim_pad, "PAGE_SIZE": batch.page_size,
             "K_BITS": key_bits, "V_BITS": value_bits, "NUM_SPLITS": splits,
             "WINDOW": exact.window,
             "DOT_PRECISION": "ieee" if q.dtype == torch.float32 else "tf32",
             "K_JOIN": join_keys, "V_JOIN": join_values, "HALF_DOT": half_dot,
             "FAST_UNPACK": fast_unpack and q.is_cuda,  # inline PTX: not in the interpreter
             "WIDE_SCALES": wide_scales, "PAGE_WINDOW": page_window, "SCALE_ROWS": scale_rows,
             "MERGE": counters is not None, "G_PAD": group_pad,
             "SPLIT_BLOCK": min(_pow2(partials), max(1, merge_rows // group_pad)),
             "TAIL_PARTS": tail_parts,
             "LOOP_FLAGS": (int(lazy_sum) + 2 * int(paired_values) + 4 * int(small_tail_rows)
                            + 8 * int(swapped_values)),
             **write_shape}
    grids = ([(partials, 0)] if launches == 1 else [(splits, 1), (tail_parts, 2)])
    tuning: dict[str, Any] = {"num_warps": warps}
    if stages is not None:
        tuning["num_stages"] = stages
    if launches == 1 and cap:
        tuning["maxnreg"] = cap
    for programs, role in grids:
        # The tail alone (one or two blocks) ignores PAGE_WINDOW and keeps Triton's default
        # stages: one compile of it serves every window and depth.
        quant_decode_kernel[(batch.num_seqs, num_kv_heads, programs)](
            *arguments, **(shape | {"PAGE_WINDOW": 0} if role == 2 else shape),
            PROGRAMS=role,
            **({"num_warps": warps} if role == 2 else tuning))
    if counters is not None:
        return out
    launch_combine(parts, lse, out, partials, head_dim, dim_pad)
    return out


def _write_operands(write: StepQuantWrite | None, exact: ExactOperands, q: torch.Tensor
                    ) -> tuple[tuple[object, ...], dict[str, Any]]:
    """`quant_decode_kernel`'s ``w_*`` arguments and W_* constexprs for ``write`` (None:
    placeholders it never reads)."""
    if write is None:
        return (q,) * 5 + (0,) * 4 + (q,) * 6 + (0, 0) + (q,) * 4 + (0, 0), {}
    shape = write.constants
    if exact.window == 0 or exact.window != shape["WINDOW"] or shape["HEAD_BLOCK"] != 1:
        raise ValueError("a write left to the decode kernel needs a recent window (the same "
                         "as the exact rows') and one KV head a program: take it from "
                         "QuantStorage.deferred_write")
    if exact.fresh_keys.data_ptr() != write.exact[0].data_ptr():
        raise ValueError("the exact operands' fresh rows must be the write's exact rows: "
                         "build them after QuantStorage.deferred_write")
    return (*write.arguments(), write.num_tokens), {
        "WRITE_STEP": True, "W_HEADS": shape["HEADS"], "W_HAS_OFFSETS": shape["HAS_OFFSETS"],
        "W_ROWS": shape["ROWS"], "W_INV_SQRT": shape["INV_SQRT"]}


def _register_cap(max_registers: int | None, tail_parts: int, warps: int) -> int | None:
    """`attend_word_decode`'s register cap of a one-launch kernel (its ``max_registers``
    rule); None: no cap."""
    if max_registers is None:
        return PARTS_MAX_REGISTERS if tail_parts > 1 and warps == 4 else None
    if max_registers < 0:
        raise ValueError(f"max_registers must be 0 (no cap), None or positive, not "
                         f"{max_registers}")
    return max_registers or None


def _pow2(count: int) -> int:
    """The smallest power of two >= ``count`` (>= 1)."""
    return 1 << (max(1, count) - 1).bit_length()


def word_counters(counters: SplitCounters, batch: ForwardBatch, num_kv_heads: int,
                  device: torch.device, merge: bool, max_seqs: int) -> torch.Tensor | None:
    """The ``counters`` argument of `attend_word_decode` under `TritonPagedBackend`'s rule
    (its ``merge_in_kernel`` as ``merge``, ``in_kernel_max_seqs`` as ``max_seqs``): counters
    from ``counters`` for batches of at most ``max_seqs`` sequences, else None. Unlike the
    general kernel's rule it needs no split count above 1: the tail always adds a partial
    to merge."""
    if not merge or batch.num_seqs > max_seqs:
        return None
    return counters.for_launch(device, batch.num_seqs * num_kv_heads)
