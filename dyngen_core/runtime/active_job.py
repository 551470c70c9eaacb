"""`ActiveJob`: the generator's record of one queued or running job.

It holds what the generator needs beyond the scheduler's sequence state: the job's text stream,
resolved sampling settings, seed and sampler state, the constraint matcher, tokens banned at a
position after a banned-string rewind, and timings. It also formats the job's results.
"""

from __future__ import annotations

import time
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from dyngen_core.engine.job import Job
from dyngen_core.engine.plan import SampledTokens
from dyngen_core.engine.results import EosReason, Result
from dyngen_core.engine.settings import SamplerSettings, SamplerState
from dyngen_core.errors import JobError
from dyngen_core.text.stream import JobStream

if TYPE_CHECKING:
    from dyngen_core.sampling.request import SampleRequest

_NONE: frozenset[int] = frozenset()


@dataclass
class ActiveJob:
    """Per-job generator state (see module docstring)."""

    job: Job
    stream: JobStream
    settings: SamplerSettings
    seed: int
    matcher: Any = None
    state: SamplerState = field(default_factory=SamplerState)
    banned_at: dict[int, set[int]] = field(default_factory=dict)
    time_enqueued: float = field(default_factory=time.perf_counter)
    time_started: float | None = None
    time_first_token: float | None = None
    # The sampler's request for this job, set by `SamplingBridge.activate` and updated in
    # place each step: its ``counter`` counts the job's draws (the RNG counter: a seeded job's
    # tokens depend only on its seed and this count), its history and state are this record's.
    request: SampleRequest = field(init=False, repr=False, compare=False)
    # Set when the generator ends the job (it is then out of its active jobs).
    ended: bool = field(default=False, init=False)

    def __post_init__(self) -> None:
        if self.job.job_id is None:
            raise JobError(f"{self.job!r} has no job id yet; the generator assigns one at enqueue")
        self.job_id: int = self.job.job_id
        job = self.job
        # Settings are frozen: decide once whether the sampler must see the token history
        # (only penalties and DRY read it). Then ``history`` holds the prompt and the accepted
        # tokens; else it stays empty (nothing reads it), saving an append per token.
        self.needs_history = bool(self.settings.active_stages() & {"penalties", "dry"})
        self.history: list[int] = list(job.input_ids) if self.needs_history else []
        self.wants_extras = bool(job.return_probs or job.return_top_tokens or job.return_logits)
        # A plain greedy job's token is always the argmax of its logits row: no stage, mask
        # (no constraint; no banned strings, so no banned positions; no min_new_tokens, so stop
        # tokens are never banned) and no extra output. A batch of them skips the general sampler.
        # Only banned strings (their rewinds) and min_new_tokens ever ban a token at a position,
        # and min_new_tokens only bans stop tokens: with none (lengths forced, as benchmarks
        # do), it bans nothing.
        self.may_ban = bool(job.banned_strings
                            or (job.min_new_tokens and self.stream.stop_token_ids))
        # A plain stream's accepted token needs no constraint check and its result no extras.
        self.plain_stream = self.matcher is None and not self.wants_extras
        # Its token may be chosen on the device and read later (`SamplingBridge.launch`).
        self.launchable = self.plain_stream and not self.may_ban
        self.plain_greedy = bool(
            self.settings.is_greedy and not self.settings.active_stages() and not self.wants_extras
            and self.matcher is None and not self.may_ban
        )

    def banned_now(self) -> AbstractSet[int]:
        """Token ids forbidden at the next position (banned-string rewinds, min_new_tokens)."""
        generated = len(self.job.new_token_ids)
        if not self.banned_at and generated >= self.job.min_new_tokens:
            return _NONE
        banned = set(self.banned_at.get(generated, ()))
        if generated < self.job.min_new_tokens:
            banned |= self.stream.stop_token_ids
        return banned

    def on_token(self, token_id: int) -> Exception | None:
        """Account an accepted token; returns an error if the constraint rejects it."""
        if self.needs_history:
            self.history.append(token_id)
        if self.matcher is not None and not self.matcher.accept(token_id):
            return JobError(f"the constraint rejected token {token_id}: {self.matcher.error}")
        return None

    def on_rewind(self, num_tokens: int, banned_token_id: int | None) -> None:
        """Drop the last ``num_tokens`` accepted tokens (the stream already dropped them)."""
        # The token that triggered the rewind was never passed to on_token.
        undo = num_tokens - 1
        if undo > 0 and self.needs_history:
            del self.history[-undo:]
        self.state.rollback(undo)
        if self.matcher is not None and undo > 0:
            self.matcher.rollback(undo)
        if banned_token_id is not None:
            self.banned_at.setdefault(len(self.job.new_token_ids), set()).add(banned_token_id)

    def end_reason(self, stream_reason: EosReason | None) -> EosReason | None:
        """The job's end after a token, the constraint considered: a complete constraint (only
        EOS may follow) ends the job as a stop; reaching max_new_tokens before the constraint
        is satisfied ends it as "constraint_incomplete"."""
        if self.matcher is None:
            return stream_reason
        if stream_reason is EosReason.MAX_NEW_TOKENS and not self.matcher.is_accepting():
            return EosReason.CONSTRAINT_INCOMPLETE
        if stream_reason is None and self.matcher.is_terminated():
            return EosReason.STOP_TOKEN
        return stream_reason

    def result(self, stage: str, **data: Any) -> Result:
        return Result(job=self.job, identifier=self.job.identifier, stage=stage, eos=False, **data)

    def streaming_result(self, text: str, token_id: int, tokens: SampledTokens | None) -> Result:
        """A "streaming" result of one step carrying one token (what `result` builds, without
        keyword copies). ``tokens`` holds the extra outputs; None only when none was asked for."""
        job = self.job
        data = {"job": job, "identifier": job.identifier, "stage": "streaming", "eos": False,
                "text": text, "token_ids": [token_id]}
        if self.wants_extras:
            assert tokens is not None
            data.update(self.extras(tokens))
        return Result.from_dict(data)

    def extras(self, tokens: SampledTokens) -> dict[str, Any]:
        """The per-token tensors the job asked for."""
        out: dict[str, Any] = {}
        if self.job.return_probs:
            out["token_probs"] = tokens.probs
        if self.job.return_top_tokens:
            out["top_k_tokens"] = tokens.top_k_tokens
            out["top_k_probs"] = tokens.top_k_probs
        if self.job.return_logits:
            out["logits"] = tokens.logits
        return out

    def final_result(self, reason: EosReason, *, chunk: dict[str, Any],
                     error: BaseException | None, cached_tokens: int, page_size: int,
                     accepted: int = 0, rejected: int = 0) -> Result:
        """The job's last result: its last text chunk plus the end-of-job metrics."""
        now = time.perf_counter()
        started = self.time_started if self.time_started is not None else now
        first = self.time_first_token if self.time_first_token is not None else now
        data: dict[str, Any] = {"token_ids": [], **chunk}
        data.update(
            eos_reason=reason,
            full_completion=self.stream.completion,
            new_tokens=len(self.job.new_token_ids),
            prompt_tokens=len(self.job.input_ids),
            cached_tokens=cached_tokens,
            cached_pages=-(-cached_tokens // page_size),
            time_enqueued=started - self.time_enqueued,
            time_prefill=first - started,
            time_generate=now - first,
            accepted_draft_tokens=accepted,
            rejected_draft_tokens=rejected,
        )
        if error is not None:
            data["error"] = error
        return Result(job=self.job, identifier=self.job.identifier, stage="streaming", eos=True,
                      **data)
