"""Odd tool inputs and odd model output: bad tool specs, choices, calls and history end in a
`JobError` naming the problem; any output parses (deep nesting included) in time linear in its
length, and streaming it in any chunks gives what parsing it whole gives."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dyngen_core.errors import JobError
from dyngen_core.text.tool_parser import ToolCallParser, ToolStreamDelta, parse_tool_calls
from dyngen_core.text.tools import (
    ToolSpec,
    fallback_messages,
    format_tool_calls,
    normalize_tool_choice,
)

TOOL = ToolSpec("f", "", {"type": "object"})

ODD: dict[str, tuple[Callable[[], Any], str]] = {
    "tool that is not a dict": (lambda: ToolSpec.from_dict(["f"]),  # type: ignore[arg-type]
                                "a tool must be a dict"),
    "function that is not a dict": (lambda: ToolSpec.from_dict({"function": "f"}),
                                    "a tool must be a dict"),
    "parameters that are not a dict": (
        lambda: ToolSpec.from_dict({"name": "f", "parameters": "s"}), "must be a JSON schema"),
    "a tool without a name": (lambda: ToolSpec(""), "non-empty string name"),
    "tool_choice function that is not a dict": (
        lambda: normalize_tool_choice({"function": 5}, [TOOL]), "'function' must be a dict"),
    "tool_choice that is a list": (lambda: normalize_tool_choice(["f"], [TOOL]),
                                   "not one of the bound tools"),
    "history call with bad JSON arguments": (
        lambda: fallback_messages([{"role": "assistant", "tool_calls": [
            {"function": {"name": "f", "arguments": "{bad"}}]}]), "not valid JSON"),
    "history call without a name": (
        lambda: fallback_messages([{"role": "assistant", "tool_calls": [{"x": 1}]}]),
        "needs a 'name'"),
    "history message that is not a dict": (lambda: fallback_messages(["hi"]),  # type: ignore[list-item]
                                           "must be a dict"),
    "call arguments JSON cannot write": (
        lambda: format_tool_calls([{"name": "f", "arguments": {1, 2}}]), "JSON 'arguments'"),
}


@pytest.mark.parametrize("name", ODD)
def test_odd_tool_inputs_raise_a_job_error(name: str) -> None:
    build, words = ODD[name]
    with pytest.raises(JobError, match=words):
        build()


def test_deeply_nested_output_is_content_or_an_invalid_call() -> None:
    nested = "[" * 100_000 + "]" * 100_000
    as_list = parse_tool_calls(f'[{{"name": "f", "arguments": {nested}}}]')
    assert not as_list.calls and as_list.content.startswith('[{"name"')
    tagged = parse_tool_calls(f"<tool_call>{nested}</tool_call>")
    assert not tagged.calls and len(tagged.invalid) == 1


def _streamed(text: str, size: int) -> ToolCallParser:
    parser = ToolCallParser()
    for i in range(0, len(text), size):
        parser.push(text[i:i + size])
    parser.finish()
    return parser


@pytest.mark.parametrize("text", [
    '[{"name": "f", "arguments": {"a": "' + "x" * 400_000 + '"}}]',
    '<tool_call>{"name": "f", "arguments": {"a": "' + "x" * 400_000 + '"}}</tool_call>',
    " " * 400_000 + '[{"name": "f", "arguments": {}}]',
])
def test_long_output_parses_in_linear_time(text: str) -> None:
    start = time.perf_counter()
    whole = parse_tool_calls(text)
    parser = _streamed(text, 4)
    assert time.perf_counter() - start < 2.0  # was 3.4 s to 17 s: quadratic
    assert [c.name for c in whole.calls] == [c.name for c in parser.calls] == ["f"]


PIECES = st.sampled_from([
    '[{"name": "add", "arguments": {"a": 1}}', ', {"name": "f", "arguments": {}}]', "]",
    "<tool_call>", "</tool_call>", '{"name": "g", "parameters": {"s": "}{["}}', " ", "\n",
    "text", "<tool", "_call>", "{", "[", '"', "\\", "}", "é😀",
])


def _summary(delta: ToolStreamDelta) -> tuple[str, list[tuple[str, object]], list[str]]:
    return (delta.content, [(c.name, c.arguments) for c in delta.calls],
            [i.text for i in delta.invalid])


@settings(max_examples=300, deadline=None)
@given(st.lists(PIECES, max_size=12), st.lists(st.integers(1, 7), min_size=1, max_size=8))
def test_streaming_in_any_chunks_parses_like_the_whole(pieces: list[str],
                                                       sizes: list[int]) -> None:
    text = "".join(pieces)
    parser, content, at = ToolCallParser(), "", 0
    for n in range(len(text)):
        size = sizes[n % len(sizes)]
        if at >= len(text):
            break
        content += parser.push(text[at:at + size]).content
        at += size
    content += parser.finish().content
    whole = _summary(parse_tool_calls(text))
    streamed = (content, [(c.name, c.arguments) for c in parser.calls],
                [i.text for i in parser.invalid])
    assert streamed == whole
