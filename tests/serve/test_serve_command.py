"""``dyngen serve`` as a command: it starts, serves the demo model, and stops on SIGTERM."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

pytestmark = pytest.mark.demo
REPO = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_dyngen_serve_answers_and_stops(demo_model_dir: Path) -> None:
    port = _free_port()
    paths = [str(REPO), os.environ.get("PYTHONPATH", "")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in paths if p)}
    server = subprocess.Popen(
        [sys.executable, "-m", "dyngen_core", "serve", "--model", str(demo_model_dir),
         "--port", str(port), "--cache-tokens", "2048", "--api-key", "k",
         "--log-level", "warning"], env=env, cwd=REPO)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            assert server.poll() is None, "dyngen serve exited early"
            assert time.monotonic() < deadline, "dyngen serve did not start in 180 s"
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.5)
        reply = httpx.post(url + "/v1/completions", headers={"Authorization": "Bearer k"},
                           json={"model": demo_model_dir.name, "prompt": "One, two,",
                                 "max_tokens": 2, "temperature": 0}, timeout=60)
        assert reply.status_code == 200, reply.text
        assert reply.json()["usage"]["completion_tokens"] == 2
    finally:
        server.send_signal(signal.SIGTERM)
        # uvicorn shuts down, then re-raises the signal it caught (exit status -SIGTERM).
        assert server.wait(timeout=60) in (0, -signal.SIGTERM)
