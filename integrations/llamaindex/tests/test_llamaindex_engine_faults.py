"""The LLM when its engine is stuck, closed or dead: a timeout ends the call, and a closed or
dead engine is replaced on the next call."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
from llama_index.llms.dyngen import DynGenLLM

from dyngen_core.errors import EngineStoppedError
from tests.hang_guard import NativePanic, in_thread, stuck

pytestmark = pytest.mark.demo

# A private engine (other options than the shared one), so faults injected into it harm no
# other test; it reuses the loaded weights.
FAULT_ENGINE: dict[str, Any] = {"cache_tokens": 2048, "max_batch_size": 4}





@pytest.fixture
def faulty(demo_model_dir: Any) -> Any:
    llm = DynGenLLM(model_dir=str(demo_model_dir), max_tokens=4, temperature=0.0,
                    **FAULT_ENGINE)
    yield llm
    llm.engine.close()


def test_timeout_raises_even_when_the_engine_is_stuck(
        faulty: DynGenLLM, monkeypatch: pytest.MonkeyPatch) -> None:
    impatient = DynGenLLM(model_dir=faulty.model_dir, max_tokens=4, timeout=0.5,
                          engine_options=faulty.engine_options)
    engine = impatient.engine
    assert engine is faulty.engine
    with stuck(engine, monkeypatch):
        started = time.monotonic()
        outcome = in_thread(lambda: impatient.complete("Say hi."))
        assert isinstance(outcome, TimeoutError) and "timeout=0.5" in str(outcome)
        outcome = in_thread(lambda: asyncio.run(impatient.acomplete("Say hi.")))
        assert isinstance(outcome, TimeoutError)
        outcome = in_thread(lambda: list(impatient.stream_complete("Say hi.")))
        assert isinstance(outcome, TimeoutError)
        assert time.monotonic() - started < 30


def test_a_closed_engine_is_replaced_on_the_next_call(faulty: DynGenLLM) -> None:
    first = faulty.engine
    first.close()
    assert in_thread(lambda: faulty.complete("Say hi.")).text
    assert faulty.engine is not first and faulty.engine.running


def test_a_dead_engine_fails_the_call_and_the_next_call_gets_a_new_engine(
        faulty: DynGenLLM, monkeypatch: pytest.MonkeyPatch) -> None:
    engine = faulty.engine

    def panicking_iterate() -> Any:
        raise NativePanic("the native library panicked")

    monkeypatch.setattr(engine.generator, "iterate", panicking_iterate)
    outcome = in_thread(lambda: faulty.complete("Say hi."))
    assert isinstance(outcome, EngineStoppedError) and "NativePanic" in str(outcome)
    assert in_thread(lambda: faulty.complete("Say hi.")).text
    assert faulty.engine is not engine
