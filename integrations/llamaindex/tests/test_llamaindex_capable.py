"""LlamaIndex tool calling on a capable local model, under tool_choice "auto": the slow suite,
outside CI (set ``DYNGEN_CAPABLE_MODEL_DIR``, select ``-m capable_model``; see the LangChain
adapter's test_langchain_standard_capable.py). The model calls in its own format, read and
steered through its chat template; a question no tool helps with gets text."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from llama_index.core.tools import FunctionTool
from llama_index.llms.dyngen import DynGenLLM

CAPABLE_MODEL_ENV = "DYNGEN_CAPABLE_MODEL_DIR"

pytestmark = [
    pytest.mark.capable_model,
    pytest.mark.skipif(not os.environ.get(CAPABLE_MODEL_ENV),
                       reason=f"set {CAPABLE_MODEL_ENV} to a converted model folder "
                              "(e.g. Qwen2.5-Coder-1.5B-Instruct) to run the slow suite"),
]


def get_weather(city: str) -> str:
    """Get the current weather in a city."""
    return f"sunny in {city}"


TOOLS = [FunctionTool.from_defaults(fn=get_weather)]


@pytest.fixture(scope="module")
def capable_llm() -> DynGenLLM:
    folder = Path(os.environ.get(CAPABLE_MODEL_ENV, "")).expanduser()
    return DynGenLLM(model_dir=str(folder), max_tokens=96, temperature=0.0,
                     engine_options={"cache_tokens": 8192, "max_batch_size": 8})


def test_auto_calls_a_bound_tool_in_the_models_format(capable_llm: DynGenLLM) -> None:
    response = capable_llm.chat_with_tools(TOOLS, user_msg="What is the weather in Paris?")
    [call] = capable_llm.get_tool_calls_from_response(response)
    assert call.tool_name == "get_weather" and call.tool_kwargs == {"city": "Paris"}


def test_auto_streams_the_same_call(capable_llm: DynGenLLM) -> None:
    partials = list(capable_llm.stream_chat_with_tools(
        TOOLS, user_msg="What is the weather in Oslo?"))
    last = partials[-1]
    [call] = capable_llm.get_tool_calls_from_response(last)
    assert call.tool_name == "get_weather" and call.tool_kwargs == {"city": "Oslo"}


def test_auto_answers_in_text_when_no_tool_helps(capable_llm: DynGenLLM) -> None:
    response = capable_llm.chat_with_tools(TOOLS, user_msg="What is 2 plus 3? Answer with "
                                                           "the number only.")
    assert not capable_llm.get_tool_calls_from_response(response, error_on_no_tool_call=False)
    assert "5" in (response.message.content or "")
