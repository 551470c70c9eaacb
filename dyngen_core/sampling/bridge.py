"""`SamplingBridge`: between the generator's active jobs and the batched `Sampler`.

It resolves a job's settings and seed when the job is enqueued, builds one `SampleRequest` per
sampling slice (history only for jobs whose stages read it, masks from constraints and banned
positions; built once per job and never given other settings, seed or outputs, so the sampler
reuses its rows for them: ``kept``), and turns the sampler's results into one token per job
(`StepTokens`; the probabilities and such that a job asked for travel as `SampledTokens`). A
batch of plain greedy jobs (see `ActiveJob.plain_greedy`) skips requests and results:
`sample_plain`.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from operator import is_
from typing import Any

import numpy as np
import torch

from dyngen_core.engine.job import Job
from dyngen_core.engine.plan import SampledTokens
from dyngen_core.engine.settings import SamplerSettings
from dyngen_core.errors import JobError
from dyngen_core.model import Model
from dyngen_core.runtime.active_job import ActiveJob
from dyngen_core.sampling.request import SampleRequest, SamplingError
from dyngen_core.sampling.sampler import Sampler
from dyngen_core.text.constraints.compiler import ConstraintCompiler, mask_words
from dyngen_core.text.detokenize import TokenPieces
from dyngen_core.text.stop import StopIndexes
from dyngen_core.text.stream import JobStream
from dyngen_core.text.tokenizer import Tokenizer


@dataclass
class StepTokens:
    """What sampling gave one step.

    tokens: the token of each sampling job, in the order the jobs were given (-1 for a job in
        ``failed``).
    extras: job id -> `SampledTokens` with the probabilities, top tokens or logits, for the jobs
        that asked for them.
    failed: job id -> why its row could not be sampled.
    """

    tokens: list[int]
    extras: dict[int, SampledTokens] = field(default_factory=dict)
    failed: dict[int, Exception] = field(default_factory=dict)


class SamplingBridge:
    """Builds sampler requests for active jobs and samples their logits rows."""

    def __init__(self, model: Model, tokenizer: Tokenizer) -> None:
        self.vocab_size = model.config.vocab_size
        self.tokenizer = tokenizer
        self.eos_token_ids = frozenset(tokenizer.eos_token_ids) | frozenset(
            model.config.eos_token_ids
        )
        # Shared by every job's detokenizer: each token's text, decoded once.
        self.pieces = TokenPieces.for_tokenizer(tokenizer)
        # Shared by every job's stop matcher: which texts pass each set of stop strings.
        self.stop_indexes = StopIndexes()
        self._constraint_compiler: ConstraintCompiler | None = None
        self._mask_thread = ThreadPoolExecutor(1, thread_name_prefix="dyngen-masks")
        # The jobs of the last `launch` and their requests, until a `sample` changes requests.
        self._launched: Sequence[ActiveJob] | None = None
        self._launched_requests: list[SampleRequest] = []
        # The last lists `all_plain` passed and `start_masks` found without a constraint.
        self._plain_list: Sequence[ActiveJob] | None = None
        self._unconstrained_list: Sequence[ActiveJob] | None = None
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
        active = ActiveJob(
            job=job,
            stream=JobStream(job, self.tokenizer, frozenset(stops), self.pieces,
                             self.stop_indexes),
            settings=settings,
            seed=job.seed if job.seed is not None else fallback_seed,
            matcher=None if job.constraint is None else self._compiler().matcher(job.constraint),
        )
        # Built once and updated in place: its counter is the job's count of draws, and its
        # history and state are the record's own list and object.
        active.request = SampleRequest(
            settings=settings,
            seed=active.seed,
            history=active.history if active.needs_history else (),
            state=active.state,
            return_probs=job.return_probs,
            return_top_tokens=job.return_top_tokens,
            return_logits=job.return_logits,
        )
        return active

    def _compiler(self) -> ConstraintCompiler:
        # Built on first use: it indexes the whole vocabulary once for every later job.
        if self._constraint_compiler is None:
            self._constraint_compiler = ConstraintCompiler.from_tokenizer(
                self.tokenizer, self.vocab_size
            )
        return self._constraint_compiler

    def start_masks(self, active: Sequence[ActiveJob]) -> Future[np.ndarray] | None:
        """Start computing the constrained jobs' token masks on a helper thread, so the grammar
        engine (which releases the GIL) works while the forward runs. The last list found
        without a constraint is remembered (a job's matcher never changes)."""
        if active is self._unconstrained_list:
            return None
        matchers = [a.matcher for a in active]
        if matchers.count(None) == len(matchers):
            self._unconstrained_list = active
            return None
        compiler = self._compiler()
        bitmask = compiler.new_bitmask(len(active))
        return self._mask_thread.submit(_fill, compiler, matchers, bitmask)

    def all_plain(self, active: Sequence[ActiveJob]) -> bool:
        """Whether every job is ``plain_greedy`` (then `sample_plain` may sample them). The
        last list found so is remembered (``plain_greedy`` never changes): the caller must not
        change a list it passed."""
        if active is self._plain_list:
            return True
        for a in active:
            if not a.plain_greedy:
                return False
        self._plain_list = active
        return True

    def sample_plain(self, logits: torch.Tensor, active: Sequence[ActiveJob]) -> list[int] | None:
        """The fast path of `sample` when `all_plain` holds: the jobs' tokens, in order, from one
        argmax and one small copy, with no per-job request or result. None when a row cannot be
        sampled: then call `sample`, which reports the failed jobs."""
        if logits.shape[0] != len(active):
            raise ValueError(f"{logits.shape[0]} logits rows for {len(active)} sampling jobs")
        try:
            tokens = self.sampler.greedy_ids(logits)
        except SamplingError:
            return None
        for a in active:
            a.request.counter += 1
        return tokens

    def launch_plain(self, logits: torch.Tensor,
                     active: Sequence[ActiveJob]) -> tuple[torch.Tensor, torch.Tensor]:
        """`sample_plain` left on the device for an overlapped step: (each row's argmax, what
        the next step reads; the same with -1 for rows without a finite logit, what goes to the
        host), see `Sampler.greedy_on_device`. The caller counts the draws (each job's
        ``request.counter``) when it takes the tokens."""
        if logits.shape[0] != len(active):
            raise ValueError(f"{logits.shape[0]} logits rows for {len(active)} sampling jobs")
        return self.sampler.greedy_on_device(logits)

    def sample(self, logits: torch.Tensor, active: Sequence[ActiveJob],
               masks: Future[np.ndarray] | None = None) -> StepTokens:
        """Sample one token for each active job (logits rows in the same order). A job whose
        row cannot be sampled (every token masked out) gets an exception instead."""
        self._launched = None  # the requests' masks change here: `launch` sets them again
        bitmask = masks.result() if masks is not None else None
        requests = self._requests(active, bitmask)
        rows = list(range(len(active)))
        failed: dict[int, Exception] = {}
        while rows:
            try:
                if failed:
                    ids, full = self.sampler.sample_tokens(
                        logits[rows], [requests[i] for i in rows], kept=True)
                else:
                    ids, full = self.sampler.sample_tokens(logits, requests, kept=True)
                break
            except SamplingError as exc:
                bad = {rows[i] for i in exc.request_indices}
                failed.update({active[i].job_id: exc for i in bad})
                rows = [i for i in rows if i not in bad]
        else:
            ids, full = [], {}
        out = StepTokens(ids, failed=failed)
        if failed:
            out.tokens = [-1] * len(active)
            for i, token in zip(rows, ids):
                out.tokens[i] = token
        for a in active if not failed else [active[i] for i in rows]:
            a.request.counter += 1
        for k, r in full.items():
            a = active[rows[k]]
            out.extras[a.job_id] = SampledTokens(
                job_id=a.job_id, token_ids=r.token_ids, probs=r.token_probs,
                top_k_tokens=r.top_k_tokens, top_k_probs=r.top_k_probs, logits=r.logits,
            )
        return out

    def launch(self, logits: torch.Tensor, active: Sequence[ActiveJob]) -> torch.Tensor | None:
        """The jobs' tokens chosen on the device and not waited for (`Sampler.launch_tokens`:
        int64 ``[jobs]``, -1 for a job whose row has no allowed token), for a step whose
        host work overlaps the next forward. None, with nothing drawn, when a job cannot take
        part: it has a constraint, may ban a token at a position (banned strings,
        min_new_tokens), asks for extra outputs or uses mirostat; `sample` it then. The caller
        adds 1 to each job's ``request.counter`` once the tokens are taken, as `sample` does,
        and does not change ``active`` afterwards (it is remembered)."""
        launched = self._launched
        if launched is not active and (launched is None or len(launched) != len(active)
                                       or not all(map(is_, active, launched))):
            requests = self._launch_requests(active)
            if requests is None:
                return None
            self._launched, self._launched_requests = active, requests
        # Else the same jobs as the last launch and no `sample` since: their requests are as
        # that launch left them (counters live in the requests, and launchable never changes).
        # A job's request keeps its settings, seed and outputs: `kept` rows are reused.
        return self.sampler.launch_tokens(logits, self._launched_requests, kept=True)

    def _launch_requests(self, active: Sequence[ActiveJob]) -> list[SampleRequest] | None:
        """The jobs' requests without a mask (what `_requests(active, None)` gives them), or
        None when one is not ``launchable``."""
        requests: list[SampleRequest] = []
        append = requests.append
        for a in active:
            if not a.launchable:
                self._launched = None
                return None
            request = a.request
            request.allowed_tokens = None  # a `sample` with constraint masks may have set one
            append(request)
        return requests

    def _requests(self, active: Sequence[ActiveJob],
                  bitmask: np.ndarray | None) -> list[SampleRequest]:
        """Each job's `SampleRequest`, updated for this step."""
        if bitmask is not None:
            # Only a constrained job's row is its mask: the others are left zero by the fill.
            return [self._request(a, None if a.matcher is None else bitmask[i])
                    for i, a in enumerate(active)]
        requests: list[SampleRequest] = []
        append = requests.append
        for a in active:
            request = a.request
            if a.may_ban:
                request.allowed_tokens = self._allowed(a, None)
            else:  # what `_allowed` finds, without asking
                request.allowed_tokens = None
            append(request)
        return requests

    def _request(self, a: ActiveJob, constraint_mask: np.ndarray | None) -> SampleRequest:
        """The job's request with this step's allowed tokens."""
        request = a.request
        if constraint_mask is None and not a.may_ban:
            request.allowed_tokens = None  # what _allowed finds, without asking
        else:
            request.allowed_tokens = self._allowed(a, constraint_mask)
        return request

    def _allowed(self, a: ActiveJob, constraint_mask: np.ndarray | None) -> np.ndarray | None:
        """The job's packed allowed-token bitmask: its constraint's, minus tokens banned at
        this position (banned-string rewinds, stop tokens before min_new_tokens)."""
        banned = a.banned_now()
        if constraint_mask is None and not banned:
            return None
        if constraint_mask is None:
            # Bits past vocab_size may stay set: the sampler never samples those columns.
            mask = np.full(mask_words(self.vocab_size), -1, dtype=np.int32)
        else:
            mask = constraint_mask.copy()
        words = mask.view(np.uint32)
        for t in banned:
            words[t >> 5] &= ~np.uint32(1 << (t & 31))
        return mask


def _fill(compiler: ConstraintCompiler, matchers: list[Any], bitmask: np.ndarray) -> np.ndarray:
    compiler.fill_bitmasks(matchers, bitmask)
    return bitmask


def _token_pieces(tokenizer: Tokenizer, vocab_size: int) -> list[str]:
    """Each token's text, for DRY's string sequence breakers and XTC's protected tokens."""
    return [tokenizer.decode([i], decode_special_tokens=True) for i in range(vocab_size)]
