"""The compact draw: every row sampled with a top_k, so only each row's top ``max(top_k)``
logits can ever be drawn. One top-k over the (edited) logits, then temperature, top_k, the tail
stages and the Gumbel draw all run on ``[rows, bound]`` values, never on the full vocabulary.

The full-width path (`shaping.shape_distribution` then `draw.choose`) divides every logit by the
temperature, masks the vocabulary below the k-th value, writes the compacted tail back and takes
another top-k to draw: about eight passes over ``[rows, vocab]``. Here it is one top-k. The
distribution is the same: temperature scales a row without reordering it, so the top ``bound``
of ``x / T`` are the top ``bound`` of ``x`` divided by ``T`` (bit for bit: the same division),
and the other tokens are removed by top_k anyway. The only difference is which of several
tokens tied at the ``bound``-th place is kept, as when the full-width path compacts (see
`shaping`), here before dividing instead of after.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from dyngen_core.sampling import filters
from dyngen_core.sampling.request import SampleRequest
from dyngen_core.sampling.rng import gumbel_noise
from dyngen_core.sampling.rows import RowList, column, on_rows, rows_using
from dyngen_core.sampling.shaping import shape_tail, temperature_stage
from dyngen_core.sampling.vocab import VocabTables


def compact_bound(rows: RowList, width: int, vocab_size: int) -> int:
    """The candidate count of the compact draw, or 0 when it does not apply: some row is greedy,
    has no top_k or takes a dynamic temperature before top_k (it reads the whole row's
    entropy), or the bound is not much below the width."""
    bound = min(rows.top_k_bound, vocab_size)
    if not bound or len(rows.sampled) != len(rows) or bound >= width // 4 \
            or rows.any_early_dynamic_temperature:
        return 0
    return bound


def draw_compact(
    x: torch.Tensor,
    rows: RowList,
    requests: Sequence[SampleRequest],
    vocab: VocabTables,
    keys: torch.Tensor,
    bound: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Stages 4-14 on the top ``bound`` columns of the edited logits ``x`` ``[rows, vocab]``
    (not modified). Returns ``(values, token_ids, pick)``: the shaped candidate logits
    ``[rows, bound]`` float32 (removed ones ``-inf``), their token ids, and the column drawn in
    each row ``[rows, 1]``."""
    values, token_ids = torch.topk(x, bound, dim=-1)
    values = values.to(torch.float32)
    temperature_stage(values, rows, "temperature")
    picked = rows_using(rows, "top_k")
    ks = [rows[i].settings.top_k for i in picked]
    on_rows(values, picked, lambda sub: filters.top_k(
        sub, column(ks, x.device, torch.int64), max(ks)))
    shape_tail(values, rows, requests, vocab, token_ids)
    pick = (values + gumbel_noise(keys, token_ids)).argmax(-1, keepdim=True)
    return values, token_ids, pick


def full_rows(values: torch.Tensor, token_ids: torch.Tensor, width: int) -> torch.Tensor:
    """The ``[rows, width]`` logits the full-width path would end with: ``values`` at their
    tokens, ``-inf`` elsewhere (for probabilities and top tokens, which read whole rows)."""
    full = torch.full((values.shape[0], width), float("-inf"), dtype=values.dtype,
                      device=values.device)
    return full.scatter_(1, token_ids, values)


def fetch_compact(values: torch.Tensor, pick: torch.Tensor,
                  choice: torch.Tensor) -> tuple[list[int], list[bool]]:
    """One transfer: each row's chosen token (``choice``) and whether its chosen logit (column
    ``pick`` of ``values``) is finite, as `draw.fetch_choices` reports them."""
    finite = torch.isfinite(values.gather(1, pick).squeeze(1))
    flat = torch.cat([choice.to(torch.float64), finite.to(torch.float64)]).tolist()
    n = values.shape[0]
    return [int(v) for v in flat[:n]], [v > 0 for v in flat[n:]]
