"""`DynamicGenerator`: the one module that wires scheduler, runner, sampler and text streams.

A step is ``schedule -> run -> sample -> apply -> emit`` (`iterate`); with a drafter, the
schedule's decode slices get drafts first and the sample step verifies them (`Speculator`).
The generator keeps one `JobRecord` per job, keyed by job id; page and sequence state belong
to the scheduler, tensors to the cache and runner, the draw to the `StepSampler`, and a step's
results (text streams, job ends, final results) to the `ResultEmitter`. A fault inside a step
fails the jobs of that step and nothing else (`_step_faults`); a fault of one job's text
pipeline ends that job alone.
"""

from __future__ import annotations

import dataclasses
import random
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dyngen_core.config import SchedulerConfig
from dyngen_core.engine.job import Job
from dyngen_core.engine.plan import (
    PENDING_TOKEN,
    WARM_UP_JOB_ID,
    SampledTokens,
    StepOutcome,
    StepPlan,
    warm_up_plans,
)
from dyngen_core.engine.record import JobRecord
from dyngen_core.engine.results import EosReason, GeneratorStats, Result
from dyngen_core.engine.scheduler import Scheduler
from dyngen_core.engine.settings import SamplerSettings
from dyngen_core.errors import JobError, JobTooLargeError
from dyngen_core.kv.attention import AttentionBackend
from dyngen_core.kv.cache import Cache
from dyngen_core.model import Model
from dyngen_core.runtime.emitter import ResultEmitter
from dyngen_core.runtime.generate import run_generate
from dyngen_core.runtime.overlap import InFlight, TokenFeed, token_feed
from dyngen_core.runtime.speculator import Speculator, build_speculator
from dyngen_core.runtime.tensor_parallel import BroadcastRunner, build_runner
from dyngen_core.runtime.workers import TensorParallelWorkers, WorkerSpec, workers_for
from dyngen_core.sampling.step import SampledStep, StepSampler
from dyngen_core.text.detokenize import TokenPieces
from dyngen_core.text.stop import StopIndexes
from dyngen_core.text.stream import JobStream
from dyngen_core.text.tokenizer import Tokenizer


@dataclass
class _Step:
    """What a failing step had planned (set as soon as it is known)."""

    plan: StepPlan | None = None


