"""From engine results to LangChain messages, without an engine: streamed text, tool calls
(parallel ones too), usage metadata and finish reasons."""

from __future__ import annotations

import json
from typing import Any

from langchain_core.language_models.chat_models import generate_from_stream
from langchain_core.messages import AIMessage
from langchain_dyngen._chat_output import ChatChunker

from dyngen_core import Result


def _results(pieces: list[str], eos_reason: str = "stop_token") -> list[Result]:
    out = [Result(job=None, identifier=None, stage="streaming", eos=False, text=p)
           for p in pieces]
    out.append(Result(job=None, identifier=None, stage="streaming", eos=True, text="",
                      eos_reason=eos_reason, full_completion="".join(pieces),
                      new_tokens=len(pieces), prompt_tokens=300, cached_tokens=256))
    return out


def _run(pieces: list[str], parse_tools: bool, **kw: Any) -> tuple[list[Any], AIMessage]:
    chunker = ChatChunker("demo", parse_tools)
    chunks = [c for r in _results(pieces, **kw) for c in chunker.feed(r)]
    message = generate_from_stream(iter(chunks)).generations[0].message
    assert isinstance(message, AIMessage)
    return chunks, message


def test_text_streams_token_by_token_and_the_last_chunk_carries_usage() -> None:
    chunks, message = _run(["Hel", "lo", " there"], parse_tools=False)
    assert [c.text for c in chunks] == ["Hel", "lo", " there", ""]
    assert [c.message.usage_metadata for c in chunks[:-1]] == [None, None, None]
    last = chunks[-1].message
    assert last.chunk_position == "last"
    assert last.usage_metadata == {"input_tokens": 300, "output_tokens": 3, "total_tokens": 303,
                                   "input_token_details": {"cache_read": 256}}
    assert message.content == "Hello there"
    assert message.response_metadata["finish_reason"] == "stop"
    assert message.response_metadata["model_name"] == "demo"


def test_max_tokens_is_reported_as_length() -> None:
    _, message = _run(["a"], parse_tools=False, eos_reason="max_new_tokens")
    assert message.response_metadata["finish_reason"] == "length"
    assert message.response_metadata["eos_reason"] == "max_new_tokens"


def test_parallel_tool_calls_become_tool_calls_with_distinct_ids() -> None:
    text = json.dumps([{"name": "get_weather", "arguments": {"city": "Paris"}},
                       {"name": "get_weather", "arguments": {"city": "Oslo"}}])
    pieces = [text[i:i + 5] for i in range(0, len(text), 5)]
    chunks, message = _run(pieces, parse_tools=True)
    assert all(c.text == "" for c in chunks)  # nothing of the JSON leaks into content
    assert [(c["name"], c["args"]) for c in message.tool_calls] == [
        ("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Oslo"})]
    ids = [c["id"] for c in message.tool_calls]
    assert len(set(ids)) == 2 and all(ids)
    assert message.response_metadata["finish_reason"] == "tool_calls"
    assert message.content == ""


def test_text_that_is_not_a_call_is_kept_when_tools_are_offered() -> None:
    _, message = _run(["It is ", "sunny."], parse_tools=True)
    assert message.content == "It is sunny." and not message.tool_calls
    assert message.response_metadata["finish_reason"] == "stop"


def test_a_call_cut_off_by_max_tokens_is_an_invalid_tool_call() -> None:
    _, message = _run(['[{"name": "add", ', '"arguments": {"a"'], parse_tools=True,
                      eos_reason="max_new_tokens")
    assert not message.tool_calls
    assert len(message.invalid_tool_calls) == 1
    assert json.loads(message.invalid_tool_calls[0]["args"] or "").startswith('[{"name"')
    assert message.response_metadata["finish_reason"] == "length"
