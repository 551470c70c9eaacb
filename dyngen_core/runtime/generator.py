"""`DynamicGenerator`: the one module that wires scheduler, runner, sampler and streams.

A step is ``schedule -> run -> sample -> apply -> emit``, each one call. The generator keeps a
record per active job (its text stream, sampler state, timings) keyed by job id; page and
sequence state belong to the scheduler, tensors to the cache and runner.
"""

from __future__ import annotations

import random
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from dyngen_core.config import SchedulerConfig
from dyngen_core.engine.job import Job
from dyngen_core.engine.plan import PENDING_TOKEN, SampledTokens, StepPlan
from dyngen_core.engine.results import EosReason, GeneratorStats, Result, streaming_result
from dyngen_core.engine.scheduler import Scheduler
from dyngen_core.engine.settings import SamplerSettings
from dyngen_core.errors import JobError, JobTooLargeError
from dyngen_core.kv.attention import AttentionBackend, get_backend
from dyngen_core.kv.cache import Cache
from dyngen_core.model import Model
from dyngen_core.runtime.active_job import ActiveJob
from dyngen_core.runtime.generate import run_generate
from dyngen_core.runtime.overlap import PendingStep, TokenFeed, TokenLauncher, token_feed
from dyngen_core.runtime.runner import ModelRunner
from dyngen_core.sampling.bridge import SamplingBridge, StepTokens
from dyngen_core.sampling.request import SamplingError
from dyngen_core.text.stream import StreamUpdate
from dyngen_core.text.tokenizer import Tokenizer


