"""Work the quantized storage derives from a forward's inputs, done once and reused.

A backend hands the storage the same tensors several times per layer (`KVStorage.write`, the
exact operands of attention, `KVStorage.write_recent`: the same keys and values), and every
layer of a forward the same slot mapping, positions and sequence slots. On a GPU, a batch-1
decode step is dominated by small kernels, so recomputing what these calls share (the keys
minus their offsets, the rotated exact rows, the row indices of the head rows and the recent
window) costs more than it should. `StepMemo` keeps the last results for the calls after.

When a result is reused:

- Exact rows: `KVStorage.write`, the first call of a layer, always computes them; the calls
  after it in the same layer reuse them for the very same key and value tensors (weak
  references: a freed tensor never matches, nor can its id be taken by another while held)
  that were not written in place since (version counters; tensors made under
  ``torch.inference_mode`` keep none, and nothing writes a layer's keys between its calls).
- Window written: `KVStorage.write` given a decode-only step's window marks it done for the
  very same key, value, position and sequence-slot tensors, so the `write_recent` after it
  skips; the next `keep_rows` (any layer's write) drops the mark. A missed mark costs only a
  second, identical window write.
- Row indices: derived from the batch tensors every layer shares; reused by a later layer of
  the same forward only (layers run in increasing order, so a call for a layer at or below
  the one that last used an entry belongs to a new forward, which recomputes it: a CUDA graph
  captured from a forward holds its own index kernels rather than an earlier forward's
  results).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

import torch

from dyngen_core.kv.quant.hadamard import rotate

Result = TypeVar("Result")


@dataclass(frozen=True)
class ExactStepRows:
    """This step's rows of one layer as the storage keeps them, keys at index 0, values at 1.

    exact: the rows rotated (`hadamard.rotate`) in the compute dtype, the form of the exact
        rows (page heads, recent windows).
    stored: [2, T, kv_heads, head_dim] in the keys' dtype: keys minus the layer's key offsets
        (what the quantized pages encode), values as given; None when the write that made
        ``exact`` kept them in registers only (`quant_write`).
    rotated: ``stored`` rotated, float32 (what the torch codec quantizes); None likewise.
    """

    exact: torch.Tensor
    stored: torch.Tensor | None = None
    rotated: torch.Tensor | None = None


def prepare_rows(key: torch.Tensor, value: torch.Tensor, offsets: torch.Tensor | None,
                 rotation: torch.Tensor, dtype: torch.dtype) -> ExactStepRows:
    """Keys [T, kv_heads, head_dim] minus ``offsets`` (float32 [kv_heads, head_dim], or None)
    and values (cast to the keys' dtype) in one tensor, rotated by one float32 matrix product
    and cast once to ``dtype``: per element the same arithmetic as offsetting, rotating and
    casting keys and values one by one."""
    stored = torch.empty((2, *key.shape), dtype=key.dtype, device=key.device)
    offset_keys(key, offsets, stored[0])
    stored[1].copy_(value)
    rotated = rotate(stored, rotation)
    return ExactStepRows(stored=stored, rotated=rotated, exact=rotated.to(dtype))


def offset_keys(key: torch.Tensor, offsets: torch.Tensor | None,
                out: torch.Tensor) -> torch.Tensor:
    """``key`` minus ``offsets`` into ``out`` (the keys' dtype): computed in float32 and
    rounded once, in one kernel (``key.float() - offsets``, then cast)."""
    if offsets is None:
        return out.copy_(key)
    return torch.sub(key, offsets, out=out)


def head_index(slot_mapping: torch.Tensor, page_size: int, num_pages: int,
               device: torch.device) -> torch.Tensor:
    """Rows of a layer's head rows, flattened to [2 * (num_pages + 1), ...], that a step's
    keys, then values, written at ``slot_mapping`` [T] go to: a page's head row for slot 0 of
    a page, the spare last row for the others (no data-dependent shapes: CUDA graphs)."""
    slots = slot_mapping.to(device=device, dtype=torch.int64)
    rows = torch.where(slots % page_size == 0, slots // page_size, num_pages)
    return torch.cat((rows, rows + (num_pages + 1)))


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
