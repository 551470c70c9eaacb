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
