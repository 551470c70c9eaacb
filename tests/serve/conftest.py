"""Fixtures for the server's tests: one server over the demo model's shared engine, started
in-process (uvicorn on a thread, on a free port), and clients for it.

The server needs the serve extra (FastAPI, uvicorn) and the tests the OpenAI client; `make
test` installs them. Without them these fixtures fail on the import, naming the package.

The engine options match the adapters' tests, so a whole-project run loads the demo model
once and every test shares one engine; tests wait for it to be idle before reading its stats.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from dyngen_core import BackgroundGenerator, EngineOptions, shared_generator
from dyngen_core.serve.options import ServeOptions

if TYPE_CHECKING:
    from dyngen_core.serve.server import ServerThread

DEMO_ENGINE = EngineOptions(cache_tokens=8192, max_batch_size=32)
MODEL = "demo"
API_KEY = "sk-test-key"


@pytest.fixture(scope="session")
def serve_options(demo_model_dir: Path) -> ServeOptions:
    return ServeOptions(model_dir=str(demo_model_dir), model_name=MODEL,
                        engine_options=DEMO_ENGINE, max_n=4)


@pytest.fixture(scope="session")
def engine(serve_options: ServeOptions) -> BackgroundGenerator:
    """The shared demo engine the server runs on."""
    return shared_generator(serve_options.model_dir, engine_options=DEMO_ENGINE)


@pytest.fixture(scope="session")
def server(engine: BackgroundGenerator, serve_options: ServeOptions) -> Iterator[ServerThread]:
    from dyngen_core.serve.app import create_app
    from dyngen_core.serve.server import ServerThread

    with ServerThread(create_app(engine, serve_options)) as running:
        yield running


@pytest.fixture(scope="session")
def keyed_server(engine: BackgroundGenerator,
                 serve_options: ServeOptions) -> Iterator[ServerThread]:
    """A second server over the same engine that requires `API_KEY`."""
    from dyngen_core.serve.app import create_app
    from dyngen_core.serve.server import ServerThread

    options = ServeOptions(model_dir=serve_options.model_dir, model_name=MODEL,
                           engine_options=DEMO_ENGINE, api_key=API_KEY)
    with ServerThread(create_app(engine, options)) as running:
        yield running


@pytest.fixture
def client(server: ServerThread) -> Any:
    """The official OpenAI client pointed at the server."""
    import openai

    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0,
                         timeout=120)


def idle_stats(engine: BackgroundGenerator, limit_s: float = 120.0) -> Any:
    """The engine's stats once it runs nothing."""
    return engine.wait_idle(timeout=limit_s)
