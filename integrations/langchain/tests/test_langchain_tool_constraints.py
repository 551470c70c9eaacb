"""The constraints that enforce tool_choice, compiled for the demo model's tokenizer: what each
lets through, token by token (no engine needed)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from dyngen_core import Tokenizer
from dyngen_core.constraints import ConstraintCompiler
from dyngen_core.tools import ToolSpec, tool_choice_constraint

ADD = ToolSpec("add", "Add two ints", {"type": "object", "properties": {
    "a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]})
WEATHER = ToolSpec("get_weather", "Weather in a city", {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]})
CALL = '[{"name": "add", "arguments": {"a": 1, "b": 2}}]'
TWO_CALLS = '[{"name": "add", "arguments": {"a": 1, "b": 2}}, ' \
            '{"name": "get_weather", "arguments": {"city": "Oslo"}}]'


@pytest.fixture(scope="module")
def allows(demo_model_dir: Path) -> Any:
    tokenizer = Tokenizer.from_model_dir(demo_model_dir)
    compiler = ConstraintCompiler.from_tokenizer(tokenizer, tokenizer.vocab_size)

    def check(choice: str, text: str, parallel: bool = True) -> bool:
        """Whether the constraint for ``choice`` accepts ``text`` as a whole reply."""
        constraint = tool_choice_constraint([ADD, WEATHER], choice, parallel)
        matcher = compiler.matcher(constraint)
        return all(matcher.accept(t) for t in tokenizer.encode(text)) and matcher.is_accepting()

    return check


def test_auto_allows_well_formed_calls_or_text_only(allows: Any) -> None:
    assert allows("auto", CALL) and allows("auto", TWO_CALLS)
    assert allows("auto", "It is sunny in Oslo.")
    assert not allows("auto", '[{"name": "multiply", "arguments": {}}]')  # no such tool
    assert not allows("auto", '[{"name": "add", "arguments": {"a": "one"}}]')
    assert not allows("auto", "[1, 2]")


def test_required_and_named_choices_allow_only_calls(allows: Any) -> None:
    assert allows("required", TWO_CALLS) and not allows("required", "Hello")
    assert not allows("required", TWO_CALLS, parallel=False)
    assert allows("add", CALL)
    assert not allows("get_weather", CALL)


def test_none_allows_text_but_no_call(allows: Any) -> None:
    assert allows("none", "It is sunny.")
    assert not allows("none", CALL)


def test_no_tools_means_no_constraint() -> None:
    assert tool_choice_constraint([], "auto") is None
