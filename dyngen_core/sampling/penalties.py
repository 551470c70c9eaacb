"""History-based logit edits: repetition / frequency / presence penalties, and DRY.

Penalties (ExLlamaV2 semantics): walking back from the newest history
token, the first ``range`` tokens get the full penalties and the next ``decay`` tokens a penalty
fading linearly to neutral (at backward offset ``j``: ``p(j) = p0 + (neutral - p0) *
max(0, j - range) / decay``). A token present in that window has its logit divided (if
positive) or multiplied (if not) by the repetition penalty, and the presence penalty subtracted,
both at the value of its most recent occurrence; the frequency penalty is subtracted once per
occurrence, each at its own offset's value. The per-token terms come from the window on the
host (the history is there; a window holds a few hundred distinct tokens), and are applied on the
device with one gather and one scatter of only those (row, token) pairs.

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


def penalty_window(settings: SamplerSettings) -> int | None:
    """How many newest history tokens the penalties read (None = all)."""
    if settings.token_repetition_range < 0:
        return None
    return settings.token_repetition_range + settings.token_repetition_decay


def penalty_terms(
    history: Sequence[int], settings: SamplerSettings, vocab_size: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """For one row: ``(token_ids, repetition, presence, frequency)`` per distinct token of the
    penalty window (host, numpy): the multiplicative penalty and presence penalty at the
    token's newest occurrence, and the summed frequency penalty."""
    window = penalty_window(settings)
    ids = np.asarray(history[len(history) - window:] if window is not None else history,
                     dtype=np.int64)
    offsets = np.arange(len(ids) - 1, -1, -1, dtype=np.float64)
    inside = (ids >= 0) & (ids < vocab_size)
    ids, offsets = ids[inside], offsets[inside]
    tokens, inverse = np.unique(ids, return_inverse=True)
    newest = np.full(len(tokens), np.inf)
    np.minimum.at(newest, inverse, offsets)
    sustain = settings.token_repetition_range if settings.token_repetition_range > 0 else np.inf
    per_step = 1.0 / settings.token_repetition_decay if settings.token_repetition_decay else 0.0

    def faded(offset: np.ndarray) -> np.ndarray:
        return np.clip(np.maximum(offset - sustain, 0.0) * per_step, 0.0, 1.0)

    rep0 = settings.token_repetition_penalty
    repetition = rep0 + (1.0 - rep0) * faded(newest)
    presence = settings.token_presence_penalty * (1.0 - faded(newest))
    frequency = np.zeros(len(tokens))
    np.add.at(frequency, inverse, settings.token_frequency_penalty * (1.0 - faded(offsets)))
    return tokens, repetition, presence, frequency


def apply_penalties(
    x: torch.Tensor, histories: Sequence[Sequence[int]], settings: Sequence[SamplerSettings]
) -> torch.Tensor:
    """Apply repetition / frequency / presence penalties to logits ``x`` ``[rows, vocab]`` in
    place; row ``i`` uses ``histories[i]`` and ``settings[i]``. Only the (row, token) pairs of
    the windows are touched: one host-to-device copy, one gather, one scatter."""
    parts = [penalty_terms(h, s, x.shape[1])
             for h, s in zip(histories, settings, strict=True)]
    rows = np.concatenate([np.full(len(p[0]), i) for i, p in enumerate(parts)])
    if len(rows) == 0:
        return x
    table = np.stack([rows, *(np.concatenate([p[k] for p in parts]) for k in range(4))])
    terms = torch.from_numpy(table).to(x.device)
    index = (terms[0].long(), terms[1].long())
    rep, pres, freq = (terms[k].to(torch.float32) for k in (2, 3, 4))
    values = x[index]
    x[index] = torch.where(values > 0, values / rep, values * rep) - pres - freq
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
