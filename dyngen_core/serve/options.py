"""What one ``dyngen serve`` process runs with: `ServeOptions`, and the command-line arguments
that fill it. Imports neither FastAPI nor the engine."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field
from pathlib import Path

from dyngen_core import EngineOptions

# The environment variable read when --api-key is not given.
API_KEY_ENV = "DYNGEN_API_KEY"


@dataclass(frozen=True)
class ServeOptions:
    """A server's settings.

    model_dir: the model folder the engine runs.
    model_name: the id clients pass as ``model`` and see in ``/v1/models`` (default: the
        folder's name).
    host, port: where to listen (port 0: any free port).
    api_key: when set, every ``/v1`` request must send ``Authorization: Bearer <api_key>``;
        ``/health`` and ``/metrics`` stay open.
    engine_options: the engine's `EngineOptions` (the same engine `shared_generator` gives
        the adapters for this folder and options).
    max_n: the most choices (``n``) one request may ask for.
    log_level: uvicorn's log level.
    """

    model_dir: str
    model_name: str = ""
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    engine_options: EngineOptions = field(default_factory=EngineOptions)
    max_n: int = 16
    log_level: str = "info"

    def __post_init__(self) -> None:
        if not self.model_name:
            object.__setattr__(self, "model_name", Path(self.model_dir).name)
        if self.api_key == "":
            raise ValueError("api_key is empty; pass a non-empty key, or None for no key")
        if self.max_n < 1:
            raise ValueError(f"max_n must be >= 1; got {self.max_n}")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be 0 to 65535 (0: any free port); got {self.port}")


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """The server's own arguments (``dyngen serve`` adds the engine's beside them)."""
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.add_argument("--port", type=int, default=8000, help="port (0: any free port)")
    parser.add_argument("--api-key", default=None,
                        help=f"require 'Authorization: Bearer KEY' on /v1 (default: "
                        f"${API_KEY_ENV} when set, else no key)")
    parser.add_argument("--served-model-name", default=None,
                        help="the model id clients pass (default: the folder's name)")
    parser.add_argument("--max-batch-size", type=int, default=256, help="most running jobs")
    parser.add_argument("--max-chunk-size", type=int, default=None,
                        help="most prompt tokens prefilled per step (default: the engine's)")
    parser.add_argument("--max-n", type=int, default=16, help="most choices (n) per request")
    parser.add_argument("--log-level", default="info",
                        choices=("critical", "error", "warning", "info", "debug"))


def serve_options(args: argparse.Namespace, model_dir: str) -> ServeOptions:
    """`ServeOptions` from parsed ``dyngen serve`` arguments (engine ones included)."""
    engine = {name: getattr(args, name) for name in ("device", "dtype", "cache_tokens",
                                                      "cache_mode", "max_batch_size",
                                                      "max_chunk_size", "tensor_parallel")
              if getattr(args, name, None) is not None}
    return ServeOptions(
        model_dir=model_dir,
        model_name=args.served_model_name or "",
        host=args.host,
        port=args.port,
        api_key=args.api_key or os.environ.get(API_KEY_ENV) or None,
        engine_options=EngineOptions(**engine),
        max_n=args.max_n,
        log_level=args.log_level,
    )
