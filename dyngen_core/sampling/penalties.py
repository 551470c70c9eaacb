"""History-based logit edits, batched on the logits' device: repetition / frequency / presence
penalties, and DRY.

Both read each row's history as one ``[rows, width]`` token matrix (the newest tokens a row's
settings look at, right-aligned, ``-1`` before them; `history_matrix`): the only host work per
step is copying those windows, and the rest runs as a fixed number of tensor operations whatever
the number of rows. Per-token facts (a token's newest occurrence, its summed frequency penalty,
its longest DRY match) go through a dense ``[rows, vocab]`` scratch table and are gathered back
at the window's positions, so repeated tokens of a window compute identical values and the edit
is one gather and one scatter on the logits.

Penalties (ExLlamaV2 semantics): walking back from the newest history token, the first
``range`` tokens get the full penalties and the next ``decay`` tokens a penalty fading linearly
to neutral (at backward offset ``j``: ``p(j) = p0 + (neutral - p0) * max(0, j - range) /
decay``). A token present in that window has its logit divided (if positive) or multiplied (if
not) by the repetition penalty, and the presence penalty subtracted, both at the value of its
most recent occurrence; the frequency penalty is subtracted once per occurrence, each at its own
offset's value.

DRY (the original algorithm of koboldcpp / text-generation-webui): for every earlier occurrence
of the history's last token, extend the match backwards while the tokens agree (no sequence
breakers, at most ``dry_max_ngram`` long); the token that followed that occurrence gets
``multiplier * base ** (length - allowed_length)`` subtracted when ``length >= allowed_length``
(longest match per token). The backward extension runs for all rows, occurrences and match
lengths at once (in blocks of 32 lengths).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch

from dyngen_core.engine.settings import SamplerSettings
from dyngen_core.sampling.rows import column

# DRY extension steps compared at once (a [rows, width, block] comparison); between blocks one
# check, which synchronizes with the device, stops when no match is still growing.
_DRY_BLOCK = 32


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
    place; row ``i`` uses ``histories[i]`` and ``settings[i]``."""
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
