"""`SamplingBridge`: between the generator's active jobs and the batched `Sampler`.

It resolves a job's settings and seed when the job is enqueued, builds one `SampleRequest` per
sampling slice (history only for jobs whose stages read it, masks from constraints and banned
positions), and turns the sampler's results into the plan's `SampledTokens`.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from dyngen_core.active_job import ActiveJob
from dyngen_core.errors import JobError
from dyngen_core.job import Job
from dyngen_core.models import Model
from dyngen_core.plan import SampledTokens
from dyngen_core.sampling.request import SampleRequest
from dyngen_core.sampling.sampler import Sampler
from dyngen_core.settings import SamplerSettings
from dyngen_core.streaming import JobStream
from dyngen_core.tokenizer import Tokenizer


class SamplingBridge:
    """Builds sampler requests for active jobs and samples their logits rows."""

    def __init__(self, model: Model, tokenizer: Tokenizer) -> None:
        self.vocab_size = model.config.vocab_size
        self.tokenizer = tokenizer
        self.eos_token_ids = frozenset(tokenizer.eos_token_ids) | frozenset(
            model.config.eos_token_ids
        )
        self.sampler = Sampler(
            self.vocab_size,
            model.device,
            token_pieces=_token_pieces(tokenizer, self.vocab_size),
            eos_token_ids=sorted(self.eos_token_ids),
        )

    def activate(self, job: Job, default_settings: SamplerSettings,
                 fallback_seed: int) -> ActiveJob:
        """Validate a job's sampling options and build its generator record."""
        settings = job.gen_settings if job.gen_settings is not None else default_settings
        if not isinstance(settings, SamplerSettings):
            raise JobError(
                f"gen_settings must be a SamplerSettings; got {type(settings).__name__}"
            )
        settings.check_token_ids(self.vocab_size)
        stops = self.eos_token_ids if job.uses_default_stops else job.stop_token_ids
        matcher = None
        if job.constraint is not None:
            from dyngen_core.constraints import build_matcher

            matcher = build_matcher(job.constraint, self.tokenizer, self.vocab_size)
        return ActiveJob(
            job=job,
            stream=JobStream(job, self.tokenizer, frozenset(stops)),
            settings=settings,
            seed=job.seed if job.seed is not None else fallback_seed,
            matcher=matcher,
            history=list(job.input_ids),
        )

    def sample(self, logits: torch.Tensor, active: Sequence[ActiveJob]) -> list[SampledTokens]:
        """Sample one token for each active job (logits rows in the same order)."""
        requests = [self._request(a) for a in active]
        results = self.sampler.sample(logits, requests)
        out = []
        for a, r in zip(active, results):
            a.draws += 1
            out.append(SampledTokens(
                job_id=a.job_id, token_ids=list(r.token_ids), probs=r.token_probs,
                top_k_tokens=r.top_k_tokens, top_k_probs=r.top_k_probs, logits=r.logits,
            ))
        return out

    def _request(self, a: ActiveJob) -> SampleRequest:
        job = a.job
        return SampleRequest(
            settings=a.settings,
            seed=a.seed,
            counter=a.draws,
            history=a.history if a.needs_history else (),
            state=a.state,
            allowed_tokens=self._allowed(a),
            return_probs=job.return_probs,
            return_top_tokens=job.return_top_tokens,
            return_logits=job.return_logits,
        )

    def _allowed(self, a: ActiveJob) -> np.ndarray | None:
        banned = a.banned_now()
        if a.matcher is None and not banned:
            return None
        if a.matcher is not None:
            mask = a.matcher.allowed_mask()
        else:
            mask = np.ones(self.vocab_size, dtype=bool)
        if banned:
            mask = mask.copy()
            mask[list(banned)] = False
        return mask


def _token_pieces(tokenizer: Tokenizer, vocab_size: int) -> list[str]:
    """Each token's text, for DRY's string sequence breakers and XTC's protected tokens."""
    return [tokenizer.decode([i], decode_special_tokens=True) for i in range(vocab_size)]
