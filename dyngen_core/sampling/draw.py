"""The final draw, and what crosses back to the host.

Greedy rows take the argmax of their edited logits. Other rows take
``argmax(logit + gumbel(seed, counter, token))`` (`dyngen_core.sampling.rng`), over the top-k
candidates only when every such row has a top_k (the noise of a token is the same either way).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from dyngen_core.sampling.rng import gumbel_noise


def choose(
    x: torch.Tensor,
    greedy: Sequence[bool],
    keys: Sequence[tuple[int, int]],
    candidate_bound: int,
) -> torch.Tensor:
    """Chosen token per row, int64 ``[rows]`` on the device.

    keys: each row's `row_key` words (used by non-greedy rows only).
    candidate_bound: most candidates any non-greedy row has (the vocab size when unknown).
    """
    device = x.device
    choice = torch.empty(x.shape[0], dtype=torch.int64, device=device)
    greedy_rows = [i for i, g in enumerate(greedy) if g]
    sampled_rows = [i for i, g in enumerate(greedy) if not g]
    if greedy_rows:
        index = torch.tensor(greedy_rows, dtype=torch.int64, device=device)
        choice.index_copy_(0, index, x.index_select(0, index).argmax(-1))
    if sampled_rows:
        index = torch.tensor(sampled_rows, dtype=torch.int64, device=device)
        sub = x.index_select(0, index)
        row_keys = torch.tensor([keys[i] for i in sampled_rows], dtype=torch.int64,
                                device=device)
        if candidate_bound < x.shape[1]:
            values, tokens = torch.topk(sub, candidate_bound, dim=-1)
        else:
            values = sub
            tokens = torch.arange(x.shape[1], device=device).expand_as(sub)
        pick = (values + gumbel_noise(row_keys, tokens)).argmax(-1, keepdim=True)
        choice.index_copy_(0, index, tokens.gather(1, pick).squeeze(1))
    return choice


def fetch_choices(
    x: torch.Tensor, choice: torch.Tensor, prob_rows: Sequence[int]
) -> tuple[list[int], list[bool], dict[int, float]]:
    """One device-to-host transfer: the chosen ids, whether each row had any allowed token,
    and the chosen tokens' probabilities for ``prob_rows``."""
    ok = torch.isfinite(x.amax(-1)).to(torch.float64)
    parts = [choice.to(torch.float64), ok]
    if prob_rows:
        index = torch.tensor(list(prob_rows), dtype=torch.int64, device=x.device)
        probs = torch.softmax(x.index_select(0, index), dim=-1)
        parts.append(probs.gather(1, choice.index_select(0, index).unsqueeze(1)).squeeze(1)
                     .to(torch.float64))
    flat = torch.cat(parts).tolist()
    n = x.shape[0]
    ids = [int(v) for v in flat[:n]]
    valid = [v > 0 for v in flat[n: 2 * n]]
    return ids, valid, dict(zip(prob_rows, flat[2 * n:], strict=True))


def fetch_top_k(x: torch.Tensor, rows: Sequence[int], k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k token ids (int64) and probabilities (float32) of ``rows``, on the CPU, in one
    transfer."""
    index = torch.tensor(list(rows), dtype=torch.int64, device=x.device)
    probs = torch.softmax(x.index_select(0, index), dim=-1)
    values, tokens = torch.topk(probs, min(k, x.shape[1]), dim=-1)
    packed = torch.cat([tokens.to(torch.float64), values.to(torch.float64)], dim=1).cpu()
    width = values.shape[1]
    return packed[:, :width].to(torch.int64), packed[:, width:].to(torch.float32)
