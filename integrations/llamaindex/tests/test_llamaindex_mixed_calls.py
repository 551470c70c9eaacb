"""Structured prediction gathered beside plain completions gives what each gives alone: a
constrained job never harms the plain jobs sampled beside it."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from llama_index.core.prompts import PromptTemplate
from llama_index.llms.dyngen import DynGenLLM
from pydantic import BaseModel

pytestmark = pytest.mark.demo


class City(BaseModel):
    """A city and the country it is in."""

    name: str
    country: str


PROMPT = PromptTemplate("Name a famous city in {place}.")


def test_astructured_predict_beside_acomplete(llm: DynGenLLM) -> None:
    plain = DynGenLLM(model_dir=llm.model_dir, max_tokens=12, temperature=0.0,
                      engine_options=llm.engine_options)
    json_llm = DynGenLLM(model_dir=llm.model_dir, max_tokens=40, temperature=0.0,
                         engine_options=llm.engine_options)

    def calls() -> list[Any]:
        return [plain.acomplete("The capital of France is"),
                json_llm.astructured_predict(City, PROMPT, place="France"),
                plain.acomplete("Three colours of the rainbow are")]

    async def alone() -> list[Any]:
        return [await call for call in calls()]

    async def together() -> list[Any]:
        return list(await asyncio.gather(*calls()))

    solo, mixed = asyncio.run(alone()), asyncio.run(together())
    assert isinstance(mixed[1], City) and mixed[1] == solo[1]
    for i in (0, 2):
        assert mixed[i].raw["eos_reason"] != "error", mixed[i].raw
        assert mixed[i].text == solo[i].text


def test_ngram_drafts_keep_gathered_outputs(llm: DynGenLLM) -> None:
    """The same gathered calls through an engine that drafts by n-gram lookup (its own engine
    over the same weights, `draft_model_dir`'s sibling option) give the same replies."""
    options = llm.engine_options.model_copy(update={"use_ngram_draft": True})
    copy = "Repeat exactly: the cat sat on the mat, the cat sat on the mat, the cat sat."

    def calls(engine_options: Any) -> list[Any]:
        model = DynGenLLM(model_dir=llm.model_dir, max_tokens=16, temperature=0.0,
                          engine_options=engine_options)
        structured = DynGenLLM(model_dir=llm.model_dir, max_tokens=40, temperature=0.0,
                               engine_options=engine_options)
        return [model.acomplete(copy), structured.astructured_predict(City, PROMPT, place="Japan"),
                model.acomplete("Three colours of the rainbow are")]

    async def gathered(engine_options: Any) -> list[Any]:
        return list(await asyncio.gather(*calls(engine_options)))

    expected = asyncio.run(gathered(llm.engine_options))
    got = asyncio.run(gathered(options))
    assert got[1] == expected[1]
    for i in (0, 2):
        assert got[i].text == expected[i].text
