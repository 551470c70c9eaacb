"""ChatDynGen against the demo model: stop sequences, streaming and callbacks, usage, tools
(tool_choice, parallel calls, tool results), structured output by function calling."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from langchain_core.callbacks import AsyncCallbackHandler, BaseCallbackHandler
from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
from langchain_dyngen import ChatDynGen
from pydantic import BaseModel, Field
from typing_extensions import TypedDict

pytestmark = pytest.mark.demo

QUESTION = "Name three colours of the rainbow."


@pytest.fixture
def chat(demo_params: dict[str, Any]) -> ChatDynGen:
    return ChatDynGen(**demo_params, temperature=0, max_tokens=12)


class TokenCounter(BaseCallbackHandler):
    def __init__(self) -> None:
        self.tokens: list[str] = []

    def on_llm_new_token(self, token: str, **kwargs: Any) -> None:
        self.tokens.append(token)


def _stop_word(text: str) -> str:
    """A word from the middle of ``text`` (not its first), to stop on."""
    words = [w for w in text.split() if len(w) > 2]
    assert len(words) >= 3, text
    return words[len(words) // 2]


def test_stop_sequences_cut_the_reply_exactly(chat: ChatDynGen, demo_params: dict) -> None:
    full = chat.invoke(QUESTION).text
    stop = _stop_word(full)
    expected = full[:full.index(stop)]
    cut = chat.invoke(QUESTION, stop=[stop])
    assert cut.text == expected
    assert cut.response_metadata["finish_reason"] == "stop"
    assert cut.response_metadata["eos_reason"] == "stop_string"
    streamed = "".join(c.text for c in chat.stream(QUESTION, stop=[stop]))
    assert streamed == expected
    fielded = ChatDynGen(**demo_params, temperature=0, max_tokens=12, stop=[stop])
    assert fielded.invoke(QUESTION).text == expected


def test_stream_yields_tokens_as_generated_and_callbacks_see_them(chat: ChatDynGen) -> None:
    counter = TokenCounter()
    chunks = list(chat.stream(QUESTION, config={"callbacks": [counter]}))
    texts = [c.text for c in chunks if c.text]
    assert len(texts) >= 5  # token by token, not one block
    assert "".join(counter.tokens) == "".join(texts)
    last = chunks[-1]
    assert last.chunk_position == "last" and last.usage_metadata is not None
    assert last.usage_metadata["output_tokens"] == 12
    assert last.response_metadata["finish_reason"] == "length"


@pytest.mark.parametrize("streaming", [False, True])
def test_invoke_fires_on_llm_new_token(demo_params: dict, streaming: bool) -> None:
    chat = ChatDynGen(**demo_params, temperature=0, max_tokens=6, streaming=streaming)
    counter = TokenCounter()
    message = chat.invoke(QUESTION, config={"callbacks": [counter]})
    assert len([t for t in counter.tokens if t]) >= 3
    assert "".join(counter.tokens) == message.text


async def test_async_calls_match_sync_calls(chat: ChatDynGen) -> None:
    expected = chat.invoke(QUESTION).text
    assert (await chat.ainvoke(QUESTION)).text == expected
    assert "".join([c.text async for c in chat.astream(QUESTION)]) == expected
    assert [m.text for m in await chat.abatch([QUESTION, QUESTION])] == [expected, expected]


async def test_async_calls_leave_the_event_loop_free(chat: ChatDynGen) -> None:
    """While tokens arrive, other tasks on the loop keep running (no blocking wait)."""
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await asyncio.sleep(0.001)

    seen: list[int] = []

    class Recorder(AsyncCallbackHandler):
        async def on_llm_new_token(self, token: str, **kwargs: Any) -> None:
            seen.append(ticks)

    task = asyncio.create_task(ticker())
    try:
        await chat.ainvoke(QUESTION, config={"callbacks": [Recorder()]})
    finally:
        task.cancel()
    assert len(seen) >= 5 and seen[-1] > seen[0]


class GetWeather(BaseModel):
    """Get the current weather in a city."""

    city: str = Field(description="the city name")


class Add(BaseModel):
    """Add two integers."""

    a: int
    b: int


def test_a_named_tool_choice_forces_that_call(chat: ChatDynGen) -> None:
    bound = chat.bind_tools([GetWeather, Add], tool_choice="Add", max_tokens=40)
    message = bound.invoke("What is 2 plus 3?")
    assert [c["name"] for c in message.tool_calls] == ["Add"]
    call = message.tool_calls[0]
    assert set(call["args"]) == {"a", "b"}
    assert all(isinstance(v, int) for v in call["args"].values())
    assert call["id"] and call["id"].startswith("call_")
    assert message.response_metadata["finish_reason"] == "tool_calls"
    streamed: Any = None
    for chunk in bound.stream("What is 2 plus 3?"):
        streamed = chunk if streamed is None else streamed + chunk
    assert [(c["name"], c["args"]) for c in streamed.tool_calls] == [("Add", call["args"])]


def test_stop_sequences_never_cut_a_forced_call(chat: ChatDynGen) -> None:
    """"a" and '"' occur in the call {"a": 2, "b": 3}: a forced call is written whole."""
    bound = chat.bind_tools([GetWeather, Add], tool_choice="Add", max_tokens=40)
    message = bound.invoke("What is 2 plus 3?", stop=["a", '"'])
    assert not message.invalid_tool_calls, message.invalid_tool_calls
    assert [c["name"] for c in message.tool_calls] == ["Add"]
    assert set(message.tool_calls[0]["args"]) == {"a", "b"}
    assert message.response_metadata["finish_reason"] == "tool_calls"


def test_any_forces_a_call_and_none_forbids_one(chat: ChatDynGen) -> None:
    forced = chat.bind_tools([GetWeather, Add], tool_choice="any", parallel_tool_calls=False,
                             max_tokens=40).invoke("How is the weather in Paris?")
    assert len(forced.tool_calls) == 1
    assert forced.tool_calls[0]["name"] in {"GetWeather", "Add"}
    plain = chat.bind_tools([GetWeather, Add], tool_choice="none").invoke(
        "How is the weather in Paris?")
    assert not plain.tool_calls and plain.text


def test_parallel_tool_calls_follow_a_worked_example(chat: ChatDynGen) -> None:
    history = [
        HumanMessage("How is the weather in Paris and in Oslo?"),
        AIMessage("", tool_calls=[
            {"name": "GetWeather", "args": {"city": "Paris"}, "id": "call_1"},
            {"name": "GetWeather", "args": {"city": "Oslo"}, "id": "call_2"}]),
        ToolMessage("sunny", tool_call_id="call_1"),
        ToolMessage("rainy", tool_call_id="call_2"),
        AIMessage("Paris is sunny and Oslo is rainy."),
        HumanMessage("How is the weather in Rome and in Madrid?"),
    ]
    message = chat.bind_tools([GetWeather], tool_choice="any", max_tokens=40).invoke(history)
    assert [c["name"] for c in message.tool_calls] == ["GetWeather", "GetWeather"]
    assert {c["args"]["city"] for c in message.tool_calls} == {"Rome", "Madrid"}
    assert len({c["id"] for c in message.tool_calls}) == 2


def test_tool_results_feed_the_next_turn(chat: ChatDynGen) -> None:
    history = [
        HumanMessage("How is the weather in Paris?"),
        AIMessage("", tool_calls=[{"name": "GetWeather", "args": {"city": "Paris"},
                                   "id": "call_9"}]),
        ToolMessage("It is sunny and 24 degrees.", tool_call_id="call_9"),
    ]
    reply = chat.bind_tools([GetWeather]).invoke(history, max_tokens=20)
    assert not reply.tool_calls and reply.text


class Person(BaseModel):
    """A person."""

    name: str
    age: int


class PersonDict(TypedDict):
    """A person."""

    name: str
    age: int


@pytest.mark.parametrize("schema", [Person, PersonDict, Person.model_json_schema()])
@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_structured_output_follows_the_schema(chat: ChatDynGen, schema: Any,
                                              method: str) -> None:
    structured = chat.with_structured_output(schema, method=method)  # type: ignore[arg-type]
    result = structured.invoke("Alice is 30 years old. Who is she?", max_tokens=30)
    data = result.model_dump() if isinstance(result, BaseModel) else result
    assert isinstance(result, Person) == (schema is Person)
    assert set(data) == {"name", "age"} and isinstance(data["age"], int)


def test_json_mode_gives_a_json_object(chat: ChatDynGen) -> None:
    raw = chat.with_structured_output(None, method="json_mode",  # type: ignore[arg-type]
                                      include_raw=True)
    out = raw.invoke("Give a JSON object with a key 'colour'.", max_tokens=16)
    assert out["parsing_error"] is None and isinstance(out["parsed"], dict)
