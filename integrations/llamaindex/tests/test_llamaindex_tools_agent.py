"""Tool calling on the demo model: forced calls are decoded under the tools' schemas, partial
streams parse, and a FunctionAgent completes a two-tool task."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from llama_index.core.agent.workflow import FunctionAgent, ToolCallResult
from llama_index.core.tools import FunctionTool
from llama_index.llms.dyngen import DynGenLLM

pytestmark = pytest.mark.demo


def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


def shout(text: str) -> str:
    """Upper-case a text."""
    return text.upper()


TOOLS = [FunctionTool.from_defaults(fn=add), FunctionTool.from_defaults(fn=shout)]


@pytest.fixture(scope="module")
def tool_llm(llm: DynGenLLM) -> DynGenLLM:
    return DynGenLLM(model_dir=llm.model_dir, max_tokens=40, temperature=0.0,
                     engine_options=llm.engine_options)


def test_a_required_call_matches_the_tool_schema(tool_llm: DynGenLLM) -> None:
    response = tool_llm.chat_with_tools(TOOLS, user_msg="What is 2 plus 3?", tool_required=True)
    calls = tool_llm.get_tool_calls_from_response(response)
    assert len(calls) == 1 and calls[0].tool_name in ("add", "shout")
    schema = {"add": {"a", "b"}, "shout": {"text"}}[calls[0].tool_name]
    assert set(calls[0].tool_kwargs) == schema
    if calls[0].tool_name == "add":
        assert all(isinstance(v, int) for v in calls[0].tool_kwargs.values())


def test_a_named_tool_choice_forces_that_tool_and_predict_and_call_runs_it(
    tool_llm: DynGenLLM,
) -> None:
    response = tool_llm.chat_with_tools(TOOLS, user_msg="Shout 'hi'.", tool_choice="add")
    [call] = tool_llm.get_tool_calls_from_response(response)
    assert call.tool_name == "add" and set(call.tool_kwargs) == {"a", "b"}
    out = asyncio.run(tool_llm.apredict_and_call(
        TOOLS, user_msg="Add 20 and 22.", tool_choice="add", error_on_tool_error=True))
    assert out.sources[0].tool_name == "add" and not out.sources[0].is_error
    assert out.response == str(add(**out.sources[0].raw_input["kwargs"]))


def test_partial_streamed_responses_parse_without_errors(tool_llm: DynGenLLM) -> None:
    seen = []
    for partial in tool_llm.stream_chat_with_tools(TOOLS, user_msg="What is 4 plus 5?",
                                                   tool_required=True):
        seen.append(tool_llm.get_tool_calls_from_response(partial, error_on_no_tool_call=False))
    assert len(seen) > 2 and seen[0] == [] and len(seen[-1]) == 1
    assert {c.tool_id for s in seen for c in s} == {seen[-1][0].tool_id}


def test_auto_choice_lets_the_model_answer_in_text(tool_llm: DynGenLLM) -> None:
    response = tool_llm.chat_with_tools(TOOLS, user_msg="Say hello.", max_tokens=8)
    assert response.message.content is not None


# A small model follows examples better than instructions: show it the two-call answer shape.
AGENT_SYSTEM = (
    "Answer questions with the tools. Call every tool the question needs at once, e.g. for "
    '"weather and time in Rome" answer: [{"name": "get_weather", "arguments": {"city": '
    '"Rome"}}, {"name": "get_time", "arguments": {"city": "Rome"}}]. Then answer from the '
    "results."
)


def test_function_agent_completes_a_two_tool_task(llm: DynGenLLM) -> None:
    calls: list[tuple[str, str]] = []

    def get_weather(city: str) -> str:
        calls.append(("get_weather", city))
        return f"It is sunny in {city}."

    def get_time(city: str) -> str:
        calls.append(("get_time", city))
        return f"It is 10:00 in {city}."

    tools: list[Any] = [
        FunctionTool.from_defaults(get_weather, description="Current weather in a city."),
        FunctionTool.from_defaults(get_time, description="Current local time in a city."),
    ]
    agent_llm = DynGenLLM(model_dir=llm.model_dir, max_tokens=40, temperature=0.0,
                          engine_options=llm.engine_options)
    # The first step must call tools (constrained to the tools' schemas); the next one is free
    # to call more or to answer, and an answer ends the run.
    agent = FunctionAgent(tools=tools, llm=agent_llm, system_prompt=AGENT_SYSTEM,
                          initial_tool_choice="required")

    async def run() -> tuple[Any, list[ToolCallResult]]:
        handler = agent.run("What are the weather and time in Oslo?", max_iterations=4)
        results = [ev async for ev in handler.stream_events() if isinstance(ev, ToolCallResult)]
        return await handler, results

    answer, results = asyncio.run(run())
    assert sorted(calls) == [("get_time", "Oslo"), ("get_weather", "Oslo")], calls
    assert len(results) == 2 and not any(r.tool_output.is_error for r in results)
    assert str(answer).strip()
