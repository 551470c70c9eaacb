"""Tool schemas with ``$ref``s: the forcing schema keeps them (pointed at where the arguments
now sit), so definitions that reuse each other stay linear in size, recursion works, and the
schema validates exactly what the tool's own schema validates. `inline_refs` is bounded."""

from __future__ import annotations

import json
import time
from typing import Any

import jsonschema
import pytest

from dyngen_core.errors import JobError
from dyngen_core.text.tools import (
    INLINED_NODES_LIMIT,
    ToolSpec,
    inline_refs,
    tool_calls_schema,
    tool_choice_constraint,
)


def reused_defs(levels: int) -> dict[str, Any]:
    """Level i has two fields of level i - 1: inlined, 2**levels leaves."""
    defs: dict[str, Any] = {"L0": {"type": "string"}}
    for i in range(1, levels + 1):
        defs[f"L{i}"] = {"type": "object", "required": ["a", "b"], "properties": {
            "a": {"$ref": f"#/$defs/L{i - 1}"}, "b": {"$ref": f"#/$defs/L{i - 1}"}}}
    return {"type": "object", "properties": {"x": {"$ref": f"#/$defs/L{levels}"}},
            "required": ["x"], "$defs": defs}


def value(levels: int) -> Any:
    return "leaf" if levels == 0 else {"a": value(levels - 1), "b": value(levels - 1)}


NODE = {"$ref": "#/$defs/Node", "$defs": {"Node": {
    "type": "object", "properties": {"v": {"type": "integer"},
                                     "next": {"anyOf": [{"$ref": "#/$defs/Node"},
                                                        {"type": "null"}]}},
    "required": ["v", "next"]}}}
OTHER = ToolSpec("other", "", {"type": "object", "properties": {"k": {"type": "integer"}}})


def _valid(schema: dict[str, Any] | None, calls: list[dict[str, Any]]) -> bool:
    return jsonschema.Draft202012Validator(schema).is_valid(calls)


def test_reused_definitions_keep_the_schema_linear() -> None:
    tool = ToolSpec("deep", "", reused_defs(17))
    start = time.perf_counter()
    schema = tool_calls_schema([tool, OTHER], "required")
    constraint = tool_choice_constraint([tool, OTHER], "auto")
    elapsed = time.perf_counter() - start
    assert len(json.dumps(schema)) < 5_000 and constraint is not None
    assert len(str(constraint.source)) < 5_000  # type: ignore[union-attr]
    assert elapsed < 0.5  # was 3 s and 8.7 MB of grammar: every $ref inlined
    small = tool_calls_schema([ToolSpec("deep", "", reused_defs(3)), OTHER], "required")
    assert _valid(small, [{"name": "deep", "arguments": {"x": value(3)}}])
    assert not _valid(small, [{"name": "deep", "arguments": {"x": value(2)}}])
    assert not _valid(small, [{"name": "deep", "arguments": {"x": value(3), "y": 1}}])


@pytest.mark.parametrize("tools", [[ToolSpec("node", "", NODE)],
                                   [OTHER, ToolSpec("node", "", NODE)]])
def test_a_root_ref_and_recursion_are_kept_and_still_closed(tools: list[ToolSpec]) -> None:
    schema = tool_calls_schema(tools, "node")
    chain = {"v": 1, "next": {"v": 2, "next": None}}
    assert _valid(schema, [{"name": "node", "arguments": chain}])
    assert not _valid(schema, [{"name": "node", "arguments": {**chain, "extra": 1}}])
    assert not _valid(schema, [{"name": "node", "arguments": {"v": 1, "next": {"v": "x"}}}])
    any_tool = tool_calls_schema(tools, "required")
    assert _valid(any_tool, [{"name": "node", "arguments": chain}])


def test_schemas_json_cannot_write_fail_with_a_clear_error() -> None:
    cyclic: dict[str, Any] = {"type": "object", "properties": {}}
    cyclic["properties"]["self"] = cyclic
    with pytest.raises(JobError, match="'loop' cannot be written as JSON"):
        tool_calls_schema([ToolSpec("loop", "", cyclic)], "required")
    deep: dict[str, Any] = {"type": "object"}
    for _ in range(5_000):
        deep = {"type": "object", "properties": {"d": deep}}
    with pytest.raises(JobError, match="'deep' cannot be written as JSON"):
        tool_calls_schema([ToolSpec("deep", "", deep)], "required")


def test_schemas_nested_as_deep_as_json_writes_are_embedded() -> None:
    deep: dict[str, Any] = {"$ref": "#/$defs/leaf"}
    for _ in range(400):
        deep = {"type": "object", "properties": {"d": deep}}
    schema = tool_calls_schema([ToolSpec("deep", "", {**deep, "$defs": {
        "leaf": {"type": "integer"}}})], "required")
    node = schema["items"]["properties"]["arguments"]  # type: ignore[index]
    for _ in range(400):
        node = node["properties"]["d"]
    assert node == {"$ref": "#/items/properties/arguments/$defs/leaf"}


def test_inline_refs_resolves_each_definition_once_and_bounds_the_result() -> None:
    inlined = inline_refs(reused_defs(3))
    x = inlined["properties"]["x"]
    assert x["properties"]["a"]["properties"]["b"]["properties"]["a"] == {"type": "string"}
    assert "$defs" not in inlined
    assert jsonschema.Draft202012Validator(inlined).is_valid({"x": value(3)})
    start = time.perf_counter()
    with pytest.raises(JobError, match=f"more than {INLINED_NODES_LIMIT} JSON values"):
        inline_refs(reused_defs(30))
    assert time.perf_counter() - start < 0.5
    with pytest.raises(JobError, match="recursive"):
        inline_refs(NODE)
