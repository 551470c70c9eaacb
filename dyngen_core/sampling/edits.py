"""Stages 1-3: logit edits that do not depend on the distribution's shape (bias and bans,
constraint masks, repetition penalties, DRY)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from dyngen_core.engine.record import SampleRequest
from dyngen_core.sampling import penalties
from dyngen_core.sampling.masks import allowed_rows_to_bool
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
