"""What the sampler takes per job (`SampleRequest`) and gives back (`SampleResult`).

A request owns one or more consecutive logits rows: row 0 predicts the job's next token; with
speculative decoding, row ``j`` predicts the token after ``draft_ids[:j]`` (its history is the
job's history plus those drafts, and its RNG counter is ``counter + j``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

from dyngen_core.engine.settings import SamplerSettings, SamplerState
from dyngen_core.errors import DynGenError
from dyngen_core.sampling import rng

if TYPE_CHECKING:
    import torch


class SamplingError(DynGenError, ValueError):
    """A request cannot be sampled (e.g. every token is banned or masked out).

    ``request_indices`` lists the offending requests, so the caller can fail those jobs and
    sample the others again."""

    def __init__(self, message: str, request_indices: Sequence[int]) -> None:
        super().__init__(message)
        self.request_indices = list(request_indices)


class RequestTraits(NamedTuple):
    """A settings object's facts the sampler reads per row (see `SampleRequest.traits`)."""

    settings: SamplerSettings
    stages: frozenset[str]
    is_greedy: bool
    top_k: int
    mirostat: bool
    dynamic_temperature: bool


@dataclass
class SampleRequest:
    """One job's share of a sampling call.

    settings: the job's `SamplerSettings`.
    seed: the job's seed; None draws a fresh random key per call (not reproducible).
    counter: how many tokens the job has drawn so far. With ``seed``, ``(seed, counter)`` alone
        decides the random draw, whatever else is in the batch. After a rewind, pass a value
        not used before (e.g. the number of sample calls) or the same token is drawn again.
    history: the job's token ids so far (prompt + generated), oldest first. Only penalties and
        DRY read it, and only the window they need is copied to the device.
    state: the job's `SamplerState` (mirostat ``mu``); updated in place after sampling.
    allowed_tokens: the constraint's mask, or None. Either a packed bitmask (int32 numpy array
        or tensor, bit ``i % 32`` of word ``i // 32`` set = token ``i`` allowed; shape
        ``[words]`` or ``[num_rows, words]``) or a bool array/tensor ``[vocab]`` /
        ``[num_rows, vocab]``. Tokens beyond the mask's width are not allowed.
    draft_ids: speculative tokens; the request then owns ``1 + len(draft_ids)`` rows.
    return_probs: also return each chosen token's probability.
    return_top_tokens: also return this many most likely tokens and their probabilities.
    return_logits: also return the raw logits rows (as given to the sampler).
    """

    settings: SamplerSettings
    seed: int | None = None
    counter: int = 0
    history: Sequence[int] = ()
    state: SamplerState = field(default_factory=SamplerState)
    allowed_tokens: Any = None
    draft_ids: Sequence[int] = ()
    return_probs: bool = False
    return_top_tokens: int = 0
    return_logits: bool = False

    _traits: RequestTraits | None = field(default=None, init=False, repr=False, compare=False)
    _seed_key: tuple[int, int] | None = field(default=None, init=False, repr=False,
                                              compare=False)

    @property
    def num_rows(self) -> int:
        return 1 + len(self.draft_ids)

    def traits(self) -> RequestTraits:
        """What the sampler reads of ``settings`` for every row, computed once per settings
        object (a job's request is reused step after step; settings attributes are slow)."""
        traits = self._traits
        if traits is None or traits.settings is not self.settings:
            settings = self.settings
            traits = self._traits = RequestTraits(settings, settings.active_stages(),
                                                  settings.is_greedy, settings.top_k,
                                                  settings.mirostat,
                                                  settings.uses_dynamic_temperature)
        return traits

    def active_stages(self) -> frozenset[str]:
        """``settings.active_stages()`` (see `traits`)."""
        return self.traits().stages

    def seed_key(self, seed: int) -> int:
        """`dyngen_core.sampling.rng.seed_key` of ``seed``, remembered for the last seed asked
        (a job's request keeps its seed, so this is computed once per job)."""
        cached = self._seed_key
        if cached is None or cached[0] != seed:
            cached = self._seed_key = (seed, rng.seed_key(seed))
        return cached[1]

    def row_history(self, row: int) -> Sequence[int]:
        """History seen by row ``row`` (the job's history plus the drafts before it)."""
        if row == 0:
            return self.history
        return list(self.history) + list(self.draft_ids[:row])


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
