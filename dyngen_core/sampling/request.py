"""What the sampler gives back per job (`SampleResult`), and `SamplingError`.

What it takes per job is a `dyngen_core.engine.record.SampleRequest` (the engine's job records
are requests themselves).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from dyngen_core.errors import DynGenError

if TYPE_CHECKING:
    import torch


class SamplingError(DynGenError, ValueError):
    """A request cannot be sampled (e.g. every token is banned or masked out).

    ``request_indices`` lists the offending requests, so the caller can fail those jobs and
    sample the others again."""

    def __init__(self, message: str, request_indices: Sequence[int]) -> None:
        super().__init__(message)
        self.request_indices = list(request_indices)


@dataclass
class SampleResult:
    """What sampling produced for one request, one entry per row (tensors on the CPU).

    token_ids: the chosen token of each row.
    token_probs: ``[rows]`` float32, each chosen token's probability in the distribution it was
        drawn from (greedy rows: the softmax of their edited logits at temperature 1), when
        ``return_probs``.
    top_k_tokens / top_k_probs: ``[rows, k]`` int64 / float32, the k most likely tokens of that
        same distribution, most likely first, when ``return_top_tokens``.
    logits: ``[rows, vocab]`` float32 raw logits, when ``return_logits``.
    """

    token_ids: list[int]
    token_probs: torch.Tensor | None = None
    top_k_tokens: torch.Tensor | None = None
    top_k_probs: torch.Tensor | None = None
    logits: torch.Tensor | None = None

    @property
    def token_id(self) -> int:
        """The token of row 0 (the only row without drafts)."""
        return self.token_ids[0]
