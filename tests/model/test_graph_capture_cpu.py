"""`ops.graph_capture.collector_paused`, the guard every CUDA graph capture runs under: Python's
cyclic collector is off inside it and comes back as it was, also after an error. CPU only; the
capture itself is tested on CUDA in tests/gpu/test_graph_capture.py."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest

from dyngen_core.ops.graph_capture import collector_paused


@pytest.fixture(autouse=True)
def _collector_left_as_found() -> Iterator[None]:
    enabled = gc.isenabled()
    yield
    (gc.enable if enabled else gc.disable)()


def test_the_collector_is_off_inside_and_back_on_after() -> None:
    gc.enable()
    with collector_paused():
        assert not gc.isenabled()
    assert gc.isenabled()


def test_a_collector_the_caller_disabled_stays_disabled() -> None:
    gc.disable()
    with collector_paused():
        assert not gc.isenabled()
    assert not gc.isenabled()


def test_the_collector_comes_back_after_an_error() -> None:
    gc.enable()
    with pytest.raises(RuntimeError, match="inside"), collector_paused():
        raise RuntimeError("inside")
    assert gc.isenabled()