class DynamicGenerator:
    """Continuous-batching generator over a paged KV cache.

    Args:
        model: a loaded `Model`.
        cache: a `Cache` built for that model.
        tokenizer: the model's `Tokenizer`.
        max_batch_size: most jobs running at once (more wait in the queue).
        max_chunk_size: most prompt tokens prefilled per step across jobs; decodes of running
            jobs share the same forward. On CUDA the generator prefills a chunk of this size
            (into free pages) before any job, so the first large batch runs at full speed.
        dedup: share identical prompt pages among running jobs (prefill them once).
        prompt_cache: keep finished jobs' pages so later prompts with the same prefix reuse them.
        attention_backend: "auto", "sdpa", "triton", "flash" or a backend built with options.
        cuda_graphs: on CUDA, replay captured graphs for decode-only steps (captured here, one
            per batch-size bucket up to max_batch_size).
        compile_decode: run the captured decode step through torch.compile (fuses the small
            kernels of norms and rotary; slower start).
        skinny_matmul_rows: route matrix products of at most this many rows (batch-1 and
            small-batch decode) through the Triton skinny matmul on CUDA, bf16/fp16 (0: off,
            every product is F.linear; None: leave the model's own setting, one row by default);
            see `Model.set_skinny_matmul`.
        overlap_steps: let a step finish on the host during the next step's forward when none
            of its sampling jobs has a constraint, banned string, stop-token ban or extra
            output: its tokens are chosen on the device, the next step reads them there, and
            they are emitted by the next `iterate` (one step later). Other steps run as
            before. Outputs are the same either way.
        draft_model: a smaller model with the target's vocabulary that drafts up to
            ``num_draft_tokens`` tokens per job for the target to verify in one forward
            (speculative decoding): greedily for greedy and seeded jobs, whose output is then
            the same as without drafting; by sampling for unseeded sampled jobs, whose output
            keeps the same distribution. Its cache is ``draft_cache`` (None: one built like the
            target cache, in fp16, with the same pages).
        draft_cache: the draft model's `Cache`: the target cache's page size and page count.
        num_draft_tokens: the most drafts a job offers per step; each job's draft length
            follows its acceptance and the step's measured cost, down to none where drafting
            does not pay.
        use_ngram_draft: draft by prompt lookup (the continuation of the last few tokens'
            previous occurrence in the job's prompt and output) instead of a draft model;
            output is the same as without drafting (vocabularies up to 2,097,151 tokens).
        Speculative decoding needs a target cache without a recent window (fp16, q8, or
        q6/q4 built with ``recent_window=0``). Jobs opt out with ``Job(speculative=False)``;
        jobs with mirostat or extra outputs never draft.

    A model loaded with ``tensor_parallel=N`` is driven from rank 0: build the generator there
    (the attention backend by name) and run `tensor_parallel.serve_tensor_parallel_worker`
    with the same model folder and cache arguments on the other ranks; every step's plan goes
    to them, and `close` stops them. The draft model, if any, runs on rank 0 alone.
    """

    def __init__(
        self,
        model: Model,
        cache: Cache,
        tokenizer: Tokenizer,
        *,
        max_batch_size: int = 256,
        max_chunk_size: int = 2048,
        dedup: bool = True,
        prompt_cache: bool = True,
        attention_backend: str | AttentionBackend = "auto",
        cuda_graphs: bool = True,
        compile_decode: bool = False,
        overlap_steps: bool = True,
        skinny_matmul_rows: int | None = None,
        draft_model: Model | None = None,
        draft_cache: Cache | None = None,
        num_draft_tokens: int = 4,
        use_ngram_draft: bool = False,
    ) -> None:
        if draft_model is not None and draft_model.parallel.size > 1:
            raise ValueError("the draft model runs whole on rank 0: load it without "
                             "tensor_parallel")
        self.model = model
        self.cache = cache
        self.tokenizer = tokenizer
        self._scheduler = Scheduler(cache.config, SchedulerConfig(
            max_batch_size=max_batch_size, max_chunk_size=max_chunk_size, dedup=dedup,
            prompt_cache=prompt_cache))
        self._runner = build_runner(model, cache, attention_backend, cuda_graphs=cuda_graphs,
                                     max_batch_size=max_batch_size, compile_decode=compile_decode,
                                     skinny_matmul_rows=skinny_matmul_rows)
        self._eos_token_ids = frozenset(tokenizer.eos_token_ids) | frozenset(
            model.config.eos_token_ids)
        self._sampler = StepSampler(model.config.vocab_size, model.device, tokenizer,
                                    sorted(self._eos_token_ids))
        self._default_settings = SamplerSettings.from_generation_config(
            model.config.generation_defaults)
        # Shared by every job's text stream: each token's text, and the stop-string tables.
        self._pieces = TokenPieces.for_tokenizer(tokenizer)
        self._stop_indexes = StopIndexes()
        self._overlap = overlap_steps
        self._speculator = build_speculator(
            model, cache, draft_model, draft_cache, num_draft_tokens, use_ngram_draft,
            attention_backend, cuda_graphs, max_batch_size)
        self._in_flight: InFlight | None = None
        self._workers: TensorParallelWorkers | None = None  # set by from_model_dir
        self._records: dict[int, JobRecord] = {}
        self._emitter = ResultEmitter(self._records, self._scheduler, self._speculator,
                                      cache.page_size)
        self._next_job_id = 0
        if model.device.type == "cuda":
            self._warm_up(min(max_chunk_size, model.config.max_position_embeddings))

    @classmethod
    def from_model_dir(cls, model_dir: str | Path, *, cache_tokens: int = 32768,
                       cache_mode: str = "fp16", device: Any = None, dtype: Any = None,
                       progress: bool = False, draft_model_dir: str | Path | None = None,
                       tensor_parallel: int = 1, **options: Any) -> DynamicGenerator:
        """Load model, tokenizer and a cache of ``cache_tokens`` tokens in ``cache_mode``;
        ``draft_model_dir``: also load a draft model from that folder (same device and dtype)
        for speculative decoding. ``options`` are the constructor's keyword arguments.

        tensor_parallel: split the model over that many processes of this host, one per GPU
            (`model.parallel`): this process becomes rank 0 and starts the others
            (`workers.workers_for`); `close` ends them. The draft model stays whole on rank
            0. ValueError, before any process starts, for a value below 1 or one the model
            cannot be split over (heads or intermediate size that do not divide; on CUDA,
            more ranks than visible GPUs)."""
        spec = WorkerSpec(Path(model_dir), device, dtype, cache_tokens, cache_mode)
        with workers_for(tensor_parallel, spec) as workers:
            model = Model.load(model_dir, device=device, dtype=dtype, progress=progress,
                               tensor_parallel=tensor_parallel)
            cache = Cache(model, max_tokens=cache_tokens, mode=cache_mode)
            if draft_model_dir is not None:
                options["draft_model"] = Model.load(draft_model_dir, device=model.device,
                                                    dtype=model.dtype, progress=progress)
            generator = cls(model=model, cache=cache,
                            tokenizer=Tokenizer.from_model_dir(model_dir), **options)
        generator._workers = workers
        return generator

    def _warm_up(self, max_tokens: int) -> None:
        """Run `plan.warm_up_plans` (a prefill of ``max_tokens`` tokens, then one of each short
        length whose launch shape is its own, as the runner names them) into free pages
        before any job, through the draft model too: on CUDA the first prefill of a size pays
        one-time costs (the caching allocator's growth, the matrix library's choices for new
        shapes, kernel compiles) that would otherwise fall on the first batch of that shape
        users send, stalling every running job."""
        for plan in warm_up_plans(max_tokens, self.cache.page_size, self.cache.num_pages,
                                  self._runner.short_prefill_lengths()):
            self._runner.run(plan)
            if self._speculator is not None:
                self._speculator.follow(plan)
                self._speculator.forget(WARM_UP_JOB_ID)

    def close(self) -> None:
        """Stop the tensor-parallel workers of a split model (their loops return; those
        `from_model_dir` started are waited for, and this process leaves the group); a no-op
        for a model in one process. A closed split generator cannot run steps. Workers of a
        group a failed step left out of step (`BroadcastRunner.broken`) are killed at once."""
        broken = False
        if isinstance(self._runner, BroadcastRunner):
            self._runner.close()
            broken = self._runner.broken is not None
        if self._workers is not None:
            workers, self._workers = self._workers, None
            if broken:
                workers.kill()
            else:
                workers.stop()

    # ---- queue -------------------------------------------------------------------------------

    def enqueue(self, job: Job | Sequence[Job]) -> None:
        """Queue one job or a list of jobs. Raises `JobTooLargeError` for a job that can never
        fit in the cache or the model's context, `JobError` for a token id outside the
        vocabulary or another invalid option; nothing of a rejected list is queued."""
        jobs = [job] if isinstance(job, Job) else list(job)
        for j in jobs:
            if not isinstance(j, Job):
                raise TypeError(f"enqueue takes Job objects; got {type(j).__name__}")
            if j.job_id is not None:
                raise JobError(f"{j!r} was already enqueued; build a new Job to run it again")
            self.validate(j)
        added: list[int] = []
        try:
            for j in jobs:
                j.job_id = self._next_job_id
                self._next_job_id += 1
                record = self._record(j)
                speculator = self._speculator
                drafts = speculator.max_draft_tokens if speculator and record.drafting else 0
                self._scheduler.add(j.job_id, j.input_ids, j.max_new_tokens,
                                    num_draft_tokens=drafts)
                added.append(j.job_id)
                self._records[j.job_id] = record
        except BaseException:
            for job_id in added:
                self._scheduler.cancel(job_id)
                self._records.pop(job_id, None)
            for j in jobs:
                j.job_id = None
            raise

    def validate(self, job: Job) -> None:
        """Raise what `enqueue` raises for ``job``'s own values: `JobTooLargeError` when it
        could never run (its prompt plus ``max_new_tokens`` exceed the whole cache or the
        model's context length), `JobError` for a prompt or stop token id outside the
        vocabulary. Reads only fixed sizes, so any thread may call it."""
        self._check_size(job)
        self._check_token_ids(job)

    def _check_size(self, job: Job) -> None:
        total = len(job.input_ids) + job.max_new_tokens
        context = self.model.config.max_position_embeddings
        if total > context:
            raise JobTooLargeError(
                f"{job!r} needs {total} positions ({len(job.input_ids)} prompt + "
                f"{job.max_new_tokens} new tokens) but the model's context is {context} "
                "(max_position_embeddings); shorten the prompt or lower max_new_tokens")
        page_size = self.cache.page_size
        needed = -(-total // page_size)
        if needed > self.cache.num_pages:
            raise JobTooLargeError(
                f"{job!r} needs {needed} pages ({len(job.input_ids)} prompt + "
                f"{job.max_new_tokens} new tokens) but the whole cache holds "
                f"{self.cache.num_pages} pages ({self.cache.num_pages * page_size} tokens); "
                "build a larger Cache (max_tokens) or shorten the prompt / max_new_tokens"
            )

    def _check_token_ids(self, job: Job) -> None:
        """Raise `JobError` for a prompt or stop token id outside the vocabulary."""
        vocab = self.model.config.vocab_size
        for name, ids in (("input_ids", job.input_ids), ("stop_conditions", job.stop_token_ids)):
            bad = [t for t in ids if not 0 <= t < vocab]
            if bad:
                raise JobError(f"{job!r}: {name} holds token ids outside the vocabulary "
                               f"[0, {vocab}): {bad[:5]}; encode text with this model's "
                               "tokenizer")

    def _record(self, job: Job) -> JobRecord:
        """The job's engine record: settings resolved and checked, text stream, constraint."""
        settings = job.gen_settings if job.gen_settings is not None else self._default_settings
        if not isinstance(settings, SamplerSettings):
            raise JobError(
                f"gen_settings must be a SamplerSettings; got {type(settings).__name__}")
        settings.check_token_ids(self.model.config.vocab_size)
        stops = self._eos_token_ids if job.uses_default_stops else job.stop_token_ids
        matcher = None if job.constraint is None else self._sampler.matcher(job.constraint)
        # A constrained job's stop strings end it only where its reply could end.
        stream = JobStream(job, self.tokenizer, frozenset(stops), self._pieces,
                           self._stop_indexes,
                           stop_gate=None if matcher is None else matcher.is_accepting)
        return JobRecord(
            job=job, stream=stream, settings=settings,
            seed=job.seed if job.seed is not None else random.getrandbits(63),
            matcher=matcher, speculative=job.speculative and self._speculator is not None,
        )

    def num_remaining_jobs(self) -> int:
        """Jobs queued or running, plus final results not yet returned by `iterate`."""
        return len(self._records) + len(self._emitter.finished)

    def cancel(self, job: Job) -> None:
        """Stop a queued or running job now; its pages are freed at once and the next
        `iterate` returns its final result with eos_reason "cancelled"."""
        record = self._records.get(job.job_id) if job.job_id is not None else None
        if record is None:
            return
        try:
            text = record.stream.cancel_text()
        except Exception:  # noqa: BLE001 - a broken stream must not keep the job alive
            text = ""
        self._emitter.end_job(record.job_id, EosReason.CANCELLED, chunk={"text": text})

    def clear_queue(self) -> None:
        """Cancel every job, queued or running (no results are returned for them)."""
        self._in_flight = None  # its jobs are cancelled below; their tokens are not wanted
        for job_id in list(self._records):
            self._scheduler.cancel(job_id)
            record = self._records.pop(job_id)
            record.ended = record.job.finished = True
            if self._speculator is not None:
                self._speculator.forget(job_id)
        self._emitter.finished.clear()

    @property
    def speculator(self) -> Speculator | None:
        """The generator's `Speculator` (its drafter, cost model and draft counts), or None
        without a drafter."""
        return self._speculator

    def stats(self) -> GeneratorStats:
        """Pages by state, prefill tokens computed and reused, jobs running and waiting,
        drafts accepted and rejected."""
        stats = self._scheduler.stats()
        if self._speculator is None:
            return stats
        return dataclasses.replace(stats, draft_tokens_accepted=self._speculator.accepted,
                                   draft_tokens_rejected=self._speculator.rejected)

    def check_invariant(self) -> None:
        """Raise AssertionError if the page invariant (DESIGN.md §4) does not hold."""
        self._scheduler.check_invariant()

    # ---- one step ----------------------------------------------------------------------------

    def iterate(self) -> list[Result]:
        """Run one step and return the results it produced (possibly none).

        With ``overlap_steps``, a step whose tokens can be chosen on the device returns before
        they reach the host: they are emitted by the next call, after it has launched the
        following step (so the device computes while the host emits)."""
        out = self._emitter.take_finished()
        if self._records:
            with self._step_faults(out) as step:
                plan = step.plan = self._scheduler.schedule()
                verify = self._draft(plan)
                feed = token_feed(plan, self._in_flight)
                records = self._sampling_records(plan, feed)
                started, captures = time.perf_counter(), self._runner.graph_captures
                logits = self._runner.run(plan, feed)
                self._land(out)  # the previous step's tokens: wait, apply, emit
                sampled = self._sampler.start(logits, records, overlap=self._may_overlap(),
                                              verify=verify)
                self._apply(plan, sampled, out,
                            started if self._runner.graph_captures == captures else None)
        return out + self._emitter.take_finished()

    @contextmanager
    def _step_faults(self, out: list[Result]) -> Iterator[_Step]:
        """A step that raises fails its own jobs; the step in flight before it is still landed
        (or fails its jobs too when its tokens cannot be had); the scheduler forgets page
        copies that may not have run. The engine goes on with every other job."""
        step = _Step()
        try:
            yield step
        except Exception as exc:  # noqa: BLE001 - a failed step fails its jobs, not the engine
            try:
                self._land(out)
            except Exception:  # noqa: BLE001 - `_land` failed those jobs already
                pass
            if step.plan is not None:
                self._fail(step.plan, exc)

    def _draft(self, plan: StepPlan) -> bool:
        """With a drafter: let it see the plan (a draft cache follows its copies and
        prefills), then give the decode slices drafts. True when any slice has drafts."""
        speculator = self._speculator
        if speculator is None:
            return False
        speculator.follow(plan)
        return speculator.propose(plan, self._records) > 0

    def _may_overlap(self) -> bool:
        """Overlap this step with the next unless the next may draft (drafts are made from
        tokens on the host)."""
        return self._overlap and (self._speculator is None or not self._speculator.wants_tokens())

    def _sampling_records(self, plan: StepPlan, feed: TokenFeed | None) -> Sequence[JobRecord]:
        """The records of ``plan``'s sampling slices, in order (taken before the step in flight
        lands: a job that ends there still has its row, which is then skipped): the step in
        flight's own list when the plan decodes its jobs again in order (the sampler then
        knows it at once)."""
        in_flight = self._in_flight
        if feed is not None and feed.in_order and in_flight is not None \
                and len(feed.rows) == len(plan.slices) == len(in_flight.sampled.records):
            return in_flight.sampled.records
        records = self._records
        return [records[s.job_id] for s in plan.slices if s.sample]

    def _apply(self, plan: StepPlan, sampled: SampledStep, out: list[Result],
               started: float | None) -> None:
        """Apply a sampled step: with its tokens still on the device, as placeholders (the step
        is then in flight until the next `iterate` lands it); else at once, with its results.
        A drafter's cost model learns from the decode and verify steps whose tokens are on
        the host (forward and sampling timed from ``started``; None: a step that captured a
        CUDA graph, whose time is mostly that; prefill chunks would fit the cost of prompts,
        not of drafts)."""
        if self._speculator is not None and sampled.ids is None and started is not None \
                and not any(s.is_prefill for s in plan.slices):
            self._speculator.costs.record(plan.num_tokens, time.perf_counter() - started)
        if sampled.ids is not None and sampled.records:
            self._scheduler.apply_tokens(plan, [PENDING_TOKEN] * len(sampled.records))
            self._in_flight = InFlight(plan, sampled)
            return
        self._finish(plan, sampled, out, pending=False)

    def _land(self, out: list[Result]) -> None:
        """Wait for the step in flight's tokens, put them in the scheduler and emit them; if
        that fails, its jobs fail (and the error goes on to the step)."""
        in_flight, self._in_flight = self._in_flight, None
        if in_flight is None:
            return
        try:
            self._finish(in_flight.plan, in_flight.sampled, out, pending=True)
        except Exception as exc:
            self._fail(in_flight.plan, exc)
            raise

    def _finish(self, plan: StepPlan, sampled: SampledStep, out: list[Result], *,
                pending: bool) -> None:
        """Apply a step's tokens (``pending``: in place of its placeholders) and emit them."""
        tokens = sampled.tokens()
        for job_id, error in sampled.failed.items():
            if job_id in self._records:
                self._emitter.end_job(job_id, EosReason.ERROR, error=error)
        if sampled.runs is not None:
            self._scheduler.apply(plan, StepOutcome(sampled={
                r.job_id: SampledTokens(r.job_id, run, num_draft_accepted=len(run) - 1)
                for r, run in zip(sampled.records, sampled.runs, strict=True) if run}))
        elif pending:
            self._scheduler.resolve_tokens(plan, tokens)
        else:
            self._scheduler.apply_tokens(plan, tokens)
        self._emitter.emit_step(plan, sampled, tokens, out)

    def _fail(self, plan: StepPlan, error: Exception) -> None:
        for s in plan.slices:
            if s.job_id in self._records:
                self._emitter.end_job(s.job_id, EosReason.ERROR, error=error)
        self._scheduler.abort(plan)

    # ---- convenience -------------------------------------------------------------------------

    def generate(self, prompt: str | Sequence[str], max_new_tokens: int, **kwargs: Any) -> Any:
        """Generate completions for one prompt (returns a str) or a list (returns a list in
        order). See `dyngen_core.runtime.generate.run_generate` for every keyword argument."""
        return run_generate(self, prompt, max_new_tokens, **kwargs)

