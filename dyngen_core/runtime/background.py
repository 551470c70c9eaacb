"""`BackgroundGenerator`: one thread runs ``iterate()``; any thread or event loop submits jobs.

This is the shared job queue every adapter uses: `shared_generator` returns one background
generator per (model folder, engine options) in the process, so LangChain and LlamaIndex objects
pointed at the same folder share one model, one cache and one batch.
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
from collections.abc import Mapping, Sequence
from functools import partial
from pathlib import Path
from types import MappingProxyType
from typing import Any

from dyngen_core.config import EngineOptions
from dyngen_core.engine.job import Job
from dyngen_core.engine.results import GeneratorStats, Result
from dyngen_core.errors import EngineStoppedError
from dyngen_core.kv.cache import Cache
from dyngen_core.model import Model
from dyngen_core.runtime.generator import DynamicGenerator
from dyngen_core.runtime.handle import JobHandle, Wakeups
from dyngen_core.text.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

# How long `close` waits for the engine thread to finish its current step.
_CLOSE_WAIT_S = 30.0


class BackgroundGenerator:
    """Runs a `DynamicGenerator` on its own daemon thread, for any number of threads and event
    loops.

    generator: the engine to run. From now on only the engine thread calls its methods; read
        `tokenizer`, `generation_defaults`, `max_job_tokens` and `stats()` here instead.

    Contract:
        - `submit` and `submit_many` are thread-safe and never wait for a step: jobs are handed
          to the engine thread, which enqueues them before its next step. A job whose own
          values the engine refuses (`DynamicGenerator.validate`: too large, token ids outside
          the vocabulary) raises there; one refused later at enqueue (bad settings or
          constraint) fails its handle.
        - An exception raised by a step fails the jobs running in the engine (their handles
          raise it); the engine goes on serving later jobs.
        - Anything else that ends the engine thread (a BaseException such as SystemExit,
          KeyboardInterrupt or a native library's panic, or an exception outside a step) stops
          the engine: every unfinished handle fails at once with EngineStoppedError, the cause
          chained, and every later submit raises it. The thread logs the cause and ends.
        - `close()` stops the engine the same way, with EngineStoppedError saying so.
        - A consumer's failure (its event loop closed, say) never stops the engine thread.
    """

    def __init__(self, generator: DynamicGenerator) -> None:
        self.generator = generator
        config = generator.model.config
        self._generation_defaults = MappingProxyType(dict(config.generation_defaults))
        self._max_job_tokens = min(int(config.max_position_embeddings),
                                   int(generator.cache.max_tokens))
        self._lock = threading.Condition()
        # Guarded by the lock: the hand-over lists and the engine's state.
        self._incoming: list[tuple[Job, JobHandle]] = []
        self._cancels: list[Job] = []
        self._closed = False
        self._failure: BaseException | None = None
        # Engine thread only: jobs being enqueued, and the enqueued ones by job id.
        self._admitting: list[tuple[Job, JobHandle]] = []
        self._handles: dict[int, JobHandle] = {}
        self._stats = generator.stats()
        self._thread = threading.Thread(target=self._run, name="dyngen-engine", daemon=True)
        self._thread.start()

    # ---- what callers read ---------------------------------------------------------------------

    @property
    def tokenizer(self) -> Tokenizer:
        """The model's `Tokenizer`."""
        return self.generator.tokenizer

    @property
    def generation_defaults(self) -> Mapping[str, Any]:
        """The model's sampling defaults from its generation_config.json: those of
        temperature, top_p, top_k, min_p, repetition_penalty and do_sample it sets (read-only).
        A job without ``gen_settings`` samples with these; pass them to
        `SamplerSettings.from_framework_fields` to lay a caller's fields over them."""
        return self._generation_defaults

    @property
    def max_job_tokens(self) -> int:
        """The most tokens (prompt plus ``max_new_tokens``) one job may hold: the model's
        trained length (``max_position_embeddings``) bounded by the whole cache. `submit`
        refuses a job beyond the cache with JobTooLargeError."""
        return self._max_job_tokens

    @property
    def running(self) -> bool:
        """True until the engine is closed or stops on an error."""
        return not self._closed and self._failure is None

    def stats(self) -> GeneratorStats:
        """The engine's `GeneratorStats`, as published after the latest step (never waits for
        a step; safe from any thread)."""
        return self._stats

    def wait_idle(self, timeout: float | None = None) -> GeneratorStats:
        """Block until the engine owes no job a result (none handed over, being enqueued,
        queued or running), or has stopped; return the stats then. Raises TimeoutError after
        ``timeout`` seconds."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            with self._lock:
                owed = bool(self._incoming or self._admitting)
            # A job's handle is registered before it leaves `_admitting`, and dropped once its
            # final result is delivered (after the step's stats are published).
            owed = owed or bool(self._handles)
            stats = self._stats
            if not self.running or not owed:
                return stats
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"the engine is still busy after {timeout} s: {stats}")
            time.sleep(0.01)

    # ---- what callers do -----------------------------------------------------------------------

    def submit(self, job: Job) -> JobHandle:
        """Queue ``job``; returns the handle that streams its results (sync or async).

        Raises what `DynamicGenerator.validate` raises (JobTooLargeError for a job that can
        never fit, JobError for a token id outside the vocabulary), EngineStoppedError when the
        engine is closed or stopped."""
        return self._hand_over([job])[0]

    def submit_many(self, jobs: Sequence[Job]) -> list[JobHandle]:
        """Queue several jobs at once: they are enqueued before the same step. Raises like
        `submit`, and then queues none of them."""
        return self._hand_over(list(jobs))

    def cancel(self, job: Job) -> None:
        """Cancel a job from any thread; its pages are freed before the next step. Does
        nothing once the engine has stopped (its jobs have failed already)."""
        with self._lock:
            if self.running:
                self._cancels.append(job)
                self._lock.notify()

    def close(self) -> None:
        """Stop the engine thread. Unfinished jobs fail with EngineStoppedError, and later
        submits raise it; the generator is closed (`DynamicGenerator.close`: a split model's
        workers end). Waits (up to 30 s) for the step in progress to end. Safe to call more
        than once and from any thread."""
        with self._lock:
            self._closed = True
            waiting, self._incoming = self._incoming, []
            self._cancels.clear()
            self._lock.notify()
        self._fail(waiting)
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout=_CLOSE_WAIT_S)
            if self._thread.is_alive():
                logger.warning("the dyngen engine thread is still in a step after %s s; it "
                               "fails its jobs when the step ends", _CLOSE_WAIT_S)

    def _hand_over(self, jobs: list[Job]) -> list[JobHandle]:
        if not self.running:
            raise self._stopped_error()
        for job in jobs:
            self.generator.validate(job)
        handles = [JobHandle(job, partial(self.cancel, job)) for job in jobs]
        with self._lock:
            if not self.running:
                raise self._stopped_error()
            self._incoming.extend(zip(jobs, handles, strict=True))
            self._lock.notify()
        return handles

    def _stopped_error(self) -> EngineStoppedError:
        """The error for a job this engine can no longer run (a new one per job)."""
        cause = self._failure
        if cause is None:
            return EngineStoppedError(
                "this BackgroundGenerator is closed, so it runs no more jobs; build a new one, "
                "or call shared_generator(...) again for a fresh shared engine")
        error = EngineStoppedError(
            f"the dyngen engine thread stopped on {cause!r}, so it runs no more jobs; "
            "call shared_generator(...) again for a fresh shared engine, or build a new "
            "BackgroundGenerator")
        error.__cause__ = cause
        return error

    def _fail(self, pairs: Sequence[tuple[Job, JobHandle]]) -> None:
        for _, handle in pairs:
            handle._fail(self._stopped_error())

    # ---- engine thread -------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            self._serve()
        except BaseException as cause:  # noqa: BLE001 - the engine stops; every caller learns why
            self._stop(cause)

    def _serve(self) -> None:
        while True:
            # The lock guards only the hand-over: submitters never wait for a step.
            with self._lock:
                while not (self._closed or self._incoming or self._cancels
                           or self.generator.num_remaining_jobs()):
                    self._lock.wait()
                closed = self._closed
                self._admitting, self._incoming = self._incoming, []
                cancels, self._cancels = self._cancels, []
            if closed:
                self._end()
                return
            self._admit()
            for job in cancels:
                self.generator.cancel(job)
            self._step()

    def _admit(self) -> None:
        for job, handle in self._admitting:
            if handle.cancel_requested:
                handle._cancelled_before_start()
                continue
            try:
                self.generator.enqueue(job)
            except Exception as exc:  # noqa: BLE001 - reported to the submitter, engine goes on
                handle._fail(exc)
                continue
            assert job.job_id is not None
            self._handles[job.job_id] = handle
        self._admitting = []

    def _step(self) -> None:
        try:
            results = self.generator.iterate()
        except Exception as exc:  # noqa: BLE001 - a step's fault fails its jobs, not the engine
            self.generator.clear_queue()
            for handle in self._handles.values():
                handle._fail(exc)
            self._handles.clear()
            results = []
        self._stats = self.generator.stats()
        self._deliver(results)

    def _deliver(self, results: list[Result]) -> None:
        """Hand the step's results to their handles; the event loops waiting on them are woken
        once each, after the last (`Wakeups`)."""
        wakeups = Wakeups()
        try:
            for result in results:
                owner = self._handles.get(result["job"].job_id)
                if owner is None:
                    continue
                if result["eos"]:
                    del self._handles[result["job"].job_id]
                try:
                    owner._push(result, wakeups)
                except Exception:  # noqa: BLE001 - a consumer's failure must not stop the engine
                    logger.exception("delivering a result to %r failed", owner)
        finally:
            wakeups.send()

    def _stop(self, cause: BaseException) -> None:
        """The engine thread ends on ``cause``: fail every unfinished job, refuse new ones."""
        logger.error("the dyngen engine thread stopped; failing its jobs", exc_info=cause)
        with self._lock:
            self._failure = cause
            self._cancels.clear()
        try:
            self._end()
        except Exception:  # noqa: BLE001 - the engine is stopped either way
            logger.exception("emptying the stopped engine failed")

    def _end(self) -> None:
        """Fail the handed-over, admitting and running jobs, empty the engine (it runs no
        more jobs) and close its generator."""
        with self._lock:
            waiting, self._incoming = self._incoming, []
        running = [(handle.job, handle) for handle in self._handles.values()]
        self._fail([*waiting, *self._admitting, *running])
        self._admitting, self._handles = [], {}
        self.generator.clear_queue()
        self._stats = self.generator.stats()
        self.generator.close()  # a split model's workers end with the engine


class _SharedGenerators:
    """The process's registry of background generators, keyed by folder and options.

    Models are shared too, keyed by folder, device and dtype: two engines over the same weights
    (say, different cache sizes) load them once."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_key: dict[tuple[str, EngineOptions], BackgroundGenerator] = {}
        self._models: dict[tuple[str, str, str], Model] = {}

    def get(self, model_dir: str | Path, options: EngineOptions) -> BackgroundGenerator:
        key = (str(Path(model_dir).resolve()), options)
        with self._lock:
            engine = self._by_key.get(key)
            if engine is None or not engine.running:
                engine = self._by_key[key] = BackgroundGenerator(self._generator(*key))
            return engine

    def close_all(self) -> None:
        with self._lock:
            engines, self._by_key = list(self._by_key.values()), {}
        for engine in engines:
            engine.close()

    def _generator(self, folder: str, options: EngineOptions) -> DynamicGenerator:
        if options.tensor_parallel > 1:
            return self._split_generator(folder, options)
        model = self._model(folder, options)
        draft = options.draft_model_dir
        return DynamicGenerator(
            model=model,
            cache=Cache(model, max_tokens=options.cache_tokens, mode=options.cache_mode),
            tokenizer=Tokenizer.from_model_dir(folder),
            draft_model=None if draft is None else self._model(str(Path(draft).resolve()),
                                                               options),
            **_generator_options(options),
        )

    def _split_generator(self, folder: str, options: EngineOptions) -> DynamicGenerator:
        """A generator over a model split over ``options.tensor_parallel`` ranks, with workers
        of its own (`DynamicGenerator.from_model_dir`); its weights are not shared with other
        engines. A process belongs to one group at a time: RuntimeError while another split
        engine runs."""
        others = [key for key, engine in self._by_key.items()
                  if key[1].tensor_parallel > 1 and engine.running]
        if others:
            raise RuntimeError(
                f"an engine with tensor_parallel={others[0][1].tensor_parallel} already runs "
                f"for {others[0][0]} in this process, and a process runs one split engine at "
                "a time; close it first (BackgroundGenerator.close) or ask for its options")
        return DynamicGenerator.from_model_dir(
            folder, cache_tokens=options.cache_tokens, cache_mode=options.cache_mode,
            device=_auto(options.device), dtype=_auto(options.dtype),
            draft_model_dir=options.draft_model_dir, tensor_parallel=options.tensor_parallel,
            **_generator_options(options))

    def _model(self, folder: str, options: EngineOptions) -> Model:
        key = (folder, options.device, options.dtype)
        if key not in self._models:
            self._models[key] = Model.load(folder, device=_auto(options.device),
                                           dtype=_auto(options.dtype))
        return self._models[key]


def _auto(value: str) -> str | None:
    """An EngineOptions device or dtype as `Model.load` takes it ("auto": None)."""
    return None if value == "auto" else value


def _generator_options(options: EngineOptions) -> dict[str, Any]:
    """The `DynamicGenerator` keyword arguments that ``options`` sets (the model, cache,
    tokenizer and draft model aside)."""
    return dict(max_batch_size=options.max_batch_size, max_chunk_size=options.max_chunk_size,
                dedup=options.dedup, prompt_cache=options.prompt_cache,
                attention_backend=options.attention_backend, cuda_graphs=options.cuda_graphs,
                compile_decode=options.compile_decode, use_ngram_draft=options.use_ngram_draft,
                num_draft_tokens=options.num_draft_tokens)


_REGISTRY = _SharedGenerators()
# Stop engine threads between steps at exit: a daemon thread killed inside a torch op aborts.
atexit.register(_REGISTRY.close_all)


def shared_generator(model_dir: str | Path, **options: Any) -> BackgroundGenerator:
    """The process-wide `BackgroundGenerator` for this model folder and engine options.

    model_dir: the model folder (any spelling of the same path gives the same engine).
    options: `EngineOptions` fields (cache_tokens, cache_mode, device, dtype, max_batch_size,
        max_chunk_size, attention_backend, dedup, prompt_cache, cuda_graphs, compile_decode,
        draft_model_dir, use_ngram_draft, num_draft_tokens, tensor_parallel), or
        ``engine_options=EngineOptions(...)``. An invalid value raises pydantic's
        ValidationError naming the field.

    The same folder with the same options gives the same engine, whichever adapter asks, so the
    weights load once and every caller shares one job queue. An engine that was closed or
    stopped on an error is replaced by a new one over the same loaded weights, with a new
    cache (the old cache's memory is freed once nothing holds the old engine).

    With ``tensor_parallel=N`` (N > 1) the engine's model is split over N processes of this
    host that the engine starts (this one is rank 0) and ends when it is closed (at the
    latest when the process exits); such an engine loads its own weights, and a process runs
    one at a time (RuntimeError while another runs). ValueError when the model does not split
    over N ranks.
    """
    opts = options.pop("engine_options", None) or EngineOptions(**options)
    return _REGISTRY.get(model_dir, opts)
