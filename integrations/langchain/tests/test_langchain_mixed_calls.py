"""Tool calls, structured output and plain calls gathered into one engine step give what each
gives alone: a constrained job never harms the plain jobs sampled beside it."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from langchain_dyngen import ChatDynGen
from pydantic import BaseModel, Field

pytestmark = pytest.mark.demo

QUESTION = "Name three colours of the rainbow."
WEATHER = "How is the weather in Paris?"
PERSON = "Alice is 30 years old. Who is she?"


class GetWeather(BaseModel):
    """Get the current weather in a city."""

    city: str = Field(description="the city name")


class Person(BaseModel):
    """A person."""

    name: str
    age: int


async def test_tools_and_structured_output_gathered_beside_plain_calls(
        demo_params: dict[str, Any]) -> None:
    chat = ChatDynGen(**demo_params, temperature=0, max_tokens=12)
    tools = chat.bind_tools([GetWeather], max_tokens=24)  # tool_choice "auto": a grammar too
    structured = chat.with_structured_output(Person)

    def calls() -> list[Any]:
        return [chat.ainvoke(QUESTION), tools.ainvoke(WEATHER),
                structured.ainvoke(PERSON, max_tokens=24), chat.ainvoke(WEATHER)]

    alone = [await call for call in calls()]
    together = await asyncio.gather(*calls())
    for solo, mixed in zip(alone, together):
        if isinstance(solo, Person):
            assert mixed == solo
            continue
        assert mixed.response_metadata["eos_reason"] != "error", mixed.response_metadata
        assert (mixed.text, mixed.tool_calls) == (solo.text, solo.tool_calls)


async def test_ngram_drafts_keep_gathered_outputs(demo_params: dict[str, Any]) -> None:
    """The same gathered calls through an engine that drafts by n-gram lookup (its own engine
    over the same weights) give the same replies, tool calls and structured objects."""
    plain = ChatDynGen(**demo_params, temperature=0, max_tokens=16)
    drafted = ChatDynGen(**demo_params, use_ngram_draft=True, temperature=0, max_tokens=16)
    copy = "Repeat exactly: the cat sat on the mat, the cat sat on the mat, the cat sat."

    def calls(chat: ChatDynGen) -> list[Any]:
        return [chat.ainvoke(copy), chat.bind_tools([GetWeather], max_tokens=24).ainvoke(WEATHER),
                chat.with_structured_output(Person).ainvoke(PERSON, max_tokens=24),
                chat.ainvoke(QUESTION)]

    expected = await asyncio.gather(*calls(plain))
    got = await asyncio.gather(*calls(drafted))
    for solo, mixed in zip(expected, got):
        if isinstance(solo, Person):
            assert mixed == solo
            continue
        assert (mixed.text, mixed.tool_calls) == (solo.text, solo.tool_calls)
    from dyngen_core import shared_generator

    engine = shared_generator(**demo_params, use_ngram_draft=True)  # the drafting engine
    assert engine.wait_idle(timeout=300).draft_tokens_accepted > 0
