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
