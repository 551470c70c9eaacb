"""Helpers for the tests of calls that must never hang: run a call on a thread with a limit, an
engine whose step hangs, and the BaseException a native library's panic surfaces as."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest


class NativePanic(BaseException):
    """What a native library's panic surfaces as (pyo3's PanicException is a BaseException)."""


def in_thread(call: Callable[[], Any], limit_s: float = 60.0) -> Any:
    """Run ``call`` on a thread; its result, or what it raised. Fails the test when the call
    is still waiting after ``limit_s`` (it would hang)."""
    outcome: list[Any] = []

    def run() -> None:
        try:
            outcome.append(call())
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            outcome.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(limit_s)
    assert outcome, f"the call was still waiting after {limit_s} s"
    return outcome[0]


@contextmanager
def stuck(engine: Any, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Inside the block, the background engine's next step hangs (as a native call may); it
    goes on when the block ends."""
    released = threading.Event()
    iterate = engine.generator.iterate

    def stuck_iterate() -> Any:
        released.wait(120)
        return iterate()

    monkeypatch.setattr(engine.generator, "iterate", stuck_iterate)
    try:
        yield
    finally:
        released.set()
