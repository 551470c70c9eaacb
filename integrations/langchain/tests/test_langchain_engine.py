"""The engine behind the LangChain objects: one shared engine, real concurrency, prefix sharing,
and cancellation that frees pages. Assertions are on engine statistics, never on timing."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from langchain_dyngen import ChatDynGen, DynGenLLM
from langchain_dyngen._engine import engine_for

from dyngen_core import shared_generator
from dyngen_core.errors import EngineStoppedError, JobTooLargeError
from tests.hang_guard import NativePanic, in_thread, stuck

pytestmark = pytest.mark.demo


@pytest.fixture
def chat(demo_params: dict[str, Any]) -> ChatDynGen:
    return ChatDynGen(**demo_params, temperature=0, max_tokens=8)


@pytest.fixture
def submitted(engine: Any, monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """Every handle the engine hands out during the test, in submission order."""
    handles: list[Any] = []
    submit, submit_many = engine.submit, engine.submit_many

    def record(job: Any) -> Any:
        handles.append(submit(job))
        return handles[-1]

    def record_many(jobs: Any) -> Any:
        handles.extend(submit_many(jobs))
        return handles[-len(jobs):]

    monkeypatch.setattr(engine, "submit", record)
    monkeypatch.setattr(engine, "submit_many", record_many)
    return handles


def _document(words: int = 420) -> str:
    """A document no earlier test has cached (its first words are unique)."""
    return f"Document {uuid.uuid4().hex}. " + " ".join(
        f"Item {i} is stored in bin {i % 7}." for i in range(words // 7))


def test_objects_on_one_folder_share_one_engine(demo_params: dict[str, Any], engine: Any) -> None:
    first = ChatDynGen(**demo_params, temperature=0.3)
    second = ChatDynGen(**demo_params, max_tokens=3)
    llm = DynGenLLM(**demo_params)
    engines = {id(engine_for(m.model_dir, m.engine_options)) for m in (first, second, llm)}
    assert engines == {id(engine)}
    assert shared_generator(demo_params["model_dir"], **{k: v for k, v in demo_params.items()
                                                          if k != "model_dir"}) is engine
    # What one object computed, the other reads from the shared cache.
    prompt = "Repeat after me: " + _document(300)
    first.invoke(prompt, max_tokens=1)
    again = second.invoke(prompt, max_tokens=1)
    assert again.usage_metadata is not None
    assert again.usage_metadata["input_token_details"]["cache_read"] >= 256


async def test_abatch_puts_64_inputs_in_the_engine_at_once(
    chat: ChatDynGen, watcher: Callable[[], Any], idle: Callable[[], Any]
) -> None:
    idle()
    prompts = [f"Count from {i} to {i + 40}, one number per line." for i in range(64)]
    with watcher() as seen:
        answers = await chat.abatch(prompts, max_tokens=6)
    assert len(answers) == 64 and all(a.content for a in answers)
    assert seen.most == 64


def test_batch_prefills_a_shared_document_once(
    chat: ChatDynGen, idle: Callable[[], Any]
) -> None:
    document = _document()
    inputs = [[("system", f"Answer from this document.\n{document}"),
               ("human", f"Which bin holds item {i}?")] for i in range(32)]
    before = idle()
    answers = chat.batch(inputs, max_tokens=2)
    after = idle()
    _assert_prefilled_once(chat, document, answers, before, after)


def test_thread_pool_invokes_share_a_document_prefill(
    chat: ChatDynGen, idle: Callable[[], Any]
) -> None:
    document = _document()
    inputs = [[("system", f"Answer from this document.\n{document}"),
               ("human", f"Which bin holds item {i}?")] for i in range(32)]
    before = idle()
    with ThreadPoolExecutor(max_workers=32) as pool:
        answers = list(pool.map(lambda m: chat.invoke(m, max_tokens=2), inputs))
    after = idle()
    _assert_prefilled_once(chat, document, answers, before, after)


def _assert_prefilled_once(chat: ChatDynGen, document: str, answers: list[Any], before: Any,
                           after: Any) -> None:
    """The document's full pages were computed for one prompt only: every other prompt read
    them (from pages shared with a running job, or from the prompt cache)."""
    shared = len(chat.get_token_ids(document)) // 256 * 256  # prompts share at least this
    assert shared >= 256
    usage = [a.usage_metadata for a in answers]
    reads = [u["input_token_details"]["cache_read"] for u in usage]
    assert sum(r >= shared for r in reads) >= len(answers) - 1
    computed = after.prefill_tokens_computed - before.prefill_tokens_computed
    reused = after.prefill_tokens_reused - before.prefill_tokens_reused
    assert reused >= (len(answers) - 1) * shared
    assert computed <= sum(u["input_tokens"] for u in usage) - (len(answers) - 1) * shared


def test_breaking_out_of_a_stream_cancels_the_job_and_frees_its_pages(
    chat: ChatDynGen, submitted: list[Any], idle: Callable[[], Any]
) -> None:
    idle()
    for chunk in chat.stream("Write a long story about a dragon.", max_tokens=400):
        assert chunk.content
        break
    final = submitted[-1].result(timeout=120)
    assert str(final["eos_reason"]) == "cancelled" and final["new_tokens"] < 400
    assert idle().pages_referenced == 0


async def test_breaking_out_of_an_async_stream_cancels_the_job(
    chat: ChatDynGen, submitted: list[Any], idle: Callable[[], Any]
) -> None:
    stream = chat.astream("Write a long story about a dragon.", max_tokens=400)
    async for _chunk in stream:
        break
    await stream.aclose()  # what `async for` leaves to the garbage collector, done now
    final = await asyncio.to_thread(submitted[-1].result, 120)
    assert str(final["eos_reason"]) == "cancelled" and final["new_tokens"] < 400
    assert (await asyncio.to_thread(idle)).pages_referenced == 0


async def test_cancelling_an_async_task_cancels_its_job(
    chat: ChatDynGen, submitted: list[Any], idle: Callable[[], Any]
) -> None:
    task = asyncio.create_task(chat.ainvoke("Write a long story about a dragon.",
                                            max_tokens=400))
    while not submitted or not submitted[-1].job.new_token_ids:
        await asyncio.sleep(0.01)
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    final = await asyncio.to_thread(submitted[-1].result, 120)
    assert str(final["eos_reason"]) == "cancelled" and final["new_tokens"] < 400
    assert (await asyncio.to_thread(idle)).pages_referenced == 0


def test_timeout_cancels_the_job_and_raises(
    demo_params: dict[str, Any], submitted: list[Any], idle: Callable[[], Any]
) -> None:
    slow = ChatDynGen(**demo_params, max_tokens=400, timeout=0.05)
    with pytest.raises(TimeoutError, match="timeout=0.05"):
        slow.invoke("Write a long story about a dragon.")
    assert str(submitted[-1].result(timeout=120)["eos_reason"]) == "cancelled"
    assert idle().pages_referenced == 0


def test_a_failing_batch_input_cancels_the_others_and_the_engine_keeps_running(
    demo_params: dict[str, Any], submitted: list[Any], idle: Callable[[], Any]
) -> None:
    chat = ChatDynGen(**demo_params, temperature=0, max_tokens=300, timeout=120)
    too_long = "word " * (demo_params["cache_tokens"] + 100)
    story = "Write a long story about a dragon."
    with pytest.raises(JobTooLargeError):
        chat.batch([story, too_long, story])
    assert [str(h.result(timeout=120)["eos_reason"]) for h in submitted] == ["cancelled"] * 2
    assert idle().pages_referenced == 0
    assert chat.invoke("Say hi.", max_tokens=2).text  # the engine thread is still serving



# A private engine (other options than the shared one), so faults injected into it harm no
# other test; it reuses the loaded weights.
FAULT_ENGINE: dict[str, Any] = {"cache_tokens": 2048, "max_batch_size": 4}




def test_timeout_raises_even_when_the_engine_is_stuck(
        demo_params: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    chat = ChatDynGen(**{**demo_params, **FAULT_ENGINE}, max_tokens=8, timeout=0.5)
    engine = engine_for(chat.model_dir, chat.engine_options)
    try:
        with stuck(engine, monkeypatch):
            started = time.monotonic()
            outcome = in_thread(lambda: chat.invoke("Say hi."))
            assert isinstance(outcome, TimeoutError) and "timeout=0.5" in str(outcome)
            assert time.monotonic() - started < 30
            outcome = in_thread(lambda: asyncio.run(chat.ainvoke("Say hi.")))
            assert isinstance(outcome, TimeoutError)
    finally:
        engine.close()


def test_a_dead_engine_fails_the_call_and_the_next_call_gets_a_new_engine(
        demo_params: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    chat = ChatDynGen(**{**demo_params, **FAULT_ENGINE}, temperature=0, max_tokens=4)
    engine = engine_for(chat.model_dir, chat.engine_options)

    def panicking_iterate() -> Any:
        raise NativePanic("the native library panicked")

    monkeypatch.setattr(engine.generator, "iterate", panicking_iterate)
    outcome = in_thread(lambda: chat.invoke("Say hi."))
    assert isinstance(outcome, EngineStoppedError) and "NativePanic" in str(outcome)
    assert isinstance(outcome.__cause__, NativePanic)
    assert in_thread(lambda: chat.invoke("Say hi.")).content  # served by a fresh engine
    replacement = engine_for(chat.model_dir, chat.engine_options)
    assert replacement is not engine and replacement.running
    replacement.close()
