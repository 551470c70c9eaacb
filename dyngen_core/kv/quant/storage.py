"""Quantized KV storage: the "q8", "q6" and "q4" cache modes.

Per layer, on that layer's device, four tensors indexed by page (format in `format`):

    key_codes, value_codes    [num_pages, page_size, num_kv_heads, packed_bytes]  int8 / uint8
    key_scales, value_scales  [num_pages, page_size, num_kv_heads, head_dim / 32] float16

each a view of memory laid out head-major, [num_pages, num_kv_heads, page_size, ...]: the rows
of one page and KV head are contiguous, so a kernel reading a block of keys of one head reads
one run of bytes (64 keys of q4 codes: 4 KB, their scales 512 bytes) instead of pieces strided
by every head's row. Kernels take the views' strides; writers index them by (page, slot).

Rows are quantized as they are written (`write`) and dequantized only for the pages a step
references (`gather`, the torch codec of `format`). Bits per mode (keys, values): q8 = (8, 8),
q6 = (6, 6), q4 = (4, 4) (why 6/6 rather than 8/4 for q6: BENCHMARKS.md, section 8).

Two kinds of rows are kept unquantized beside the pages, because a query leans hardest on them:
the first slot of every page (``key_heads`` / ``value_heads`` [num_pages + 1, kv_heads,
head_dim], the halves of one ``head_rows`` tensor; slot 0 of a sequence's first page is its
first token, the "attention sink" most heads attend to) and, once `reserve_sequences` has made
room, the most recent positions of each running sequence it gave a slot (`window.RecentWindow`;
at most one sequence per page, within the bytes of an unquantized storage). Both hold
`exact_rows`: the compute dtype, rotated like the codes, so a kernel attending in the rotated
space reads them as they are. `gather` returns the page heads (un-rotated) in place of their
quantized rows; readers take the recent rows from `gather_recent`.

Per layer and step, the exact rows are made once by `write` and reused by the calls after it
(`StepMemo`). On CUDA with triton, `write` is one Triton launch (`write.launch_quant_write`),
which stores a decode-only step's window rows as well; other steps' windows take one more
launch in `write_recent`. Elsewhere the torch twin writes (`write.write_pages_torch`).

Key offsets (`set_key_offsets`): when set, a fixed vector per (layer, kv head) is subtracted
from every key before it is quantized and never added back: attention scores of a query all move
by the same amount, which softmax ignores, so outputs are unchanged while the quantized rows no
longer spend their range on what all keys share. `Cache` sets them (`cache.measure_key_means`).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

import torch

from dyngen_core.config import ModelConfig
from dyngen_core.engine.plan import PageCopy
from dyngen_core.kv.quant.format import (
    GROUP_SIZE,
    QuantFormat,
    check_head_dim,
    dequantize,
    hadamard_matrix,
    rotation_signs,
    unrotate,
)
from dyngen_core.kv.quant.window import RecentWindow, WindowIndex, row_nbytes
from dyngen_core.kv.quant.write import (
    DecodeWindowWrite,
    ExactStepRows,
    StepQuantWrite,
    decode_window_write,
    head_index,
    launch_quant_write,
    offset_keys,
    prepare_rows,
    resolve_triton_write,
    step_quant_write,
    write_heads_torch,
    write_pages_torch,
    write_window_triton,
)
from dyngen_core.kv.storage import PageMoves, copy_page_slots, resolve_copies

MODE_BITS: dict[str, tuple[int, int]] = {"q8": (8, 8), "q6": (6, 6), "q4": (4, 4)}
# q8 is close enough to exact (next-token KL 4e-5 on the demo model) that a window would buy
# nothing for its cost: memory, outputs that depend on whether a prefix came from the cache,
# and speculative decoding, which needs a target cache without a window.
DEFAULT_RECENT_WINDOW = {"q8": 0, "q6": 16, "q4": 16}
Result = TypeVar("Result")


@dataclass
class QuantLayer:
    """The page tensors of one layer (what a kernel reading quantized pages directly needs)."""

    key_codes: torch.Tensor
    key_scales: torch.Tensor
    value_codes: torch.Tensor
    value_scales: torch.Tensor
    head_rows: torch.Tensor  # [2, num_pages + 1, kv_heads, head_dim]: key heads, value heads

    @property
    def key_heads(self) -> torch.Tensor:
        """The unquantized first key row of every page, [num_pages + 1, kv_heads, head_dim]."""
        return self.head_rows[0]

    @property
    def value_heads(self) -> torch.Tensor:
        """The unquantized first value row of every page, like `key_heads`."""
        return self.head_rows[1]

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The [num_pages, page_size, ...] views (what page copies move slot by slot)."""
        return (self.key_codes, self.key_scales, self.value_codes, self.value_scales)

    def heads(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The unquantized first rows of every page, [num_pages + 1, kv_heads, head_dim]."""
        return (self.key_heads, self.value_heads)


class QuantStorage:
    """Paged, quantized key/value storage for every layer of one model (a `KVStorage`).

    Args:
        config: the model's shape (num_layers, num_kv_heads, head_dim; head_dim must be a
            multiple of 32).
        num_pages: pages per layer.
        page_size: slots per page.
        dtype: the compute dtype `gather` returns (the model dtype).
        layer_devices: the device of each layer, ``config.num_layers`` entries.
        mode: "q8", "q6" or "q4".
        bits: (key bits, value bits) overriding the mode's default pair; for measurements.
        recent_window: positions of each running sequence kept unquantized once
            `reserve_sequences` has been called (0: none), for as many sequences as
            `window_capacity` allows. Default: 16 for q6 and q4, 0 for q8
            (`DEFAULT_RECENT_WINDOW`).
        triton_write: write a layer's rows in one Triton launch (`write.quant_write_kernel`)
            instead of the torch twin. None: on CUDA layers with triton installed; True:
            every layer (ValueError where it cannot run: no triton, or the CPU without
            ``TRITON_INTERPRET=1``); False: never.
    """

    def __init__(self, config: ModelConfig, num_pages: int, page_size: int, dtype: torch.dtype,
                 layer_devices: Sequence[torch.device | str], mode: str = "q4", *,
                 bits: tuple[int, int] | None = None,
                 recent_window: int | None = None, triton_write: bool | None = None) -> None:
        if mode not in MODE_BITS:
            raise ValueError(f"quantized cache mode {mode!r} is unknown; use one of "
                             f"{tuple(MODE_BITS)} (or 'fp16' for the unquantized storage)")
        if len(layer_devices) != config.num_layers:
            raise ValueError(f"layer_devices has {len(layer_devices)} entries; the model has "
                             f"{config.num_layers} layers")
        check_head_dim(config.head_dim)
        self.mode = mode
        self.page_size = page_size
        self.num_pages = num_pages
        self.dtype = dtype
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        key_bits, value_bits = bits or MODE_BITS[mode]
        self.key_format = QuantFormat(key_bits)
        self.value_format = QuantFormat(value_bits)
        self.devices = [torch.device(d) for d in layer_devices]
        self.layers = [self._allocate(device) for device in self.devices]
        # The Triton write takes the sign pattern (it runs the butterfly); torch the matrix.
        self._signs = {d: rotation_signs(GROUP_SIZE).to(d) for d in set(self.devices)}
        self._rotation = {d: hadamard_matrix(GROUP_SIZE).to(d) for d in set(self.devices)}
        self._triton = [resolve_triton_write(triton_write, d) for d in self.devices]
        self.key_offsets: list[torch.Tensor] | None = None
        self._memo = StepMemo()
        self.recent: RecentWindow | None = None
        self.recent_window = 0
        self.set_recent_window(recent_window)

    def set_recent_window(self, window: int | None) -> None:
        """Keep each running sequence's last ``window`` positions unquantized (None: the
        mode's default; 0: none). Drops windows already reserved: call `reserve_sequences`
        again (the runner does at construction)."""
        if window is None:
            window = DEFAULT_RECENT_WINDOW[self.mode]
        if window < 0:
            raise ValueError(f"recent_window must be >= 0 (0 turns the window off), not {window}")
        self.recent_window = window
        self.recent = None

    def reserve_sequences(self, count: int) -> int:
        """Make room for the recent-token windows of up to ``count`` sequences at once, at
        most `window_capacity`, and return how many (sequence slots 0 .. n - 1; a reader's
        other slots keep no window); earlier windows are dropped. 0, and nothing kept, when
        ``recent_window`` is 0 or no window fits."""
        slots = min(count, self.window_capacity())
        if slots <= 0:
            self.recent = None
            return 0
        self.recent = RecentWindow(self.recent_window, slots, self.num_kv_heads, self.head_dim,
                                   self.dtype, self.devices)
        return slots

    def window_capacity(self) -> int:
        """The most sequences `reserve_sequences` keeps windows for: one per page, since every
        sequence of a step writes into a page of its own (no more can run at once), and no more
        than fit in the bytes an unquantized storage of the same pages holds beyond these
        pages (`unquantized_nbytes`), so that no quantized storage outgrows the unquantized
        one. 0 when ``recent_window`` is 0."""
        if self.recent_window == 0:
            return 0
        spare = (self.unquantized_nbytes() - self.page_nbytes()) // len(self.layers)
        rows = spare // row_nbytes(self.num_kv_heads, self.head_dim, self.dtype) - 1  # - spare
        return max(0, min(self.num_pages, rows // self.recent_window))

    def clear_sequences(self, seq_slots: Sequence[int]) -> None:
        """Forget the recent rows of ``seq_slots`` (handed to new sequences)."""
        if self.recent is not None:
            self.recent.clear(seq_slots)

    def set_key_offsets(self, offsets: Sequence[torch.Tensor] | None) -> None:
        """Subtract ``offsets[layer]`` (``[num_kv_heads, head_dim]``) from every key written to
        ``layer`` from now on (None: subtract nothing). Set it before the first write: keys
        already stored keep the offsets they were written with, and a query must see one offset
        across all keys it attends to."""
        self._memo.clear()
        if offsets is None:
            self.key_offsets = None
            return
        shape = (self.num_kv_heads, self.head_dim)
        if len(offsets) != len(self.layers) or any(tuple(o.shape) != shape for o in offsets):
            raise ValueError(f"key offsets must be one {list(shape)} tensor per layer "
                             f"({len(self.layers)} layers)")
        self.key_offsets = [o.to(device=d, dtype=torch.float32)
                            for o, d in zip(offsets, self.devices, strict=True)]

    def _allocate(self, device: torch.device) -> QuantLayer:
        head_major = (self.num_pages, self.num_kv_heads, self.page_size)
        groups = self.head_dim // GROUP_SIZE

        def page_rows(width: int, dtype: torch.dtype) -> torch.Tensor:
            rows = torch.zeros((*head_major, width), dtype=dtype, device=device)
            return rows.permute(0, 2, 1, 3)  # indexed [page, slot, head, ...] (module docstring)

        def codes(fmt: QuantFormat) -> torch.Tensor:
            return page_rows(fmt.packed_bytes(self.head_dim), fmt.code_dtype)

        def scales() -> torch.Tensor:
            return page_rows(groups, torch.float16)

        heads = torch.zeros((2, self.num_pages + 1, self.num_kv_heads, self.head_dim),
                            dtype=self.dtype, device=device)
        return QuantLayer(codes(self.key_format), scales(), codes(self.value_format), scales(),
                          heads)

    def write(self, layer: int, key: torch.Tensor, value: torch.Tensor,
              slot_mapping: torch.Tensor, *,
              decode_window: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        """Quantize key/value rows [T, num_kv_heads, head_dim] and store them at the flat
        slots ``slot_mapping`` [T] (page * page_size + offset); rows landing on slot 0 of a
        page also become that page's exact head row. Values are taken in the keys' dtype (the
        model gives both in its own). ``decode_window``: (positions, sequence slots) [T] of a
        decode-only step (one token per sequence, never a prefill chunk): with a reserved
        window, the rows enter the windows now and the `write_recent` of these tensors after it
        does nothing (a decode query reads no window row its step replaces)."""
        device, pages = self.devices[layer], self.layers[layer]
        fold = self._decode_fold(layer, decode_window)
        if self._triton[layer]:
            write = self._step_write(layer, key, value, slot_mapping, fold)
            launch_quant_write(write)
            self._memo.keep_rows(layer, key, value, ExactStepRows(exact=write.exact))
        else:
            rows = self._prepare_rows(layer, key, value)
            self._memo.keep_rows(layer, key, value, rows)
            assert rows.rotated is not None
            write_pages_torch(pages.tensors(), (self.key_format, self.value_format),
                              rows.rotated, slot_mapping)
            index = self._memo.index("heads", layer, device, (slot_mapping,),
                                     lambda: head_index(slot_mapping, self.page_size,
                                                        self.num_pages, device))
            write_heads_torch(pages.head_rows, index, rows.exact)
        if fold is not None and decode_window is not None:
            if not self._triton[layer]:  # its general rule gives the decode rule's rows
                self.write_recent(layer, key, value, *decode_window)
            self._memo.keep_window(layer, (key, value, *decode_window))

    def deferred_write(self, layer: int, key: torch.Tensor, value: torch.Tensor,
                       slot_mapping: torch.Tensor,
                       decode_window: tuple[torch.Tensor, torch.Tensor] | None
                       ) -> StepQuantWrite | None:
        """`write`'s operands for a decode kernel to write with, in a decode-only step (one
        token per sequence; ``decode_window``: its positions and sequence slots, or None) on a
        layer with the Triton write. With a reserved window the write also stores the window
        rows, and needs ``decode_window``. Nothing runs: the rows count as written
        (`exact_rows`, `write_recent`), so that kernel must run before anything reads the
        layer. None (nothing done) where it does not apply: `write`."""
        fold = self._decode_fold(layer, decode_window)
        if not self._triton[layer] or (self.recent is not None and fold is None):
            return None
        write = self._step_write(layer, key, value, slot_mapping, fold)
        self._memo.keep_rows(layer, key, value, ExactStepRows(exact=write.exact))
        if fold is not None and decode_window is not None:
            self._memo.keep_window(layer, (key, value, *decode_window))
        return write

    def _decode_fold(self, layer: int, decode_window: tuple[torch.Tensor, torch.Tensor] | None
                     ) -> DecodeWindowWrite | None:
        """The window write `write` does in its launch: a decode-only step's, with a reserved
        window; else None."""
        return decode_window_write(self.recent, layer, self.devices[layer], decode_window)

    def _step_write(self, layer: int, key: torch.Tensor, value: torch.Tensor,
                    slot_mapping: torch.Tensor,
                    fold: DecodeWindowWrite | None) -> StepQuantWrite:
        """The Triton write's operands for these rows of ``layer``, nothing launched."""
        device, pages = self.devices[layer], self.layers[layer]
        offsets = self.key_offsets[layer] if self.key_offsets is not None else None
        return step_quant_write(key, value, slot_mapping.to(device), offsets,
                                self._signs[device], pages.tensors(),
                                (self.key_format.bits, self.value_format.bits),
                                pages.head_rows, self.dtype, fold)

    def write_recent(self, layer: int, key: torch.Tensor, value: torch.Tensor,
                     positions: torch.Tensor, seq_slots: torch.Tensor) -> None:
        """Put the step's rows [T, num_kv_heads, head_dim] into their sequences' recent windows
        (``positions``, ``seq_slots``: [T], -1 for no slot). Call it after the layer's
        attention: a prefill chunk's rows would otherwise replace window rows of earlier
        positions its first queries still read. No-op without `reserve_sequences`, and for
        the very tensors the last `write` was given as its (folded) ``decode_window``."""
        recent = self.recent
        if recent is None or self._memo.window_kept(layer, (key, value, positions, seq_slots)):
            return
        if self._triton[layer]:
            target = recent.layers[layer]
            write_window_triton(self.step_rows(layer, key, value).exact, positions, seq_slots,
                                target.rows, target.positions, recent.window)
            return
        device = self.devices[layer]
        index: WindowIndex = self._memo.index(
            "window", layer, device, (positions, seq_slots),
            lambda: recent.index(positions, seq_slots, device))
        recent.write_rows(layer, self.step_rows(layer, key, value).exact, index)

    def exact_rows(self, layer: int, key: torch.Tensor,
                   value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Key/value rows [T, num_kv_heads, head_dim] in the form the exact rows (page heads,
        recent windows) are stored: keys minus the key offsets, both rotated like the codes
        (`format.rotate`), in the compute dtype; contiguous. A kernel attending in the
        rotated space reads them as they are."""
        exact = self.step_rows(layer, key, value).exact
        return exact[0], exact[1]

    def stored_keys(self, layer: int, key: torch.Tensor) -> torch.Tensor:
        """Keys [T, num_kv_heads, head_dim] as this storage holds them: minus the layer's key
        offsets (what a reader mixing the step's own keys with stored ones must use)."""
        if self.key_offsets is None:
            return key
        rows = self._memo.rows(layer, key)
        if rows is not None and rows.stored is not None:
            return rows.stored[0]
        return offset_keys(key, self.key_offsets[layer], torch.empty_like(key))

    def step_rows(self, layer: int, key: torch.Tensor, value: torch.Tensor) -> ExactStepRows:
        """``key``/``value`` [T, num_kv_heads, head_dim] of ``layer`` prepared as the storage
        keeps them (`write.prepare_rows`): those `write` prepared when given the same
        tensors (`exact_rows` and `write_recent` after it), else computed."""
        rows = self._memo.rows(layer, key, value)
        return rows if rows is not None else self._prepare_rows(layer, key, value)

    def _prepare_rows(self, layer: int, key: torch.Tensor,
                      value: torch.Tensor) -> ExactStepRows:
        offsets = self.key_offsets[layer] if self.key_offsets is not None else None
        return prepare_rows(key, value, offsets, self._rotation[self.devices[layer]],
                            self.dtype)

    def gather(self, layer: int, page_table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Dequantized keys and values of the pages in ``page_table`` [B, P], each
        [B, P * page_size, num_kv_heads, head_dim] in the compute dtype."""
        pages = self.layers[layer]
        device = self.devices[layer]
        out_shape = (page_table.shape[0], page_table.shape[1] * self.page_size,
                     self.num_kv_heads, self.head_dim)
        index = page_table.to(device=device, dtype=torch.int64)
        results = []
        for codes, scales, fmt in (
            (pages.key_codes, pages.key_scales, self.key_format),
            (pages.value_codes, pages.value_scales, self.value_format),
        ):
            rows = dequantize(codes[index], scales[index], fmt, self._rotation[device],
                              self.dtype)
            results.append(rows.reshape(out_shape))
        rotation = self._rotation[device]
        for out, heads in zip(results, pages.heads(), strict=True):
            exact = unrotate(heads[index].to(torch.float32), rotation).to(self.dtype)
            out.view(*page_table.shape, self.page_size, *out.shape[2:])[:, :, 0] = exact
        return results[0], results[1]

    def gather_recent(self, layer: int, seq_slots: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """The recent windows of the sequences in ``seq_slots`` [G] (see
        `window.RecentWindow.gather`), un-rotated like `gather`'s rows, or None when no window
        is kept."""
        if self.recent is None:
            return None
        keys, values, positions = self.recent.gather(layer, seq_slots)
        rotation = self._rotation[self.devices[layer]]
        return (unrotate(keys.to(torch.float32), rotation).to(self.dtype),
                unrotate(values.to(torch.float32), rotation).to(self.dtype), positions)

    def copy_pages(self, copies: Sequence[PageCopy]) -> None:
        """Copy the first ``num_slots`` slots of page ``src`` into page ``dst`` (codes and
        scales, keys and values, head rows), in every layer, in the order given. Raises
        IndexError for a page outside the storage, ValueError for more slots than a page."""
        copies = [c for c in copies if c.src != c.dst and c.num_slots > 0]
        for c in copies:
            self._check_copy(c)
        moves = resolve_copies(copies, self.page_size)
        for pages in self.layers:
            copy_page_slots(pages.tensors(), moves)
            _copy_head_rows(pages.head_rows, moves)

    def _check_copy(self, copy: PageCopy) -> None:
        for page in (copy.src, copy.dst):
            if not 0 <= page < self.num_pages:
                raise IndexError(f"page copy {copy} names page {page}; the storage holds pages "
                                 f"0..{self.num_pages - 1}")
        if copy.num_slots > self.page_size:
            raise ValueError(f"page copy {copy} copies {copy.num_slots} slots; a page holds "
                             f"{self.page_size}")

    def nbytes(self) -> int:
        """Bytes held: the pages (codes, scales, head rows) and the recent windows reserved
        (`reserve_sequences`); never more than `unquantized_nbytes` (pages of at least a few
        slots: a page's exact head row alone outweighs a one-slot unquantized page)."""
        return self.page_nbytes() + self.window_nbytes()

    def window_nbytes(self) -> int:
        """Bytes of the recent windows reserved (0 before `reserve_sequences`)."""
        return self.recent.nbytes() if self.recent is not None else 0

    def unquantized_nbytes(self) -> int:
        """Bytes an unquantized storage (`fp16.FP16Storage`) of the same pages, layers and
        dtype holds: the footprint no quantized one may exceed."""
        element = torch.empty((), dtype=self.dtype).element_size()
        return (len(self.layers) * self.num_pages * self.page_size
                * 2 * self.num_kv_heads * self.head_dim * element)

    def page_nbytes(self) -> int:
        """Bytes of the page tensors of every layer: codes, scales and the head rows."""
        return sum(t.numel() * t.element_size()
                   for p in self.layers for t in (*p.tensors(), *p.heads()))

    def bytes_per_token(self) -> int:
        """Bytes one cached token's codes and scales take over all layers (keys and values);
        the head rows add ``bytes_per_page_head`` per page."""
        per_head = (self.key_format.bytes_per_row(self.head_dim)
                    + self.value_format.bytes_per_row(self.head_dim))
        return len(self.layers) * self.num_kv_heads * per_head

    def bytes_per_page_head(self) -> int:
        """Bytes of one page's unquantized head rows (keys and values) over all layers."""
        element = torch.empty((), dtype=self.dtype).element_size()
        return len(self.layers) * 2 * self.num_kv_heads * self.head_dim * element


def _copy_head_rows(head_rows: torch.Tensor, moves: PageMoves) -> None:
    """Every copy starts at slot 0, so its destination takes the source's head rows (key and
    value at once, ``head_rows`` [2, num_pages + 1, ...]) with its slot 0, as running the
    copies in order leaves them: one gather and one scatter (`resolve_copies`)."""
    if not moves:
        return
    on = moves.on(head_rows.device)
    if len(on.head_src):
        head_rows.index_copy_(1, on.head_dst, head_rows.index_select(1, on.head_src))

# What `StepMemo` reuses, and when. A backend hands the storage the same tensors several times
# per layer (`write`, the exact operands of attention, `write_recent`: the same keys and
# values), and every layer of a forward the same slot mapping, positions and sequence slots.
# - Exact rows: `write`, the first call of a layer, always computes them; the calls after it in
#   the same layer reuse them for the very same key and value tensors (weak references: a freed
#   tensor never matches, nor can its id be taken by another while held) that were not written
#   in place since (version counters; tensors made under ``torch.inference_mode`` keep none, and
#   nothing writes a layer's keys between its calls).
# - Window written: `write` given a decode-only step's window marks it done for the very same
#   key, value, position and sequence-slot tensors, so the `write_recent` after it skips; the
#   next `keep_rows` (any layer's write) drops the mark. A missed mark costs only a second,
#   identical window write.
# - Row indices: derived from the batch tensors every layer shares; reused by a later layer of
#   the same forward only (layers run in increasing order, so a call for a layer at or below the
#   one that last used an entry belongs to a new forward, which recomputes it: a CUDA graph
#   captured from a forward holds its own index kernels rather than an earlier forward's).


class _Inputs:
    """Tensors remembered by weak reference and version counter (where they keep one)."""

    def __init__(self, tensors: Sequence[torch.Tensor]) -> None:
        self.refs = [weakref.ref(t) for t in tensors]
        self.versions = [_version(t) for t in tensors]

    def matches(self, tensors: Sequence[torch.Tensor]) -> bool:
        """True for the very same tensor objects (a prefix of them may be given), none
        written in place since (as far as their version counters tell)."""
        return len(tensors) <= len(self.refs) and all(
            ref() is t and _version(t) == version
            for ref, version, t in zip(self.refs, self.versions, tensors, strict=False))


def _version(tensor: torch.Tensor) -> int | None:
    return None if tensor.is_inference() else tensor._version


class StepMemo:
    """The exact rows of the layer last written (and whether its write stored the recent
    window) and the row indices of the current forward."""

    def __init__(self) -> None:
        self._rows: tuple[int, _Inputs, ExactStepRows] | None = None
        self._window: tuple[int, _Inputs] | None = None
        self._indices: dict[tuple[str, torch.device], tuple[_Inputs, int, object]] = {}

    def clear(self) -> None:
        """Forget everything (what the rows are derived with changed, e.g. the key offsets)."""
        self._rows = None
        self._window = None
        self._indices.clear()

    def keep_rows(self, layer: int, key: torch.Tensor, value: torch.Tensor,
                  rows: ExactStepRows) -> None:
        """Remember ``rows``, prepared from ``key``/``value`` for ``layer``."""
        self._rows = (layer, _Inputs((key, value)), rows)
        self._window = None

    def keep_window(self, layer: int, inputs: Sequence[torch.Tensor]) -> None:
        """Remember that ``layer``'s recent window holds the rows of ``inputs`` (key, value,
        positions, sequence slots): the write after `keep_rows` stored them."""
        self._window = (layer, _Inputs(inputs))

    def window_kept(self, layer: int, inputs: Sequence[torch.Tensor]) -> bool:
        """Whether `keep_window` marked these very ``inputs`` of ``layer`` since the last
        `keep_rows`."""
        kept = self._window
        return (kept is not None and kept[0] == layer and len(inputs) == len(kept[1].refs)
                and kept[1].matches(inputs))

    def rows(self, layer: int, key: torch.Tensor,
             value: torch.Tensor | None = None) -> ExactStepRows | None:
        """The rows kept for ``layer`` from these very ``key`` (and ``value``) tensors, or
        None."""
        cached = self._rows
        given = (key,) if value is None else (key, value)
        if cached is not None and cached[0] == layer and cached[1].matches(given):
            return cached[2]
        return None

    def index(self, name: str, layer: int, device: torch.device,
              inputs: Sequence[torch.Tensor], compute: Callable[[], Result]) -> Result:
        """Row indices called ``name`` on ``device`` derived from ``inputs`` for ``layer``:
        an earlier layer's of this forward, or ``compute()``d."""
        cached = self._indices.get((name, device))
        if cached is not None and layer > cached[1] and cached[0].matches(inputs):
            self._indices[(name, device)] = (cached[0], layer, cached[2])
            return cached[2]  # type: ignore[return-value]
        result = compute()
        self._indices[(name, device)] = (_Inputs(inputs), layer, result)
        return result
