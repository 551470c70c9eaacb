"""Per-row bookkeeping shared by the stages: which request a logits row belongs to, and helpers
that run a stage on a subset of rows (rows that do not use a stage are left untouched)."""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from dyngen_core.sampling.request import SampleRequest
from dyngen_core.settings import SamplerSettings


@dataclass
class Row:
    """One logits row: its request, its place in that request, and what it needs."""

    request: int
    offset: int
    settings: SamplerSettings
    seed: int
    counter: int
    stages: frozenset[str]


def expand_rows(requests: Sequence[SampleRequest], seeds: random.Random) -> list[Row]:
    """One `Row` per logits row; requests without a seed get a fresh one from ``seeds``."""
    rows: list[Row] = []
    for i, req in enumerate(requests):
        if req.settings.mirostat and req.num_rows > 1:
            raise ValueError(
                f"request {i}: mirostat needs one row per step (its mu depends on the previous "
                "token); do not attach draft tokens to mirostat jobs"
            )
        if req.allowed_tokens is not None and req.num_rows > 1:
            if getattr(req.allowed_tokens, "ndim", 1) != 2:
                raise ValueError(
                    f"request {i}: with draft tokens, allowed_tokens needs one mask per row "
                    f"(shape [{req.num_rows}, words])"
                )
        seed = req.seed if req.seed is not None else seeds.getrandbits(63)
        stages = req.active_stages()
        for j in range(req.num_rows):
            rows.append(Row(i, j, req.settings, seed, req.counter + j, stages))
    return rows


def rows_using(rows: Sequence[Row], stage: str) -> list[int]:
    return [i for i, r in enumerate(rows) if stage in r.stages]


def on_rows(
    x: torch.Tensor, picked: Sequence[int], fn: Callable[[torch.Tensor], torch.Tensor]
) -> None:
    """``x[picked] = fn(x[picked])`` in place (no gather when every row is picked)."""
    if not picked:
        return
    if len(picked) == x.shape[0]:
        out = fn(x)
        if out is not x:
            x.copy_(out)
        return
    index = torch.tensor(list(picked), dtype=torch.int64, device=x.device)
    x.index_copy_(0, index, fn(x.index_select(0, index)))


def column(
    values: Sequence[float], device: torch.device, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Per-row parameters as a ``[rows, 1]`` tensor on ``device``."""
    return torch.tensor(list(values), dtype=dtype, device=device).unsqueeze(1)
