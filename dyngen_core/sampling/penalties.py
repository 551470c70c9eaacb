"""History-based logit edits: repetition / frequency / presence penalties, and DRY.

Penalties (ExLlamaV2 semantics, batched on the device): walking back from the newest history
token, the first ``range`` tokens get the full penalties and the next ``decay`` tokens a penalty
fading linearly to neutral (at backward offset ``j``: ``p(j) = p0 + (neutral - p0) *
max(0, j - range) / decay``). A token present in that window has its logit divided (if
positive) or multiplied (if not) by the repetition penalty, and the presence penalty subtracted,
both at the value of its most recent occurrence; the frequency penalty is subtracted once per
occurrence, each at its own offset's value.

DRY (the original algorithm of koboldcpp / text-generation-webui): for every earlier
occurrence of the history's last token, extend the match backwards while the tokens agree (no
sequence breakers, at most ``dry_max_ngram`` long); the token that followed that occurrence gets
``multiplier * base ** (length - allowed_length)`` subtracted when ``length >= allowed_length``
(longest match per token). It runs on the host with numpy: the search is sparse and
data-dependent, the history is already there, and it yields a handful of (token, penalty) pairs
per row that are applied on the device in one scatter.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from dyngen_core.settings import SamplerSettings

_FAR = 1 << 40  # "no occurrence": larger than any backward offset


def penalty_window(settings: SamplerSettings) -> int | None:
    """How many newest history tokens the penalties read (None = all)."""
    if settings.token_repetition_range < 0:
        return None
    return settings.token_repetition_range + settings.token_repetition_decay


def apply_penalties(
    x: torch.Tensor, histories: Sequence[Sequence[int]], settings: Sequence[SamplerSettings]
) -> torch.Tensor:
    """Apply repetition / frequency / presence penalties to logits ``x`` ``[rows, vocab]`` in
    place; row ``i`` uses ``histories[i]`` and ``settings[i]``."""
    rows, vocab = x.shape
    device = x.device
    windows = []
    for hist, s in zip(histories, settings, strict=True):
        w = penalty_window(s)
        windows.append(list(hist) if w is None else list(hist[len(hist) - w:] if w else []))
    width = max((len(w) for w in windows), default=0)
    if width == 0:
        return x
    padded = [[vocab] * (width - len(w)) + w for w in windows]
    ids = torch.tensor(padded, dtype=torch.int64, device=device).clamp_(0, vocab)
    offsets = torch.arange(width - 1, -1, -1, device=device).expand(rows, width)

    def column(values: list[float]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.float32, device=device).unsqueeze(1)

    sustain = column([s.token_repetition_range if s.token_repetition_range > 0 else _FAR
                      for s in settings])
    fade = column([1.0 / s.token_repetition_decay if s.token_repetition_decay else 0.0
                   for s in settings])
    rep0 = column([s.token_repetition_penalty for s in settings])
    freq0 = column([s.token_frequency_penalty for s in settings])
    pres0 = column([s.token_presence_penalty for s in settings])

    newest = torch.full((rows, vocab + 1), _FAR, dtype=torch.int64, device=device)
    newest.scatter_reduce_(1, ids, offsets, reduce="amin")
    newest = newest[:, :vocab]
    present = newest < _FAR
    faded_newest = ((newest.float() - sustain).clamp_min_(0) * fade).clamp_max_(1.0)
    rep = rep0 + (1.0 - rep0) * faded_newest
    pres = pres0 * (1.0 - faded_newest)
    faded_each = ((offsets.float() - sustain).clamp_min_(0) * fade).clamp_max_(1.0)
    freq_each = freq0 * (1.0 - faded_each)
    freq = torch.zeros((rows, vocab + 1), dtype=torch.float32, device=device)
    freq.scatter_add_(1, ids, freq_each)
    penalized = torch.where(x > 0, x / rep, x * rep) - pres
    x.copy_(torch.where(present, penalized, x) - freq[:, :vocab])
    return x


def dry_penalties(
    history: Sequence[int], breakers: np.ndarray, settings: SamplerSettings
) -> tuple[np.ndarray, np.ndarray]:
    """DRY for one history: ``(token_ids, penalties)`` to subtract from the next logits.

    breakers: bool ``[vocab]``, True for sequence-breaker tokens (ids past its end count as
    breakers too).
    """
    empty = (np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.float64))
    h = np.asarray(history, dtype=np.int64)
    if settings.dry_range:
        h = h[-settings.dry_range:]
    n = len(h)
    if n < 2:
        return empty
    vocab = len(breakers)
    is_breaker = np.where(h < vocab, breakers[np.minimum(h, vocab - 1)], True)
    if is_breaker[-1]:
        return empty
    starts = np.flatnonzero(h[:-1] == h[-1])
    starts = starts[~is_breaker[starts + 1]]
    if len(starts) == 0:
        return empty
    lengths = np.ones(len(starts), dtype=np.int64)
    alive = np.ones(len(starts), dtype=bool)
    for k in range(1, min(settings.dry_max_ngram, n - 1)):
        if is_breaker[n - 1 - k]:
            break
        back = starts - k
        alive &= (back >= 0) & (h[np.maximum(back, 0)] == h[n - 1 - k])
        if not alive.any():
            break
        lengths += alive
    followers = h[starts + 1]
    tokens, inverse = np.unique(followers, return_inverse=True)
    longest = np.zeros(len(tokens), dtype=np.int64)
    np.maximum.at(longest, inverse, lengths)
    hit = longest >= settings.dry_allowed_length
    exponent = (longest[hit] - settings.dry_allowed_length).astype(np.float64)
    penalty = settings.dry_multiplier * settings.dry_base ** exponent
    return tokens[hit], penalty
