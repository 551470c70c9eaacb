"""Constraint masks to device bool rows.

A mask row is either a packed bitmask (int32: bit ``i % 32`` of word ``i // 32`` set = token
``i`` allowed, the layout grammar engines such as llguidance and xgrammar fill) or a bool row.
Packed rows are stacked on the host and cross to the device in one copy, then unpacked there.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


def _to_cpu_tensor(mask: object) -> torch.Tensor:
    if isinstance(mask, torch.Tensor):
        return mask.detach().to("cpu")
    if isinstance(mask, np.ndarray):
        return torch.from_numpy(np.ascontiguousarray(mask))
    raise TypeError(
        f"allowed_tokens must be a numpy array or a torch tensor (packed int32 bitmask or bool "
        f"row); got {type(mask).__name__}"
    )


def _fit(rows: torch.Tensor, width: int) -> torch.Tensor:
    """Cut or pad (with False: not allowed) bool rows to ``width`` columns."""
    if rows.shape[1] >= width:
        return rows[:, :width]
    pad = torch.zeros((rows.shape[0], width - rows.shape[1]), dtype=torch.bool,
                      device=rows.device)
    return torch.cat([rows, pad], dim=1)


def unpack_bitmask(packed: torch.Tensor, width: int) -> torch.Tensor:
    """Packed int32 ``[rows, words]`` to bool ``[rows, width]`` on the same device."""
    shifts = torch.arange(32, dtype=torch.int32, device=packed.device)
    bits = (packed.to(torch.int32).unsqueeze(-1) >> shifts) & 1
    return _fit(bits.reshape(packed.shape[0], -1).bool(), width)


def allowed_rows_to_bool(
    masks: Sequence[object], width: int, device: torch.device
) -> torch.Tensor:
    """Bool ``[len(masks), width]`` on ``device``: True where a token is allowed."""
    rows = [_to_cpu_tensor(m).reshape(-1) for m in masks]
    packed = [i for i, r in enumerate(rows) if r.dtype != torch.bool]
    out = torch.zeros((len(rows), width), dtype=torch.bool, device=device)
    if packed:
        words = max(rows[i].numel() for i in packed)
        stacked = torch.zeros((len(packed), words), dtype=torch.int32)
        for j, i in enumerate(packed):
            stacked[j, : rows[i].numel()] = rows[i].to(torch.int32)
        index = torch.tensor(packed, dtype=torch.int64, device=device)
        out.index_copy_(0, index, unpack_bitmask(stacked.to(device, non_blocking=True), width))
    plain = [i for i, r in enumerate(rows) if r.dtype == torch.bool]
    if plain:
        length = max(rows[i].numel() for i in plain)
        stacked_bool = torch.zeros((len(plain), length), dtype=torch.bool)
        for j, i in enumerate(plain):
            stacked_bool[j, : rows[i].numel()] = rows[i]
        index = torch.tensor(plain, dtype=torch.int64, device=device)
        out.index_copy_(0, index, _fit(stacked_bool.to(device), width))
    return out
