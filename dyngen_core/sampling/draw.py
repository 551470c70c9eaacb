"""The final draw, and what crosses back to the host.

Greedy rows take the argmax of their edited logits. Other rows take
``argmax(logit + gumbel(seed, counter, token))`` (`dyngen_core.sampling.rng`) over their
candidates: the noise of a token does not depend on which other tokens are looked at, so the
draw may be restricted to a superset of the surviving tokens (the top-k when every row has a
top_k; on the CPU, where a host sync is free, the largest number of surviving tokens).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from dyngen_core.sampling.rng import perturb


def _rows_of(x: torch.Tensor, rows: Sequence[int]) -> tuple[torch.Tensor | None, torch.Tensor]:
    if len(rows) == x.shape[0]:
        return None, x
    index = torch.tensor(list(rows), dtype=torch.int64, device=x.device)
    return index, x.index_select(0, index)


def _candidates(sub: torch.Tensor, bound: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits, token ids) of a superset of every row's surviving tokens."""
    width = sub.shape[1]
    if sub.device.type == "cpu" and bound == width:
        bound = max(int(torch.isfinite(sub).sum(-1).max()), 1)
    if bound < width // 2:
        return torch.topk(sub, bound, dim=-1)
    return sub, torch.arange(width, device=sub.device).expand_as(sub)


def choose(
    x: torch.Tensor,
    sampled_rows: Sequence[int],
    keys: torch.Tensor | None,
    candidate_bound: int,
) -> torch.Tensor:
    """Chosen token per row, int64 ``[rows]`` on the device.

    sampled_rows: the non-greedy rows, ascending; every other row takes its argmax.
    keys: int64 ``[len(sampled_rows), 2]`` on the device, those rows' `row_key` words (None
        when no row is sampled).
    candidate_bound: most candidates any non-greedy row can have (the width when unknown).
    """
    if not sampled_rows:
        return x.argmax(-1)
    assert keys is not None
    choice = torch.empty(x.shape[0], dtype=torch.int64, device=x.device)
    if len(sampled_rows) < x.shape[0]:
        sampled = set(sampled_rows)
        index, sub = _rows_of(x, [i for i in range(x.shape[0]) if i not in sampled])
        assert index is not None
        choice.index_copy_(0, index, sub.argmax(-1))
    index, sub = _rows_of(x, sampled_rows)
    values, tokens = _candidates(sub, candidate_bound)
    pick = perturb(values, keys, tokens).argmax(-1, keepdim=True)
    picked = tokens.gather(1, pick).squeeze(1)
    if index is None:
        return picked
    choice.index_copy_(0, index, picked)
    return choice


def fetch_choices(
    x: torch.Tensor, choice: torch.Tensor, prob_rows: Sequence[int]
) -> tuple[list[int], list[bool], dict[int, float]]:
    """One device-to-host transfer: the chosen ids, whether each row had any allowed token
    (its chosen logit is finite), and the chosen tokens' probabilities for ``prob_rows``."""
    chosen_logit = x.gather(1, choice.unsqueeze(1)).squeeze(1)
    parts = [choice.to(torch.float64), torch.isfinite(chosen_logit).to(torch.float64)]
    if prob_rows:
        index, sub = _rows_of(x, prob_rows)
        chosen = choice if index is None else choice.index_select(0, index)
        probs = torch.softmax(sub, dim=-1)
        parts.append(probs.gather(1, chosen.unsqueeze(1)).squeeze(1).to(torch.float64))
    flat = torch.cat(parts).tolist()
    n = x.shape[0]
    ids = [int(v) for v in flat[:n]]
    valid = [v > 0 for v in flat[n: 2 * n]]
    return ids, valid, dict(zip(prob_rows, flat[2 * n:], strict=True))


def fetch_top_k(x: torch.Tensor, rows: Sequence[int], k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k token ids (int64) and probabilities (float32) of ``rows``, on the CPU, in one
    transfer."""
    _, sub = _rows_of(x, rows)
    probs = torch.softmax(sub, dim=-1)
    values, tokens = torch.topk(probs, min(k, x.shape[1]), dim=-1)
    packed = torch.cat([tokens.to(torch.float64), values.to(torch.float64)], dim=1).cpu()
    width = values.shape[1]
    return packed[:, :width].to(torch.int64), packed[:, width:].to(torch.float32)
