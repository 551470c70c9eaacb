"""`run_replicas` keeps its SIGTERM handler past ``ray.init``, which puts in its own: a SIGTERM
(what systemd, Docker and Kubernetes send) then interrupts the serving loop, and the clean-up
(the application removed, Serve and Ray shut down) runs whole. Ray's handler ended the process
seconds later, mid clean-up, leaving Ray's agents running. Ray and Serve are stand-ins here (no
cluster starts); the signal is real."""

from __future__ import annotations

import os
import signal
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("ray")

from dyngen_core.serve.options import ServeOptions  # noqa: E402
from dyngen_core.serve.replicas import cluster  # noqa: E402
from dyngen_core.serve.replicas.options import ReplicaOptions  # noqa: E402


class RaysOwnHandler(Exception):
    """What the stand-in of Ray's SIGTERM handler raises (Ray's ends the process)."""


def test_sigterm_runs_the_whole_clean_up(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []

    def ray_init(**_: Any) -> None:
        def rays_handler(signum: int, frame: Any) -> None:
            raise RaysOwnHandler

        signal.signal(signal.SIGTERM, rays_handler)  # as ray.init does in a driver
        calls.append("ray.init")

    def deploy(*_: Any) -> None:
        calls.append("deploy")
        os.kill(os.getpid(), signal.SIGTERM)  # delivered in the serving loop's sleep

    monkeypatch.setattr(cluster, "ray", SimpleNamespace(
        init=ray_init, shutdown=lambda: calls.append("ray.shutdown")))
    monkeypatch.setattr(cluster, "serve", SimpleNamespace(
        delete=lambda name: calls.append(f"serve.delete {name}"),
        shutdown=lambda: calls.append("serve.shutdown")))
    monkeypatch.setattr(cluster, "deploy", deploy)
    previous = signal.getsignal(signal.SIGTERM)
    try:
        with pytest.raises(KeyboardInterrupt):
            cluster.run_replicas(ServeOptions(model_dir="unused"), ReplicaOptions(replicas=1))
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert calls == ["ray.init", "deploy", f"serve.delete {cluster.APP_NAME}", "serve.shutdown",
                     "ray.shutdown"]
