"""The engine's one record of a job (`JobRecord`), from `enqueue` to its final result.

A record is what the sampler reads of a job (it is a `SampleRequest`: settings, seed, RNG
counter, history, sampler state, this step's allowed tokens, extra outputs) plus what the
generator keeps beside the scheduler's page state: the job's text stream, its constraint
matcher, tokens banned at a position after a banned-string rewind, its timings, and the
formatting of its results. Pure Python: the stream and the matcher are objects of the text
layer, used through the small protocols below.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol

from dyngen_core.engine.job import Job
from dyngen_core.engine.plan import SampledTokens
from dyngen_core.engine.results import EosReason, Result
from dyngen_core.engine.settings import SamplerSettings, SamplerState
from dyngen_core.errors import JobError

_NONE: frozenset[int] = frozenset()


class RequestTraits(NamedTuple):
    """A settings object's facts the sampler reads per row (see `SampleRequest.traits`)."""

    settings: SamplerSettings
    stages: frozenset[str]
    is_greedy: bool
    top_k: int
    mirostat: bool
    dynamic_temperature: bool


@dataclass(eq=False)
class SampleRequest:
    """What the sampler reads of one job in a sampling call (compared by identity).

    A request owns one or more consecutive logits rows: row 0 predicts the job's next token;
    with drafts, row ``j`` predicts the token after ``draft_ids[:j]`` (its history is the job's
    history plus those drafts, and its RNG counter is ``counter + j``).

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
    draft_probs: when the drafts were sampled from a draft distribution, that distribution at
        each draft (a ``[len(draft_ids), vocab]`` probability tensor) for the verify step's
        accept rule; None for deterministic drafts (accepted when they equal the draw).
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
    draft_probs: Any = None
    return_probs: bool = False
    return_top_tokens: int = 0
    return_logits: bool = False

    _traits: RequestTraits | None = field(default=None, init=False, repr=False)

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

    def row_history(self, row: int) -> Sequence[int]:
        """History seen by row ``row`` (the job's history plus the drafts before it)."""
        if row == 0:
            return self.history
        return list(self.history) + list(self.draft_ids[:row])


class TextStream(Protocol):
    """What a record uses of its job's text pipeline (`dyngen_core.text.stream.JobStream`)."""

    @property
    def stop_token_ids(self) -> frozenset[int]: ...

    @property
    def completion(self) -> str: ...

    @property
    def released_tokens(self) -> int: ...

    def advance(self, token_id: int) -> Any: ...

    def cancel_text(self) -> str: ...


@dataclass(eq=False, kw_only=True)
class JobRecord(SampleRequest):
    """Everything the engine keeps of one job besides the scheduler's page state.

    job: the user's `Job` (its ``job_id`` is set).
    stream: the job's text pipeline (detokenizer, stop and banned strings).
    matcher: the job's constraint matcher (`dyngen_core.text.constraints`), or None.
    speculative: the generator has a drafter and the job did not opt out; the job then drafts
        (``drafting``) unless it uses mirostat (its state moves with every token) or asks for
        extra outputs.
    The sampling fields are `SampleRequest`'s; ``history`` starts as the prompt when a stage
    reads it, and the extra outputs follow the job's ``return_*`` options.
    """

    job: Job
    stream: TextStream
    matcher: Any = None
    speculative: bool = False
    banned_at: dict[int, set[int]] = field(default_factory=dict)
    time_enqueued: float = field(default_factory=time.perf_counter)
    time_started: float | None = None
    time_first_token: float | None = None
    # Set when the generator ends the job (it is then out of its records).
    ended: bool = field(default=False, init=False)
    # A job with banned strings streams a token only once its stream settles it
    # (`TextStream.released_tokens`): until then a rewind may take it back. ``held_tokens``:
    # the sampled tokens after the ``tokens_out`` streamed ones, each with its extra outputs.
    held_tokens: list[tuple[int, SampledTokens | None]] = field(default_factory=list,
                                                                init=False)
    tokens_out: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        job = self.job
        if job.job_id is None:
            raise JobError(f"{job!r} has no job id yet; the generator assigns one at enqueue")
        self.job_id: int = job.job_id
        self.return_probs = job.return_probs
        self.return_top_tokens = job.return_top_tokens
        self.return_logits = job.return_logits
        stages = self.settings.active_stages()
        # Settings are frozen: decide once whether the sampler must see the token history
        # (only penalties and DRY read it). Then ``history`` holds the prompt and the accepted
        # tokens; else it stays empty (nothing reads it), saving an append per token.
        self.wants_extras = bool(job.return_probs or job.return_top_tokens or job.return_logits)
        self.drafting = bool(self.speculative and not self.settings.mirostat
                             and not self.wants_extras)
        # Drafters read the history too (an n-gram index, a draft model's catch-up).
        self.needs_history = bool(stages & {"penalties", "dry"}) or self.drafting
        self.history: list[int] = list(job.input_ids) if self.needs_history else []
        # Only banned strings (their rewinds) and min_new_tokens (stop tokens before it) ever
        # ban a token at a position.
        self.may_ban = bool(job.banned_strings
                            or (job.min_new_tokens and self.stream.stop_token_ids))
        # Its tokens wait in ``held_tokens`` until the stream settles them.
        self.holds_tokens = bool(job.banned_strings)
        # A plain stream's accepted token needs no constraint check, its result no extras, and
        # is streamed at once.
        self.plain_stream = (self.matcher is None and not self.wants_extras
                             and not self.holds_tokens)
        # Its token may be chosen on the device and read a step later.
        self.launchable = self.plain_stream and not self.may_ban
        # Its token is always the argmax of its logits row: no stage, mask or extra output.
        self.plain_greedy = bool(self.settings.is_greedy and not stages and self.launchable)

    def banned_now(self, ahead: int = 0) -> AbstractSet[int]:
        """Token ids forbidden at the next position, or ``ahead`` positions after it (a
        verify step's draft rows): banned-string rewinds, min_new_tokens."""
        generated = len(self.job.new_token_ids) + ahead
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
        """A "streaming" result of one step carrying one token. ``tokens`` holds the extra
        outputs; None only when none was asked for."""
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
