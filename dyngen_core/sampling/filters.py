"""Distribution-shaping stages over logits rows (removed tokens are ``-inf``).

Each function takes the logits of the rows that use the stage, ``x`` ``[rows, vocab]``, and its
per-row parameters as ``[rows, 1]`` tensors, and edits ``x`` in place (returning it).
Truncation filters only ever remove tokens, always keep the most likely one, and keep every
token tied with the cut-off (so results never depend on how a sort breaks ties). Definitions:

- temperature: ``x / T``. Dynamic temperature: ``T = min + (max - min) * (H / log n) ** exp``,
  H the entropy of ``softmax(x)`` over its n candidates (ExLlamaV2).
- top_k: keep tokens whose logit is at least the k-th largest.
- top_p: keep the most likely tokens until their mass reaches p (a token is kept when the mass
  of the tokens more likely than it is below p; Hugging Face's rule).
- min_p: drop ``p < min_p * p_max``. top_a: drop ``p < top_a * p_max ** 2``.
- typical: Hugging Face's TypicalLogitsWarper (sort by ``|-log p - H|``, keep until the mass
  reaches the target).
- tfs: tail-free sampling (Hugging Face / ExLlamaV2): normalized absolute second differences of
  the sorted probabilities, keep ``1 + #(cumsum <= z)`` tokens, never the last candidate.
- xtc: drop every token with ``p >= threshold`` (protected tokens aside) except the least likely
  of them, when at least two qualify (the coin flip happens on the host).
- mirostat (v2): drop tokens with ``-log2 p > mu`` (the most likely token always stays).
"""

from __future__ import annotations

import math

import torch

_NEG_INF = float("-inf")


def _probs(x: torch.Tensor) -> torch.Tensor:
    return torch.softmax(x, dim=-1)


def _drop(x: torch.Tensor, remove: torch.Tensor) -> torch.Tensor:
    return x.masked_fill_(remove, _NEG_INF)


def candidate_bound(x: torch.Tensor, bound: int) -> int:
    """A bound on any row's surviving tokens: ``bound`` when it is known (top_k ran); on the
    CPU, where a host sync is free, the largest count of finite logits."""
    if bound >= x.shape[-1] and x.device.type == "cpu":
        return max(int(torch.isfinite(x).sum(-1).max()), 1)
    return bound


def descending(values: torch.Tensor, bound: int) -> torch.Tensor:
    """The ``bound`` largest values per row, largest first (a top-k when it is cheaper than a
    full sort)."""
    if bound < values.shape[-1] // 4:
        return torch.topk(values, bound, dim=-1, sorted=True).values
    return torch.sort(values, dim=-1, descending=True).values[:, :bound]


def temperature(x: torch.Tensor, temp: torch.Tensor) -> torch.Tensor:
    return x.div_(temp)


def dynamic_temperature(
    x: torch.Tensor, min_temp: torch.Tensor, max_temp: torch.Tensor, exponent: torch.Tensor
) -> torch.Tensor:
    logp = torch.log_softmax(x, dim=-1)
    p = logp.exp()
    entropy = -torch.where(p > 0, p * logp, torch.zeros_like(p)).sum(-1, keepdim=True)
    candidates = torch.isfinite(x).sum(-1, keepdim=True).float()
    max_entropy = candidates.log().clamp_min(1e-6)
    normalized = (entropy / max_entropy).clamp(0.0, 1.0)
    temp = min_temp + (max_temp - min_temp) * normalized.pow(exponent)
    return x.div_(temp.clamp_min(1e-4))


def top_k(x: torch.Tensor, k: torch.Tensor, k_max: int) -> torch.Tensor:
    """k: int64 ``[rows, 1]`` (each at most ``k_max``)."""
    k_max = min(k_max, x.shape[-1])
    kth = descending(x, k_max).gather(1, (k.clamp(1, k_max) - 1))
    return _drop(x, x < kth)


