"""Tool-choice constraints whose argument schemas use ``$ref``s compile in milliseconds and
accept exactly the calls the schemas allow (llguidance follows the refs)."""

from __future__ import annotations

import json
import time

import pytest
import tokenizers

from dyngen_core.text.constraints import ConstraintCompiler
from dyngen_core.text.tokenizer import Tokenizer
from dyngen_core.text.tools import ToolSpec, tool_choice_constraint
from tests.tiny_models import trained_tokenizer_json
from tests.unit.test_tool_schema_refs import NODE, OTHER, reused_defs, value

VOCAB = 512


@pytest.fixture(scope="module")
def compiler_and_tokenizer() -> tuple[ConstraintCompiler, Tokenizer]:
    tokenizer = Tokenizer(tokenizers.Tokenizer.from_str(trained_tokenizer_json(VOCAB)),
                          special_tokens={"eos_token": "</s>"})
    return ConstraintCompiler.from_tokenizer(tokenizer, VOCAB), tokenizer


def _accepts(compiled: tuple[ConstraintCompiler, Tokenizer], tools: list[ToolSpec],
             choice: str, calls: list[dict[str, object]]) -> bool:
    compiler, tokenizer = compiled
    matcher = compiler.matcher(tool_choice_constraint(tools, choice))
    text = json.dumps(calls)
    return all(matcher.accept(t) for t in tokenizer.encode(text)) and matcher.is_accepting()


@pytest.mark.parametrize("choice", ["auto", "required", "deep"])
def test_definitions_reused_17_levels_deep_compile_fast(
        compiler_and_tokenizer: tuple[ConstraintCompiler, Tokenizer], choice: str) -> None:
    compiler, _ = compiler_and_tokenizer
    tools = [ToolSpec("deep", "", reused_defs(17)), OTHER]
    start = time.perf_counter()
    compiler.matcher(tool_choice_constraint(tools, choice))
    assert time.perf_counter() - start < 0.5  # was 3.5-6 s, inlined
    shallow = [ToolSpec("deep", "", reused_defs(2)), OTHER]
    good = [{"name": "deep", "arguments": {"x": value(2)}}]
    assert _accepts(compiler_and_tokenizer, shallow, choice, good)
    bad = [{"name": "deep", "arguments": {"x": value(1)}}]
    assert not _accepts(compiler_and_tokenizer, shallow, choice, bad)


def test_recursive_arguments_are_accepted_to_any_depth(
        compiler_and_tokenizer: tuple[ConstraintCompiler, Tokenizer]) -> None:
    tools = [OTHER, ToolSpec("node", "", NODE)]
    chain = {"v": 1, "next": {"v": 2, "next": {"v": 3, "next": None}}}
    assert _accepts(compiler_and_tokenizer, tools, "required",
                    [{"name": "node", "arguments": chain}])
    assert not _accepts(compiler_and_tokenizer, tools, "required",
                        [{"name": "node", "arguments": {"v": 1, "next": {"v": 2}}}])
