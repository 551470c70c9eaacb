"""Structured output under the output class's schema, and one engine shared with LangChain."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from llama_index.core.llms import ChatMessage
from llama_index.core.prompts import PromptTemplate
from llama_index.llms.dyngen import DynGenLLM
from pydantic import BaseModel

pytestmark = pytest.mark.demo


class City(BaseModel):
    """A city and the country it is in."""

    name: str
    country: str
    population_millions: int


PROMPT = PromptTemplate("Name a famous city in {place}.")


@pytest.fixture(scope="module")
def json_llm(llm: DynGenLLM) -> DynGenLLM:
    return DynGenLLM(model_dir=llm.model_dir, max_tokens=48, temperature=0.0,
                     engine_options=llm.engine_options)


def test_structured_predict_returns_a_valid_object(json_llm: DynGenLLM) -> None:
    city = json_llm.structured_predict(City, PROMPT, place="France")
    assert isinstance(city, City) and city.name and city.country
    again = asyncio.run(json_llm.astructured_predict(City, PROMPT, place="France"))
    assert again == city  # greedy: the async path decodes the same object


def test_streamed_structured_output_grows_then_validates(json_llm: DynGenLLM) -> None:
    objects = list(json_llm.stream_structured_predict(City, PROMPT, place="Italy"))
    assert isinstance(objects[-1], City) and len(objects) > 2
    assert all(not isinstance(o, City) for o in objects[:-1])  # partial (flexible) objects
    filled = [sum(v is not None for v in o.model_dump().values()) for o in objects]
    assert filled == sorted(filled)

    async def collect() -> list[object]:
        stream = await json_llm.astream_structured_predict(City, PROMPT, place="Italy")
        return [o async for o in stream]

    assert asyncio.run(collect())[-1] == objects[-1]


def test_as_structured_llm_answers_in_the_schema(json_llm: DynGenLLM) -> None:
    structured = json_llm.as_structured_llm(City)
    reply = structured.chat([ChatMessage(role="user", content="Name a city in Spain.")])
    assert isinstance(reply.raw, City)
    assert City.model_validate_json(reply.message.content or "") == reply.raw


def test_too_few_tokens_for_the_object_is_a_clear_error(json_llm: DynGenLLM) -> None:
    with pytest.raises(ValueError, match="raise max_tokens"):
        json_llm.structured_predict(City, PROMPT, llm_kwargs={"max_tokens": 4}, place="Peru")


def test_langchain_and_llamaindex_objects_share_one_engine(
    llm: DynGenLLM, demo_model_dir: Path
) -> None:
    langchain_dyngen = pytest.importorskip("langchain_dyngen")
    from dyngen_core import shared_generator

    options = llm.engine_options.model_dump()
    chat = langchain_dyngen.ChatDynGen(model_dir=str(demo_model_dir), max_tokens=2,
                                       temperature=0.0, **options)
    assert shared_generator(demo_model_dir, **options) is llm.engine
    # A prompt LangChain ran is in the shared prompt cache when LlamaIndex sends it again.
    question = "Summarize: " + " ".join(f"Line {i} of the shared report." for i in range(40))
    chat.invoke(question)
    reply = llm.chat([ChatMessage(role="user", content=question)], max_tokens=2)
    assert reply.raw["cached_tokens"] >= 256