def top_p(x: torch.Tensor, p_target: torch.Tensor, bound: int) -> torch.Tensor:
    """bound: an upper bound on any row's candidate count (vocab size when unknown)."""
    p = _probs(x)
    if bound >= x.shape[-1] and x.device.type == "cpu":
        # A token with p < (1 - top_p) / vocab always has more than top_p of the mass ahead
        # of it, so it is cut: only the rest need sorting (a host sync, free on the CPU).
        floor = (1.0 - p_target) / x.shape[-1]
        bound = max(int((p >= floor).sum(-1).max()), 1)
    sorted_p = descending(p, bound)
    before = sorted_p.cumsum(-1) - sorted_p
    keep = (before < p_target).sum(-1, keepdim=True).clamp_min(1)
    cut = sorted_p.gather(1, keep - 1)
    return _drop(x, p < cut)


def min_p(x: torch.Tensor, ratio: torch.Tensor) -> torch.Tensor:
    p = _probs(x)
    return _drop(x, p < ratio * p.amax(-1, keepdim=True))


def top_a(x: torch.Tensor, ratio: torch.Tensor) -> torch.Tensor:
    p = _probs(x)
    p_max = p.amax(-1, keepdim=True)
    return _drop(x, (p < ratio * p_max * p_max) & (p < p_max))


def typical(x: torch.Tensor, mass: torch.Tensor, bound: int) -> torch.Tensor:
    """bound: an upper bound on any row's candidate count (only those are sorted)."""
    logp = torch.log_softmax(x, dim=-1)
    p = logp.exp()
    entropy = -torch.where(p > 0, p * logp, torch.zeros_like(p)).sum(-1, keepdim=True)
    deviation = (-logp - entropy).abs()  # inf for removed tokens
    bound = candidate_bound(x, bound)
    if bound < x.shape[-1] // 4:
        candidates = torch.topk(x, bound, dim=-1).indices
        sorted_dev, order = torch.sort(deviation.gather(1, candidates), dim=-1)
        order = candidates.gather(1, order)
    else:
        sorted_dev, order = torch.sort(deviation, dim=-1)
    cumulative = p.gather(1, order).cumsum(-1)
    last = (cumulative < mass).sum(-1, keepdim=True).clamp_max(sorted_dev.shape[-1] - 1)
    return _drop(x, deviation > sorted_dev.gather(1, last))


def tail_free(x: torch.Tensor, z: torch.Tensor, bound: int) -> torch.Tensor:
    p = _probs(x)
    sorted_p = descending(p, candidate_bound(x, bound))
    n = (sorted_p > 0).sum(-1, keepdim=True)
    if sorted_p.shape[-1] < 3:
        return x
    d2 = (sorted_p[:, :-2] - 2 * sorted_p[:, 1:-1] + sorted_p[:, 2:]).abs()
    index = torch.arange(d2.shape[-1], device=x.device).unsqueeze(0)
    d2 = torch.where(index < n - 2, d2, torch.zeros_like(d2))
    total = d2.sum(-1, keepdim=True)
    cdf = (d2 / total.clamp_min(1e-30)).cumsum(-1)
    below = ((cdf <= z) & (index < n - 2)).sum(-1, keepdim=True)
    keep = torch.minimum(below + 1, n - 1).clamp_min(1)
    cut = sorted_p.gather(1, keep - 1)
    applies = (n >= 3) & (total > 0)
    return _drop(x, (p < cut) & applies)


def xtc(x: torch.Tensor, threshold: torch.Tensor, protected: torch.Tensor) -> torch.Tensor:
    """protected: bool ``[vocab]``, tokens XTC never removes (newlines, EOS)."""
    p = _probs(x)
    above = (p >= threshold) & ~protected
    count = above.sum(-1, keepdim=True)
    least = torch.where(above, p, torch.full_like(p, math.inf)).amin(-1, keepdim=True)
    return _drop(x, above & (p > least) & (count >= 2))


def mirostat(x: torch.Tensor, mu: torch.Tensor) -> torch.Tensor:
    p = _probs(x)
    target = torch.exp2(-mu)
    return _drop(x, (p < target) & (p < p.amax(-1, keepdim=True)))
