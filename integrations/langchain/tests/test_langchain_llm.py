"""DynGenLLM against the demo model: all prompts of a call in one submission, streaming with
callbacks, stop sequences, async calls, usage in llm_output."""

from __future__ import annotations

from typing import Any

import pytest
from langchain_core.callbacks import BaseCallbackHandler
from langchain_dyngen import DynGenLLM

pytestmark = pytest.mark.demo

PROMPT = "<|im_start|>user\nName three colours.<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture
def llm(demo_params: dict[str, Any]) -> DynGenLLM:
    return DynGenLLM(**demo_params, temperature=0, max_tokens=10)


class TokenCounter(BaseCallbackHandler):
    def __init__(self) -> None:
        self.tokens: list[str] = []

    def on_llm_new_token(self, token: str, **kwargs: Any) -> None:
        self.tokens.append(token)


def test_generate_submits_every_prompt_in_one_call(
    llm: DynGenLLM, engine: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[int] = []
    submit_many = engine.submit_many

    def record(jobs: Any) -> Any:
        calls.append(len(jobs))
        return submit_many(jobs)

    monkeypatch.setattr(engine, "submit_many", record)
    prompts = [PROMPT.replace("three", str(n)) for n in range(2, 14)]
    texts = llm.batch(prompts)
    assert calls == [len(prompts)]
    assert len(texts) == len(prompts) and all(texts)
    result = llm.generate(prompts[:3])
    usage = result.llm_output["token_usage"]  # type: ignore[index]
    assert usage["completion_tokens"] == sum(
        g[0].generation_info["usage"]["completion_tokens"]  # type: ignore[index]
        for g in result.generations)
    assert result.generations[0][0].generation_info["finish_reason"] in {  # type: ignore[index]
        "stop", "length"}


def test_stream_yields_tokens_and_fires_callbacks(llm: DynGenLLM) -> None:
    counter = TokenCounter()
    pieces = list(llm.stream(PROMPT, config={"callbacks": [counter]}))
    assert len([p for p in pieces if p]) >= 3
    assert "".join(pieces) == "".join(counter.tokens) == llm.invoke(PROMPT)


def test_stop_sequences_cut_the_completion_exactly(llm: DynGenLLM) -> None:
    full = llm.invoke(PROMPT)
    words = [w for w in full.split() if len(w) > 2]
    stop = words[len(words) // 2]
    assert llm.invoke(PROMPT, stop=[stop]) == full[:full.index(stop)]


async def test_async_calls_match_sync_calls(llm: DynGenLLM) -> None:
    expected = llm.invoke(PROMPT)
    assert await llm.ainvoke(PROMPT) == expected
    assert "".join([p async for p in llm.astream(PROMPT)]) == expected
    assert await llm.abatch([PROMPT, PROMPT]) == [expected, expected]
