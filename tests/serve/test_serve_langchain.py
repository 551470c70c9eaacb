"""LangChain's ``ChatOpenAI`` pointed at the server: invoke, stream, tools and structured
output, as any OpenAI-speaking framework would use it."""

from __future__ import annotations

from typing import Any

import langchain_openai
import pytest
from pydantic import BaseModel, Field

from tests.serve.conftest import MODEL

pytestmark = pytest.mark.demo


class GetWeather(BaseModel):
    """Get the current weather in a city."""

    city: str = Field(description="the city name")


class Person(BaseModel):
    """A person."""

    name: str
    age: int


@pytest.fixture
def chat(server: Any) -> Any:
    return langchain_openai.ChatOpenAI(model=MODEL, base_url=server.base_url + "/v1",
                                       api_key="unused", temperature=0, max_tokens=12,
                                       max_retries=0, stream_usage=True)


def test_invoke_and_stream_give_the_same_reply(chat: Any) -> None:
    message = chat.invoke("Name three colours of the rainbow.")
    assert message.content and message.response_metadata["finish_reason"] == "length"
    assert message.usage_metadata["output_tokens"] == 12
    streamed: Any = None
    for chunk in chat.stream("Name three colours of the rainbow."):
        streamed = chunk if streamed is None else streamed + chunk
    assert streamed.content == message.content
    assert streamed.usage_metadata["output_tokens"] == 12
    assert streamed.usage_metadata["input_token_details"]["cache_read"] > 0


def test_bound_tools_give_tool_calls(chat: Any) -> None:
    bound = chat.bind_tools([GetWeather], tool_choice="GetWeather", max_tokens=30)
    message = bound.invoke("How is the weather in Paris?")
    [call] = message.tool_calls
    assert call["name"] == "GetWeather" and isinstance(call["args"]["city"], str)
    assert call["id"].startswith("call_")
    streamed: Any = None
    for chunk in bound.stream("How is the weather in Paris?"):
        streamed = chunk if streamed is None else streamed + chunk
    assert [(c["name"], c["args"]) for c in streamed.tool_calls] == [
        ("GetWeather", call["args"])]


def test_structured_output_through_response_format(chat: Any) -> None:
    roomy = chat.model_copy(update={"max_tokens": 40})
    person = roomy.with_structured_output(Person, method="json_schema").invoke(
        "Invent a person with a name and an age.")
    assert isinstance(person, Person) and isinstance(person.age, int)
