"""`BackgroundGenerator`: one thread runs ``iterate()``; any thread or event loop submits jobs.

This is the shared job queue every adapter uses: `shared_generator` returns one background
generator per (model folder, engine options) in the process, so LangChain and LlamaIndex objects
pointed at the same folder share one model, one cache and one batch.
"""

from __future__ import annotations

import atexit
import logging
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from dyngen_core.config import EngineOptions
from dyngen_core.engine.job import Job
from dyngen_core.kv.cache import Cache
from dyngen_core.model import Model
from dyngen_core.runtime.generator import DynamicGenerator
from dyngen_core.runtime.handle import JobHandle
from dyngen_core.text.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


class BackgroundGenerator:
    """Runs a `DynamicGenerator` on its own daemon thread.

    `submit` is thread-safe and never waits for a step: jobs are handed to the engine thread,
    which enqueues them before its next step. A job that can never fit raises at `submit`.
    Call `close()` to stop the thread (pending jobs are cancelled).
    """

    def __init__(self, generator: DynamicGenerator) -> None:
        self.generator = generator
        self._lock = threading.Condition()
        self._incoming: list[tuple[Job, JobHandle]] = []
        self._cancels: list[Job] = []
        self._handles: dict[int, JobHandle] = {}
        self._closed = False
        self._stats = generator.stats()
        self._thread = threading.Thread(target=self._loop, name="dyngen-engine", daemon=True)
        self._thread.start()

    @property
    def tokenizer(self) -> Any:
        return self.generator.tokenizer

    def submit(self, job: Job) -> JobHandle:
        """Queue a job; returns a handle that streams its results (sync or async)."""
        self.generator.check_fits(job)
        handle = JobHandle(job, self)
        with self._lock:
            if self._closed:
                raise RuntimeError("this BackgroundGenerator is closed; create a new one")
            self._incoming.append((job, handle))
            self._lock.notify()
        return handle

    def submit_many(self, jobs: Sequence[Job]) -> list[JobHandle]:
        """Queue several jobs at once (they enter the same step)."""
        for job in jobs:
            self.generator.check_fits(job)
        handles = [JobHandle(job, self) for job in jobs]
        with self._lock:
            self._incoming.extend(zip(jobs, handles))
            self._lock.notify()
        return handles

    def cancel(self, job: Job) -> None:
        """Cancel a job from any thread; its pages are freed before the next step."""
        with self._lock:
            self._cancels.append(job)
            self._lock.notify()

    def stats(self) -> Any:
        """The engine's `GeneratorStats`, as published after the latest step (never waits for
        a step; safe from any thread)."""
        return self._stats

    def close(self) -> None:
        """Stop the engine thread; running and queued jobs fail with a clear error."""
        with self._lock:
            self._closed = True
            self._lock.notify()
        self._thread.join(timeout=30)

    # ---- engine thread -----------------------------------------------------------------------

    def _loop(self) -> None:
        generator = self.generator
        while True:
            # The lock guards only the hand-over lists: submitters never wait for a step.
            with self._lock:
                while not (self._closed or self._incoming or self._cancels
                           or generator.num_remaining_jobs()):
                    self._lock.wait()
                closed = self._closed
                incoming, self._incoming = self._incoming, []
                cancels, self._cancels = self._cancels, []
            if closed:
                self._fail_all(RuntimeError("the background generator was closed"))
                return
            self._admit(incoming)
            for job in cancels:
                generator.cancel(job)
            try:
                results = generator.iterate()
            except Exception as exc:  # noqa: BLE001 - an engine fault fails its jobs, not the thread
                self._fail_all(exc)
                results = []
            self._stats = generator.stats()
            self._deliver(results)

    def _deliver(self, results: list[Any]) -> None:
        for result in results:
            owner = self._handles.get(result["job"].job_id)
            if owner is None:
                continue
            if result["eos"]:
                del self._handles[result["job"].job_id]
            try:
                owner._push(result)
            except Exception:  # noqa: BLE001 - a consumer's failure must not stop the engine
                logger.exception("delivering a result to %r failed", owner)

    def _fail_all(self, error: BaseException) -> None:
        self.generator.clear_queue()
        for handle in self._handles.values():
            handle._fail(error)
        self._handles.clear()
        self._stats = self.generator.stats()

    def _admit(self, incoming: list[tuple[Job, JobHandle]]) -> None:
        for job, handle in incoming:
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


class _SharedGenerators:
    """The process's registry of background generators, keyed by folder and options.

    Models are shared too, keyed by folder, device and dtype: two engines over the same weights
    (say, different cache sizes) load them once."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_key: dict[tuple[str, EngineOptions], BackgroundGenerator] = {}
        self._models: dict[tuple[str, str, str], Model] = {}

    def get(self, model_dir: str | Path, options: EngineOptions) -> BackgroundGenerator:
        folder = str(Path(model_dir).resolve())
        key = (folder, options)
        with self._lock:
            if key not in self._by_key:
                model = self._model(folder, options)
                generator = DynamicGenerator(
                    model=model,
                    cache=Cache(model, max_tokens=options.cache_tokens, mode=options.cache_mode),
                    tokenizer=Tokenizer.from_model_dir(folder),
                    max_batch_size=options.max_batch_size,
                    max_chunk_size=options.max_chunk_size,
                    dedup=options.dedup,
                    prompt_cache=options.prompt_cache,
                    attention_backend=options.attention_backend,
                    cuda_graphs=options.cuda_graphs,
                    compile_decode=options.compile_decode,
                )
                self._by_key[key] = BackgroundGenerator(generator)
            return self._by_key[key]

    def close_all(self) -> None:
        with self._lock:
            engines, self._by_key = list(self._by_key.values()), {}
        for engine in engines:
            engine.close()

    def _model(self, folder: str, options: EngineOptions) -> Model:
        key = (folder, options.device, options.dtype)
        if key not in self._models:
            self._models[key] = Model.load(
                folder,
                device=None if options.device == "auto" else options.device,
                dtype=None if options.dtype == "auto" else options.dtype,
            )
        return self._models[key]


_REGISTRY = _SharedGenerators()
# Stop engine threads between steps at exit: a daemon thread killed inside a torch op aborts.
atexit.register(_REGISTRY.close_all)


def shared_generator(model_dir: str | Path, **options: Any) -> BackgroundGenerator:
    """The process-wide `BackgroundGenerator` for this model folder and engine options.

    ``options`` are `EngineOptions` fields (cache_tokens, cache_mode, device, dtype,
    max_batch_size, ...). The same folder with the same options always gives the same engine,
    whichever adapter asks, so the weights load once and every caller shares one job queue.
    """
    opts = options.pop("engine_options", None) or EngineOptions(**options)
    return _REGISTRY.get(model_dir, opts)
