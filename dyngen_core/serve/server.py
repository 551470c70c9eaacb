"""Running the application with uvicorn: `run_server` (blocking, for ``dyngen serve``) and
`ServerThread` (on a background thread, for tests, benchmarks and notebooks).

uvicorn is the ASGI server FastAPI documents and the one most OpenAI-compatible servers use;
its event loop runs the endpoints, while the engine steps on its own thread (the shared
`BackgroundGenerator`), so a slow step never blocks accepting or streaming.
"""

from __future__ import annotations

import threading
import time
from types import TracebackType

import uvicorn
from fastapi import FastAPI

from dyngen_core import shared_generator
from dyngen_core.serve.app import create_app
from dyngen_core.serve.options import ServeOptions

# How long `ServerThread` waits for uvicorn to start listening, and to stop.
_START_WAIT_S = 60.0
_STOP_WAIT_S = 30.0


def build_app(options: ServeOptions) -> FastAPI:
    """The application over the shared engine for ``options`` (loads the model on first
    use; adapters in the same process pointed at the same folder and options share it)."""
    engine = shared_generator(options.model_dir, engine_options=options.engine_options)
    return create_app(engine, options)


def run_server(options: ServeOptions) -> None:
    """Serve until interrupted (Ctrl-C or SIGTERM)."""
    app = build_app(options)
    uvicorn.run(app, host=options.host, port=options.port, log_level=options.log_level,
                timeout_graceful_shutdown=5)


class ServerThread:
    """An application served by uvicorn on a daemon thread, as a context manager::

        with ServerThread(app) as server:
            client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused")

    host, port: where to listen (port 0, the default: a free port, read from `port` once
    started). log_level: uvicorn's.
    """

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int = 0,
                 log_level: str = "warning") -> None:
        config = uvicorn.Config(app, host=host, port=port, log_level=log_level,
                                timeout_graceful_shutdown=2, lifespan="off")
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, name="dyngen-serve",
                                        daemon=True)
        self.host = host
        self.port = port

    @property
    def base_url(self) -> str:
        """``http://host:port`` (add ``/v1`` for OpenAI clients)."""
        return f"http://{self.host}:{self.port}"

    def start(self) -> ServerThread:
        """Start serving; returns once uvicorn listens (raises RuntimeError if it does not
        within a minute)."""
        self._thread.start()
        deadline = time.monotonic() + _START_WAIT_S
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"uvicorn did not start on {self.host}:{self.port}; see its "
                                   "log above (is the port taken?)")
            time.sleep(0.01)
        sockets = [s for server in self._server.servers for s in server.sockets]
        self.port = int(sockets[0].getsockname()[1])
        return self

    def stop(self) -> None:
        """Stop serving and wait for uvicorn to close its connections."""
        self._server.should_exit = True
        self._thread.join(timeout=_STOP_WAIT_S)

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:
        self.stop()