class DynamicGenerator:
    """Continuous-batching generator over a paged KV cache.

    Args:
        model: a loaded `Model`.
        cache: a `Cache` built for that model.
        tokenizer: the model's `Tokenizer`.
        max_batch_size: most jobs running at once (more wait in the queue).
        max_chunk_size: most prompt tokens prefilled per step across jobs; decodes of running
            jobs share the same forward.
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
            of its sampling jobs has a constraint, banned string, stop-token ban, extra output
            or mirostat: its tokens are chosen on the device, the next step reads them there,
            and they are emitted by the next `iterate` (one step later). Other steps run as
            before. Outputs are the same either way.
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
    ) -> None:
        self.model = model
        self.cache = cache
        self.tokenizer = tokenizer
        sched_config = SchedulerConfig(
            max_batch_size=max_batch_size,
            max_chunk_size=max_chunk_size,
            dedup=dedup,
            prompt_cache=prompt_cache,
        )
        self._scheduler = Scheduler(cache.config, sched_config)
        self._runner = ModelRunner(
            model, cache, get_backend(attention_backend, model.device), cuda_graphs=cuda_graphs,
            max_batch_size=max_batch_size, compile_decode=compile_decode,
            skinny_matmul_rows=skinny_matmul_rows,
        )
        self._bridge = SamplingBridge(model, tokenizer)
        self._default_settings = SamplerSettings.from_generation_config(
            model.config.generation_defaults
        )
        self._overlap = overlap_steps
        self._launcher = TokenLauncher(model.device)
        self._pending: PendingStep | None = None
        self._active: dict[int, ActiveJob] = {}
        self._finished_results: list[Result] = []
        self._next_job_id = 0

    @classmethod
    def from_model_dir(cls, model_dir: str | Path, *, cache_tokens: int = 32768,
                       cache_mode: str = "fp16", device: Any = None, dtype: Any = None,
                       progress: bool = False, **options: Any) -> DynamicGenerator:
        """Load model, tokenizer and a cache of ``cache_tokens`` tokens in ``cache_mode``;
        ``options`` are the constructor's keyword arguments."""
        model = Model.load(model_dir, device=device, dtype=dtype, progress=progress)
        cache = Cache(model, max_tokens=cache_tokens, mode=cache_mode)
        return cls(model=model, cache=cache, tokenizer=Tokenizer.from_model_dir(model_dir),
                   **options)

    # ---- queue -------------------------------------------------------------------------------

    def enqueue(self, job: Job | Sequence[Job]) -> None:
        """Queue one job or a list of jobs. Raises JobTooLargeError for a job that can never
        fit in the cache (nothing of a rejected list is queued)."""
        jobs = [job] if isinstance(job, Job) else list(job)
        for j in jobs:
            if not isinstance(j, Job):
                raise TypeError(f"enqueue takes Job objects; got {type(j).__name__}")
            if j.job_id is not None:
                raise JobError(f"{j!r} was already enqueued; build a new Job to run it again")
            self.check_fits(j)
        added: list[int] = []
        try:
            for j in jobs:
                j.job_id = self._next_job_id
                self._next_job_id += 1
                self._scheduler.add(j.job_id, j.input_ids, j.max_new_tokens)
                added.append(j.job_id)
                self._active[j.job_id] = self._bridge.activate(
                    j, self._default_settings, random.getrandbits(63)
                )
        except Exception:
            for job_id in added:
                self._scheduler.cancel(job_id)
                self._active.pop(job_id, None)
            for j in jobs:
                j.job_id = None
            raise

    def check_fits(self, job: Job) -> None:
        """Raise JobTooLargeError if ``job`` could never fit in the cache, even alone.

        Reads only the cache's fixed size, so any thread may call it."""
        page_size = self.cache.page_size
        needed = -(-(len(job.input_ids) + job.max_new_tokens) // page_size)
        if needed > self.cache.num_pages:
            raise JobTooLargeError(
                f"{job!r} needs {needed} pages ({len(job.input_ids)} prompt + "
                f"{job.max_new_tokens} new tokens) but the whole cache holds "
                f"{self.cache.num_pages} pages ({self.cache.num_pages * page_size} tokens); "
                "build a larger Cache (max_tokens) or shorten the prompt / max_new_tokens"
            )

    def num_remaining_jobs(self) -> int:
        """Jobs queued or running, plus final results not yet returned by `iterate`."""
        return len(self._active) + len(self._finished_results)

    def cancel(self, job: Job) -> None:
        """Stop a queued or running job now; its pages are freed at once and the next
        `iterate` returns its final result with eos_reason "cancelled"."""
        if job.job_id is None or job.job_id not in self._active:
            return
        text = self._active[job.job_id].stream.cancel_text()
        self._end_job(job.job_id, EosReason.CANCELLED, chunk={"text": text})

    def clear_queue(self) -> None:
        """Cancel every job, queued or running (no results are returned for them)."""
        self._pending = None  # its jobs are cancelled below; their tokens are not wanted
        for job_id in list(self._active):
            self._scheduler.cancel(job_id)
            active = self._active.pop(job_id)
            active.ended = active.job.finished = True
        self._finished_results.clear()

    def stats(self) -> GeneratorStats:
        """Pages by state, prefill tokens computed and reused, jobs running and waiting."""
        return self._scheduler.stats()

    def check_invariant(self) -> None:
        """Raise AssertionError if the page invariant (DESIGN.md §4) does not hold."""
        self._scheduler.check_invariant()

    # ---- one step ----------------------------------------------------------------------------

    def iterate(self) -> list[Result]:
        """Run one step and return the results it produced (possibly none).

        With ``overlap_steps``, a step whose tokens can be chosen on the device returns before
        they reach the host: they are emitted by the next call, after it has launched the
        following step (so the device computes while the host emits)."""
        results, self._finished_results = self._finished_results, []
        pending, self._pending = self._pending, None
        if not self._active:
            return results
        plan = self._scheduler.schedule()
        if plan.is_empty:
            self._resolve(pending, results)
            return results + self._take_finished()
        try:
            feed = token_feed(plan, pending)
            active = self._sampling_jobs(plan, pending, feed)
            plain = self._bridge.all_plain(active)
            masks = None if plain else self._bridge.start_masks(active)  # during the forward
            logits = self._runner.run(plan, feed)
            if active and logits is None:
                raise RuntimeError(f"the runner returned no logits for {len(active)} sampling "
                                   "slices")
        except Exception as exc:  # noqa: BLE001 - a failed step fails its jobs, not the engine
            self._resolve(pending, results)
            self._fail(plan, exc)
            return results + self._take_finished()
        self._resolve(pending, results)
        if active and self._overlap:
            assert logits is not None
            self._pending = self._launch(logits, plan, active, plain)
            if self._pending is not None:
                self._scheduler.apply_tokens(plan, [PENDING_TOKEN] * len(active))
                return results + self._take_finished()
        try:
            sampled = self._sample(logits, active, plain, masks)
        except Exception as exc:  # noqa: BLE001
            self._fail(plan, exc)
            return results + self._take_finished()
        for job_id, error in sampled.failed.items():
            self._end_job(job_id, EosReason.ERROR, error=error)
        # One token per sampling slice and no drafts: the scheduler needs no SampledTokens.
        self._scheduler.apply_tokens(plan, sampled.tokens)
        self._emit_step(plan, sampled, results)
        return results + self._take_finished()

    def _sampling_jobs(self, plan: StepPlan, pending: PendingStep | None,
                       feed: TokenFeed | None) -> list[ActiveJob]:
        """The records of ``plan``'s sampling slices, in order: the pending step's own list
        when the plan decodes its jobs again in order (an in-order feed, one row per slice:
        slice i is one token, pending row i's), which the bridge then knows at once."""
        if feed is not None and feed.in_order and pending is not None \
                and len(feed.rows) == len(plan.slices) == len(pending.active):
            return pending.active
        active_jobs = self._active
        return [active_jobs[s.job_id] for s in plan.slices if s.sample]

    def _launch(self, logits: torch.Tensor, plan: StepPlan, active: list[ActiveJob],
                plain: bool) -> PendingStep | None:
        """The step's tokens chosen on the device and on their way to the host, or None when
        a job needs the host to sample (`SamplingBridge.launch`)."""
        if plain:
            fed, ids = self._bridge.launch_plain(logits, active)
            return self._launcher.launch(ids, plan, active, fed)
        try:
            sampled = self._bridge.launch(logits, active)
        except SamplingError:
            return None  # `sample` reports the jobs it cannot sample
        return None if sampled is None else self._launcher.launch(sampled, plan, active)

    def _sample(self, logits: torch.Tensor | None, active: list[ActiveJob], plain: bool,
                masks: Any) -> StepTokens:
        """A token for each sampling slice (in plan order), on the host."""
        if not active:
            return StepTokens([])
        assert logits is not None
        if plain:
            tokens = self._bridge.sample_plain(logits, active)
            if tokens is not None:
                return StepTokens(tokens)
        return self._bridge.sample(logits, active, masks)

    def _resolve(self, pending: PendingStep | None, out: list[Result]) -> None:
        """Wait for an overlapped step's tokens, put them in the scheduler and emit them."""
        if pending is None:
            return
        tokens = pending.tokens()
        active_jobs = self._active
        if -1 in tokens:
            for row, a in enumerate(pending.active):
                if tokens[row] < 0 and a.job_id in active_jobs:
                    error = SamplingError(f"job {a.job_id}: its logits row left no token to "
                                          "choose (NaN or inf from the model, or token_bias "
                                          "removed every token); the job fails", [row])
                    self._end_job(a.job_id, EosReason.ERROR, error=error)
        self._scheduler.resolve_tokens(pending.plan, tokens)
        if len(pending.plan.slices) == len(pending.active):  # every slice sampled: no prefill
            # The jobs' draws are counted while they are emitted (one pass over them).
            self._emit_rows(pending.active, tokens, {}, out, time.perf_counter(), drawn=True)
            return
        for a in pending.active:
            a.request.counter += 1
        self._emit_step(pending.plan, StepTokens(tokens), out)

    def _fail(self, plan: StepPlan, error: Exception) -> None:
        for s in plan.slices:
            if s.job_id in self._active:
                self._end_job(s.job_id, EosReason.ERROR, error=error)

    def _emit_step(self, plan: StepPlan, sampled: StepTokens, out: list[Result]) -> None:
        """Append every job's results of this step to ``out``."""
        active_jobs, extras, now = self._active, sampled.extras, time.perf_counter()
        if len(sampled.tokens) == len(plan.slices):  # every slice sampled: no prefill
            self._emit_rows([active_jobs.get(s.job_id) for s in plan.slices], sampled.tokens,
                            extras, out, now)
            return
        next_token = iter(sampled.tokens).__next__
        for s in plan.slices:
            if s.sample:
                self._emit_rows([active_jobs.get(s.job_id)], [next_token()], extras, out, now)
            elif s.job_id in active_jobs:
                self._emit_start(active_jobs[s.job_id], out, now, prefill=True)

    def _emit_rows(self, rows: Sequence[ActiveJob | None], tokens: Sequence[int],
                   extras: dict[int, SampledTokens], out: list[Result], now: float, *,
                   drawn: bool = False) -> None:
        """Append the results of one sampled token per job (``tokens[i]`` is ``rows[i]``'s; a
        None row, or a job that ended since, is skipped) to ``out``; a job's first token comes
        after its "started" result. ``drawn``: also count the draw of each job still running
        (an overlapped step's, which `SamplingBridge.sample` did not count)."""
        append, new_result = out.append, streaming_result
        for active, token in zip(rows, tokens, strict=True):
            if active is None or active.ended:
                continue  # ended (failed sampling, cancelled)
            if drawn:
                active.request.counter += 1
            if active.time_first_token is None:
                self._emit_start(active, out, now, prefill=False)
                active.time_first_token = now
            update = active.stream.advance(token)
            if update.__class__ is not str or not active.plain_stream:
                result = self._stream_update(active, token, extras.get(active.job_id), update)
                if result is not None:
                    append(result)
                continue
            # The common case, no end, rewind, constraint or extras: `_stream_update` inlined.
            if active.needs_history:
                active.history.append(token)
            append(new_result(active.job, update, token))

    def _emit_start(self, active: ActiveJob, out: list[Result], now: float, *,
                    prefill: bool) -> None:
        """A job's "started" result the first time it is seen, then with ``prefill`` its
        "prefill" progress (a step that computed part of its prompt and sampled nothing)."""
        if active.time_started is None:
            active.time_started = now
            out.append(active.result("started"))
        if prefill:
            seq = self._scheduler.sequence(active.job_id)
            assert seq is not None
            out.append(active.result("prefill", prefill_progress=seq.num_computed,
                                     prefill_total=seq.num_tokens))

    def _stream_update(self, active: ActiveJob, token_id: int, tokens: SampledTokens | None,
                       update: str | StreamUpdate) -> Result | None:
        if isinstance(update, str):
            update = StreamUpdate(update, token_ids=[token_id])
        if update.rewind:
            self._scheduler.rewind(active.job_id, update.rewind)
            active.on_rewind(update.rewind, update.banned_token_id)
            return None
        error = active.on_token(token_id)
        eos = EosReason.ERROR if error else active.end_reason(update.eos_reason)
        if eos is None:
            return active.streaming_result(update.text, token_id, tokens)
        chunk = dict(text=update.text, token_ids=update.token_ids)
        if active.wants_extras:
            assert tokens is not None
            chunk.update(active.extras(tokens))
        self._end_job(active.job_id, eos, chunk=chunk, error=error)
        return None

    def _end_job(self, job_id: int, reason: EosReason, *, chunk: dict[str, Any] | None = None,
                 error: BaseException | None = None) -> None:
        """Free the job's pages now and queue its final result (carrying the last chunk)."""
        active = self._active.pop(job_id)
        active.ended = True
        seq = self._scheduler.sequence(job_id)
        cached_tokens = seq.num_cached_tokens if seq is not None else 0
        self._scheduler.finish(job_id)
        active.job.finished = True
        self._finished_results.append(
            active.final_result(reason, chunk=chunk or {"text": ""}, error=error,
                                cached_tokens=cached_tokens, page_size=self.cache.page_size)
        )

    def _take_finished(self) -> list[Result]:
        finished, self._finished_results = self._finished_results, []
        return finished

    # ---- convenience -------------------------------------------------------------------------

    def generate(self, prompt: str | Sequence[str], max_new_tokens: int, **kwargs: Any) -> Any:
        """Generate completions for one prompt (returns a str) or a list (returns a list in
        order). See `dyngen_core.runtime.generate.run_generate` for every keyword argument."""
        return run_generate(self, prompt, max_new_tokens, **kwargs)
