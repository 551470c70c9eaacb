"""Fixtures for langchain-dyngen's tests: the demo model, one shared engine, engine helpers.

Every test object is built from `demo_params`, so the whole run loads the demo model once
(objects with the same folder and engine options share one engine). Engine statistics are
cumulative across tests: tests compare before/after snapshots and wait for the engine to be idle.
"""

from __future__ import annotations

import inspect
import threading
import time
from collections.abc import Callable, Generator
from pathlib import Path
from typing import Any

import pytest

# The engine options of every test object, so the run loads the demo model once. They match
# the LlamaIndex adapter's tests, so a whole-project run shares that engine too.
DEMO_ENGINE: dict[str, Any] = {"cache_tokens": 8192, "max_batch_size": 32}


def demo_model_path() -> Path:
    """The demo model (SmolLM2-135M-Instruct), fetched and converted on first use."""
    from dyngen_core.cli.convert.demo import fetch_demo_model

    return Path(fetch_demo_model())


def wait_until_idle(engine: Any, limit_s: float = 300.0) -> Any:
    """Wait for the engine to hold no queued or running job; return its stats then."""
    return engine.wait_idle(timeout=limit_s)


class MaxJobsWatcher:
    """Samples an engine's stats on a thread; `most` is the most jobs (running + waiting) seen
    in the engine at once while the watcher ran."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.most = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def __enter__(self) -> MaxJobsWatcher:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _watch(self) -> None:
        while not self._stop.is_set():
            stats = self.engine.stats()
            self.most = max(self.most, stats.jobs_active + stats.jobs_pending)
            time.sleep(0.002)


@pytest.fixture(scope="session")
def demo_model_dir() -> Path:
    """The demo model (SmolLM2-135M-Instruct), fetched and converted on first use."""
    return demo_model_path()


@pytest.fixture(scope="session")
def demo_params(demo_model_dir: Path) -> dict[str, Any]:
    """Constructor arguments every demo-model test object starts from."""
    return {"model_dir": str(demo_model_dir), **DEMO_ENGINE}


@pytest.fixture(scope="session")
def engine(demo_params: dict[str, Any]) -> Any:
    """The shared engine all demo-model test objects run on."""
    from langchain_dyngen._engine import engine_for
    from langchain_dyngen.chat_models import ChatDynGen

    chat = ChatDynGen(**demo_params)
    return engine_for(chat.model_dir, chat.engine_options)


@pytest.fixture
def idle(engine: Any) -> Callable[[], Any]:
    """``idle()`` waits until the engine runs nothing and returns its stats."""
    return lambda: wait_until_idle(engine)


@pytest.fixture
def watcher(engine: Any) -> Callable[[], MaxJobsWatcher]:
    """``with watcher() as w: ...`` then ``w.most``: the most jobs seen in the engine at once."""
    return lambda: MaxJobsWatcher(engine)


@pytest.hookimpl(hookwrapper=True, trylast=True)
def pytest_pycollect_makeitem(collector: Any, name: str, obj: Any) -> Generator[None, Any, None]:
    """Run coroutine tests (the langchain-tests suites have unmarked ``async def`` tests) with
    pytest-asyncio, without switching the whole project to asyncio auto mode. As the innermost
    wrapper, this marks the collected items before pytest-asyncio's wrapper inspects them."""
    outcome = yield
    result = outcome.get_result()
    items = result if isinstance(result, list) else [result] if result is not None else []
    for item in items:
        function = getattr(item, "obj", None)
        if isinstance(item, pytest.Function) and inspect.iscoroutinefunction(function):
            item.add_marker(pytest.mark.asyncio)
