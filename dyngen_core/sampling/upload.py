"""`Staging`: a sampling call's per-row parameters (RNG keys, temperatures, top_k, top_p...)
reach the device in one copy.

Why: each ``torch.tensor(values, device="cuda")`` is its own host-to-device copy from pageable
memory, which also waits for the GPU to finish the work queued before it. Packing every column
into one pinned buffer and copying it once, without waiting, lets the host queue the whole draw
and wait only for the sampled ids. The columns are then views of the one device buffer: int64
columns first, float32 columns after them, in the order given.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


class Staging:
    """Packs host columns and sends them to ``device`` in one non-blocking copy.

    device: where the columns are wanted. On the CPU the packed buffer is used as it is (no
    copy); on a GPU the host buffer is pinned and reused from call to call (the previous copy
    is waited for before it is overwritten, which it has long finished when a step has read
    its sampled ids back).
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._pinned: torch.Tensor | None = None
        # The pinned buffer read as int64, on the host (numpy) and as a tensor: `send_ints`.
        self._pinned_ints: tuple[np.ndarray, torch.Tensor] | None = None
        self._copied: torch.cuda.Event | None = None

    def send(
        self, ints: Sequence[np.ndarray], floats: Sequence[np.ndarray]
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The ``ints`` (each converted to int64) and ``floats`` (each to float32) on the
        device, with their shapes, as views of one buffer copied once."""
        int_sizes = [a.size for a in ints]
        float_sizes = [a.size for a in floats]
        split = 8 * sum(int_sizes)
        nbytes = split + 4 * sum(float_sizes)
        host = self._host_buffer(nbytes)
        packed = host.numpy()
        _fill(packed[:split].view(np.int64), ints, int_sizes)
        _fill(packed[split:nbytes].view(np.float32), floats, float_sizes)
        device = host if self.device.type == "cpu" else self._copy(host)
        # Each skipped view or split is one less tensor op on the host (a step sends its keys
        # alone, once the rows' columns are on the device).
        return (_views(device[:split], torch.int64, ints, int_sizes) if ints else [],
                _views(device[split:nbytes], torch.float32, floats, float_sizes)
                if floats else [])

    def send_ints(self, array: np.ndarray) -> torch.Tensor:
        """``send([array], [])[0][0]`` in fewer host operations (a step sends its RNG keys
        alone): on the CPU the array's own memory (it must not change while the tensor is
        used), on a GPU one copy out of the pinned buffer read as int64."""
        if self.device.type == "cpu":
            return torch.from_numpy(np.ascontiguousarray(array, dtype=np.int64))
        return self._copy(self._pinned_ints_of(array)).view(array.shape)

    def send_ints_into(self, array: np.ndarray, target: torch.Tensor) -> None:
        """Copy ``array`` (as int64) into the int64 device tensor ``target`` of as many
        elements, without waiting: `send_ints` for a caller that reads the values from a fixed
        place (a CUDA graph's static input). On the CPU a plain copy."""
        if self.device.type == "cpu":
            target.copy_(torch.from_numpy(np.ascontiguousarray(array, dtype=np.int64))
                         .view(target.shape))
            return
        target.copy_(self._pinned_ints_of(array).view(target.shape), non_blocking=True)
        self._record_copy()

    def _pinned_ints_of(self, array: np.ndarray) -> torch.Tensor:
        """``array`` written into the pinned buffer as int64: the buffer's first elements."""
        size = array.size
        pinned = self._reserve(8 * size)
        if self._pinned_ints is None:
            ints = pinned.view(torch.int64)
            self._pinned_ints = ints.numpy(), ints
        host_array, host = self._pinned_ints
        host_array[:size] = array.reshape(-1)
        return host[:size]

    def _host_buffer(self, nbytes: int) -> torch.Tensor:
        if self.device.type == "cpu":
            return torch.empty(nbytes, dtype=torch.uint8)
        return self._reserve(nbytes)[:nbytes]

    def _reserve(self, nbytes: int) -> torch.Tensor:
        """The pinned buffer, at least ``nbytes`` long, free to overwrite."""
        if self._copied is not None:
            self._copied.synchronize()  # the last copy out of the buffer is done
        if self._pinned is None or self._pinned.numel() < nbytes:
            # Grown geometrically: pinning memory is slow, so it happens only a few times.
            # Whole int64 words: `send_ints` reads it as int64.
            size = max(nbytes, 2 * (0 if self._pinned is None else self._pinned.numel()), 4096)
            self._pinned = torch.empty(-(-size // 8) * 8, dtype=torch.uint8, pin_memory=True)
            self._pinned_ints = None
        return self._pinned

    def _copy(self, host: torch.Tensor) -> torch.Tensor:
        device = host.to(self.device, non_blocking=True)
        self._record_copy()
        return device

    def _record_copy(self) -> None:
        """Mark the pinned buffer busy until the copy just queued is done (`_reserve`)."""
        if self._copied is None:
            self._copied = torch.cuda.Event()
        self._copied.record()


def _views(flat: torch.Tensor, dtype: torch.dtype, arrays: Sequence[np.ndarray],
           sizes: list[int]) -> list[torch.Tensor]:
    """``flat`` read as ``dtype`` and cut into tensors shaped like ``arrays``."""
    typed = flat.view(dtype)
    if len(arrays) == 1:
        return [typed.view(arrays[0].shape)]
    return [t.view(a.shape) for t, a in zip(typed.split(sizes), arrays, strict=True)]


def _fill(target: np.ndarray, arrays: Sequence[np.ndarray], sizes: Sequence[int]) -> None:
    start = 0
    for array, size in zip(arrays, sizes, strict=True):
        target[start:start + size] = array.reshape(-1)
        start += size
