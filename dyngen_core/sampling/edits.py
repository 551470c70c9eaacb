"""Stages 1-3: logit edits that do not depend on the distribution's shape (bias and bans,
constraint masks, repetition penalties, DRY), and the constraint masks' conversion to device
bool rows."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from dyngen_core.engine.record import SampleRequest
from dyngen_core.sampling import penalties
from dyngen_core.sampling.rows import Row, RowList, on_rows, rows_using
from dyngen_core.sampling.vocab import VocabTables

_NEG_INF = float("-inf")


def apply_edits(
    x: torch.Tensor, rows: Sequence[Row], requests: Sequence[SampleRequest], vocab: VocabTables
) -> None:
    """Stages 1-3 in place on logits ``x`` ``[rows, width]``."""
    apply_bias(x, rows)
    apply_masks(x, rows, requests)
    picked = rows_using(rows, "penalties")
    if picked:
        histories = [requests[rows[i].request].row_history(rows[i].offset) for i in picked]
        settings = [rows[i].settings for i in picked]
        on_rows(x, picked, lambda sub: penalties.apply_penalties(sub, histories, settings))
    apply_dry(x, rows, requests, vocab)


def scatter_add(
    x: torch.Tensor, rows: Sequence[int], ids: Sequence[int], values: Sequence[float]
) -> None:
    """``x[rows[i], ids[i]] += values[i]`` in one device call."""
    bad = [t for t in ids if not 0 <= t < x.shape[1]]
    if bad:
        raise ValueError(f"token ids {bad[:5]} are outside the logits (width {x.shape[1]})")
    device = x.device
    index = (torch.tensor(list(rows), dtype=torch.int64, device=device),
             torch.tensor(list(ids), dtype=torch.int64, device=device))
    x.index_put_(index, torch.tensor(list(values), dtype=torch.float32, device=device),
                 accumulate=True)


def apply_bias(x: torch.Tensor, rows: Sequence[Row]) -> None:
    """token_bias and banned_tokens."""
    targets: list[int] = []
    ids: list[int] = []
    values: list[float] = []
    for i in rows_using(rows, "bias"):
        settings = rows[i].settings
        for token, bias in settings.token_bias.items():
            targets.append(i)
            ids.append(token)
            values.append(bias)
        targets.extend([i] * len(settings.banned_tokens))
        ids.extend(settings.banned_tokens)
        values.extend([_NEG_INF] * len(settings.banned_tokens))
    if targets:
        scatter_add(x, targets, ids, values)


def apply_masks(x: torch.Tensor, rows: Sequence[Row], requests: Sequence[SampleRequest]) -> None:
    """Constraint masks: tokens a row's ``allowed_tokens`` does not allow become ``-inf``."""
    if isinstance(rows, RowList) and not rows.any_mask:
        return
    picked: list[int] = []
    masks: list[object] = []
    for i, row in enumerate(rows):
        allowed = requests[row.request].allowed_tokens
        if allowed is None:
            continue
        picked.append(i)
        masks.append(allowed if getattr(allowed, "ndim", 1) == 1 else allowed[row.offset])
    if picked:
        allowed_bool = allowed_rows_to_bool(masks, x.shape[1], x.device)
        on_rows(x, picked, lambda sub: sub.masked_fill(~allowed_bool, _NEG_INF))


def apply_dry(
    x: torch.Tensor, rows: Sequence[Row], requests: Sequence[SampleRequest], vocab: VocabTables
) -> None:
    """DRY for the rows that use it, batched on the device."""
    picked = rows_using(rows, "dry")
    if not picked:
        return
    histories = [requests[rows[i].request].row_history(rows[i].offset) for i in picked]
    settings = [rows[i].settings for i in picked]
    tables, which = vocab.breaker_tables([s.dry_sequence_breakers for s in settings], x.device)
    on_rows(x, picked,
            lambda sub: penalties.apply_dry(sub, histories, settings, tables, which))


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
