"""Every LLM endpoint, sync / async / streaming, on the demo model, plus metadata, callbacks,
the shared queue under concurrency, and cancellation of abandoned streams."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest
from llama_index.core.callbacks import CallbackManager, CBEventType, LlamaDebugHandler
from llama_index.core.llms import ChatMessage
from llama_index.llms.dyngen import DynGenLLM

pytestmark = pytest.mark.demo

PROMPT = "The capital of France is"
STORY = "Once upon a time, in a land far away, there lived a dragon who"
CHAT = [ChatMessage(role="user", content="What is the capital of France?")]


def test_metadata_comes_from_the_model_and_the_cache(llm: DynGenLLM) -> None:
    meta = llm.metadata
    assert meta.model_name == "SmolLM2-135M-Instruct"
    assert meta.context_window == 8192  # min(max_position_embeddings 8192, cache 8192 tokens)
    assert meta.num_output == 6 and meta.is_chat_model and meta.is_function_calling_model
    smaller = DynGenLLM(model_dir=llm.model_dir, context_window=1024, max_tokens=3,
                        engine_options=llm.engine_options)
    assert smaller.metadata.context_window == 1024 and smaller.metadata.num_output == 3
    assert smaller.engine is llm.engine  # same folder and options: the same engine
    # A serialized LLM comes back on the same engine (engine options travel with it).
    assert DynGenLLM.from_dict(llm.to_dict()).engine is llm.engine


def test_complete_and_stream_complete_agree(llm: DynGenLLM) -> None:
    whole = llm.complete(PROMPT)
    assert whole.text.strip() and whole.raw["new_tokens"] <= 6
    assert whole.raw["eos_reason"] in ("max_new_tokens", "stop_token")
    chunks = list(llm.stream_complete(PROMPT))
    assert "".join(c.delta or "" for c in chunks) == chunks[-1].text == whole.text
    assert chunks[-1].raw["prompt_tokens"] == whole.raw["prompt_tokens"]


def test_chat_uses_the_chat_template_and_streams_the_same_reply(llm: DynGenLLM) -> None:
    reply = llm.chat(CHAT)
    assert reply.message.role == "assistant" and reply.message.content
    # The template adds SmolLM's default system turn and the assistant header.
    assert reply.raw["prompt_tokens"] > len(llm.engine.tokenizer.encode(CHAT[0].content))
    streamed = list(llm.stream_chat(CHAT))
    assert "".join(r.delta or "" for r in streamed) == streamed[-1].message.content
    assert streamed[-1].message.content == reply.message.content


def test_async_endpoints_match_the_sync_ones(llm: DynGenLLM) -> None:
    async def run() -> tuple[Any, ...]:
        completion = await llm.acomplete(PROMPT)
        chunks = [c async for c in await llm.astream_complete(PROMPT)]
        chat = await llm.achat(CHAT)
        chat_chunks = [c async for c in await llm.astream_chat(CHAT)]
        return completion, chunks, chat, chat_chunks

    completion, chunks, chat, chat_chunks = asyncio.run(run())
    assert completion.text == chunks[-1].text == llm.complete(PROMPT).text
    assert chat.message.content == chat_chunks[-1].message.content
    assert "".join(c.delta or "" for c in chat_chunks) == chat.message.content


def test_per_call_options_override_the_fields(llm: DynGenLLM) -> None:
    short = llm.complete(PROMPT, max_tokens=2)
    assert short.raw["new_tokens"] == 2
    stopped = llm.complete("Count: 1, 2, 3,", max_tokens=6, stop=[","])
    assert "," not in stopped.text
    with pytest.raises(TypeError, match="temprature"):
        llm.complete(PROMPT, temprature=0.3)


def test_async_calls_run_as_concurrent_jobs_in_one_engine(llm: DynGenLLM, probe: Any) -> None:
    # If an async call blocked the event loop, the jobs would run one after another.
    async def fan_out() -> list[Any]:
        prompts = [f"{PROMPT} {i}" for i in range(6)]
        return await asyncio.gather(*(llm.acomplete(p, max_tokens=4) for p in prompts))

    replies = asyncio.run(fan_out())
    assert len(replies) == 6 and all(r.raw["new_tokens"] >= 1 for r in replies)
    assert probe.most_jobs == 6  # one loop iteration's jobs go to the engine together


def test_threads_share_the_queue(llm: DynGenLLM, probe: Any) -> None:
    texts: list[str] = []
    started = threading.Barrier(4)

    def call(i: int) -> None:
        started.wait()
        texts.append(llm.complete(f"Story {i}:", max_tokens=4).text)

    threads = [threading.Thread(target=call, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(texts) == 4 and len(probe.handles) == 4
    assert all(str(h.result()["eos_reason"]) != "error" for h in probe.handles)


def test_callbacks_see_every_call(demo_model_dir: Any, llm: DynGenLLM) -> None:
    handler = LlamaDebugHandler()
    traced = DynGenLLM(model_dir=str(demo_model_dir), max_tokens=2, temperature=0.0,
                       engine_options=llm.engine_options,
                       callback_manager=CallbackManager([handler]))
    traced.complete(PROMPT)
    list(traced.stream_chat(CHAT))
    asyncio.run(traced.achat(CHAT))
    pairs = handler.get_event_pairs(CBEventType.LLM)
    assert len(pairs) == 3
    assert all(end.payload for _, end in pairs)


def test_an_abandoned_stream_cancels_its_job(llm: DynGenLLM, probe: Any) -> None:
    stream = llm.stream_complete(STORY, max_tokens=200)
    assert next(stream).delta
    stream.close()  # what a consumer's `break` does to a generator
    final = probe.handles[0].result(timeout=60)
    assert str(final["eos_reason"]) == "cancelled" and final["new_tokens"] < 200


def test_a_cancelled_async_task_cancels_its_job(llm: DynGenLLM, probe: Any) -> None:
    async def run() -> None:
        task = asyncio.ensure_future(llm.acomplete(STORY, max_tokens=200))
        while not probe.handles:
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(run())
    final = probe.handles[0].result(timeout=60)
    assert str(final["eos_reason"]) == "cancelled" and final["new_tokens"] < 200
