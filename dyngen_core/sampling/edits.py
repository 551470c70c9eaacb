"""Stages 1-3: the logit edits that do not depend on the distribution's shape, in place on
whole ``[rows, width]`` logits rows: token bias and banned tokens, constraint masks (and their
conversion to device bool rows), repetition / frequency / presence penalties, and DRY.

The penalties and DRY read each row's history as one ``[rows, width]`` token matrix (the newest
tokens a row's settings look at, right-aligned, ``-1`` before them; `history_matrix`): the only
host work per step is copying those windows, and the rest runs as a fixed number of tensor
operations whatever the number of rows. Per-token facts (a token's newest occurrence, its
summed frequency penalty, its longest DRY match) go through a dense ``[rows, vocab]`` scratch
table and are gathered back at the window's positions, so repeated tokens of a window compute
identical values and the edit is one gather and one scatter on the logits.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from dyngen_core.engine.record import SampleRequest
from dyngen_core.engine.settings import SamplerSettings
from dyngen_core.sampling.rows import Row, RowList, column, on_rows, rows_using

if TYPE_CHECKING:
    from dyngen_core.sampling.sampler import VocabTables

_NEG_INF = float("-inf")
# DRY extension steps compared at once (a [rows, width, block] comparison); between blocks one
# check, which synchronizes with the device, stops when no match is still growing.
_DRY_BLOCK = 32


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
        on_rows(x, picked, lambda sub: apply_penalties(sub, histories, settings))
    _apply_dry_rows(x, rows, requests, vocab)


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


def _apply_dry_rows(
    x: torch.Tensor, rows: Sequence[Row], requests: Sequence[SampleRequest], vocab: VocabTables
) -> None:
    """DRY for the rows that use it, batched on the device (`apply_dry`)."""
    picked = rows_using(rows, "dry")
    if not picked:
        return
    histories = [requests[rows[i].request].row_history(rows[i].offset) for i in picked]
    settings = [rows[i].settings for i in picked]
    tables, which = vocab.breaker_tables([s.dry_sequence_breakers for s in settings], x.device)
    on_rows(x, picked,
            lambda sub: apply_dry(sub, histories, settings, tables, which))


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


def penalty_window(settings: SamplerSettings) -> int | None:
    """How many newest history tokens the penalties read (None = all)."""
    if settings.token_repetition_range < 0:
        return None
    return settings.token_repetition_range + settings.token_repetition_decay


def history_matrix(
    histories: Sequence[Sequence[int]], windows: Sequence[int | None], device: torch.device
) -> torch.Tensor:
    """``[rows, width]`` int64 on ``device``: row ``i`` holds the newest ``windows[i]`` tokens of
    ``histories[i]`` (all of them for None), right-aligned, ``-1`` before them."""
    tails = [h if w is None or w >= len(h) else h[len(h) - w:]
             for h, w in zip(histories, windows, strict=True)]
    width = max((len(t) for t in tails), default=0)
    table = np.full((len(tails), width), -1, dtype=np.int64)
    for i, tail in enumerate(tails):
        if len(tail):
            table[i, width - len(tail):] = tail
    return torch.from_numpy(table).to(device)


def apply_penalties(
    x: torch.Tensor, histories: Sequence[Sequence[int]], settings: Sequence[SamplerSettings]
) -> torch.Tensor:
    """Apply repetition / frequency / presence penalties to logits ``x`` ``[rows, vocab]`` in
    place; row ``i`` uses ``histories[i]`` and ``settings[i]``.

    ExLlamaV2 semantics: walking back from the newest history token, the first ``range``
    tokens get the full penalties and the next ``decay`` tokens a penalty fading linearly to
    neutral (at backward offset ``j``: ``p(j) = p0 + (neutral - p0) * max(0, j - range) /
    decay``). A token present in that window has its logit divided (if positive) or
    multiplied (if not) by the repetition penalty, and the presence penalty subtracted, both
    at the value of its most recent occurrence; the frequency penalty is subtracted once per
    occurrence, each at its own offset's value.
    """
    hist = history_matrix(histories, [penalty_window(s) for s in settings], x.device)
    rows, width = hist.shape
    if width == 0:
        return x
    valid = (hist >= 0) & (hist < x.shape[1])
    # Invalid positions read and write column 0 with column 0's own values: harmless duplicates.
    index = torch.where(valid, hist, 0)
    offset = torch.arange(width - 1, -1, -1, device=x.device, dtype=torch.float32)
    offset = offset.expand(rows, width)
    sustain = column([s.token_repetition_range if s.token_repetition_range > 0 else math.inf
                      for s in settings], x.device)
    per_step = column([1.0 / s.token_repetition_decay if s.token_repetition_decay else 0.0
                       for s in settings], x.device)

    def faded(at: torch.Tensor) -> torch.Tensor:
        return ((at - sustain).clamp_min(0.0) * per_step).clamp(0.0, 1.0)

    newest = torch.full(x.shape, math.inf, device=x.device)
    newest.scatter_reduce_(1, index, torch.where(valid, offset, math.inf), "amin")
    seen = newest.gather(1, index)
    present = seen < math.inf
    fade = faded(torch.where(present, seen, 0.0))
    rep0 = column([s.token_repetition_penalty for s in settings], x.device)
    repetition = rep0 + (1.0 - rep0) * fade
    presence = column([s.token_presence_penalty for s in settings], x.device) * (1.0 - fade)
    values = x.gather(1, index)
    edited = torch.where(values > 0, values / repetition, values * repetition) - presence
    edited = torch.where(present, edited, values)
    if any(s.token_frequency_penalty for s in settings):
        per_use = column([s.token_frequency_penalty for s in settings], x.device)
        uses = torch.where(valid, per_use * (1.0 - faded(offset)), 0.0)
        frequency = torch.zeros(x.shape, device=x.device).scatter_add_(1, index, uses)
        edited = edited - frequency.gather(1, index)
    x.scatter_(1, index, edited.to(x.dtype))
    return x


def apply_dry(
    x: torch.Tensor,
    histories: Sequence[Sequence[int]],
    settings: Sequence[SamplerSettings],
    breaker_tables: torch.Tensor,
    breaker_rows: torch.Tensor,
) -> torch.Tensor:
    """Subtract DRY penalties from logits ``x`` ``[rows, vocab]`` in place.

    The original algorithm of koboldcpp / text-generation-webui: for every earlier occurrence
    of the history's last token, extend the match backwards while the tokens agree (no
    sequence breakers, at most ``dry_max_ngram`` long); the token that followed that
    occurrence gets ``multiplier * base ** (length - allowed_length)`` subtracted when
    ``length >= allowed_length`` (longest match per token). The backward extension runs for
    all rows, occurrences and match lengths at once (in blocks of `_DRY_BLOCK` lengths).

    breaker_tables: bool ``[tables, vocab_size]`` on ``x``'s device, True for sequence breakers;
        ids at or past ``vocab_size`` (and padding) count as breakers too.
    breaker_rows: int64 ``[rows]``: which table row ``i`` uses.
    """
    hist = history_matrix(histories, [s.dry_range or None for s in settings], x.device)
    rows, width = hist.shape
    if width < 2:
        return x
    valid = (hist >= 0) & (hist < breaker_tables.shape[1])
    breaks = breaker_tables[breaker_rows[:, None], torch.where(valid, hist, 0)] | ~valid
    lengths, starts = _dry_match_lengths(hist, breaks, settings)
    followers = torch.where(starts, hist[:, 1:], 0)
    longest = torch.zeros(x.shape, device=x.device)
    longest.scatter_reduce_(1, followers, lengths.to(torch.float32), "amax")
    found = longest.gather(1, followers)
    allowed = column([s.dry_allowed_length for s in settings], x.device)
    multiplier = column([s.dry_multiplier for s in settings], x.device)
    base = column([s.dry_base for s in settings], x.device)
    penalty = multiplier * base ** (found - allowed).clamp_min(0.0)
    penalty = torch.where(found >= allowed, penalty, 0.0)
    x.scatter_(1, followers, (x.gather(1, followers) - penalty).to(x.dtype))
    return x


def _dry_match_lengths(
    hist: torch.Tensor, breaks: torch.Tensor, settings: Sequence[SamplerSettings]
) -> tuple[torch.Tensor, torch.Tensor]:
    """For every position ``i < width - 1`` of every row: whether ``i`` is an earlier occurrence
    of the row's last token followed by a non-breaker (``starts``), and the length of the match
    ending there (``lengths``, 0 where not a start).

    Extension steps ``k`` (compare ``hist[i - k]`` with ``hist[width - 1 - k]``) run a block of
    `_DRY_BLOCK` at a time as one [rows, positions, k] comparison, so a typical
    ``dry_max_ngram`` of 20 costs a fixed handful of tensor operations."""
    width = hist.shape[1]
    starts = (hist[:, :-1] == hist[:, -1:]) & ~breaks[:, 1:] & ~breaks[:, -1:]
    lengths = starts.to(torch.int32)
    steps = min(max(s.dry_max_ngram for s in settings), width - 1)
    if steps <= 1:
        return lengths, starts
    device = hist.device
    max_ngram = torch.tensor([[s.dry_max_ngram] for s in settings], device=device)
    # -2 before the history: never equal to a token, so matches stop at the row's start.
    padded = torch.nn.functional.pad(hist, (steps - 1, 0), value=-2)
    alive = starts.clone()
    for first in range(1, steps, _DRY_BLOCK):
        last = min(first + _DRY_BLOCK, steps) - 1
        ks = torch.arange(first, last + 1, device=device)
        # A breaker in the history's own suffix stops every match of that row at that step.
        suffix_ok = (~breaks[:, width - 1 - ks] & (ks < max_ngram)).to(torch.int32)
        suffix_ok = suffix_ok.cumprod(dim=1).bool()
        # Windows of the padded history (a view): window i, entry j is hist[i - (last - j)].
        back = padded[:, steps - 1 - last:].unfold(1, len(ks), 1)[:, : width - 1]
        agree = back == hist[:, width - 1 - ks.flip(0)][:, None, :]
        agree = agree.flip(2) & suffix_ok[:, None, :]  # entry j now compares step k = first + j
        whole = agree.all(dim=2)
        # Leading agreements: the index of the first disagreement, or the whole block.
        run = torch.where(whole, len(ks), (~agree).to(torch.uint8).argmax(dim=2))
        lengths += torch.where(alive, run, 0).to(torch.int32)
        alive &= whole
        if last + 1 < steps and not bool(alive.any()):
            break
    return lengths, starts
