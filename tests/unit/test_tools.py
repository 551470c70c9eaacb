"""dyngen_core.text.tools / tool_parser: tool choice, the fallback prompt, the forcing schema, and
parsing calls from whole and streamed output."""

from __future__ import annotations

import json

import pytest

from dyngen_core.text.tools import (
    ToolCallParser,
    ToolSpec,
    fallback_messages,
    format_tool_calls,
    inline_refs,
    normalize_tool_choice,
    parse_tool_calls,
    render_tools_prompt,
    template_supports_tools,
    tool_calls_schema,
)

WEATHER = ToolSpec("get_weather", "Weather in a city",
                   {"type": "object", "properties": {"city": {"type": "string"}},
                    "required": ["city"]})
ADD = ToolSpec("add", "Add two ints", {"type": "object", "properties": {
    "a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]})


def test_tool_spec_reads_openai_and_bare_function_dicts() -> None:
    wrapped = {"type": "function", "function": {"name": "f", "description": "d",
                                                 "parameters": {"type": "object"}}}
    assert ToolSpec.from_dict(wrapped) == ToolSpec("f", "d", {"type": "object"})
    assert ToolSpec.from_dict({"name": "g"}).parameters == {"type": "object", "properties": {}}
    assert ToolSpec.from_dict(wrapped).as_dict() == wrapped
    with pytest.raises(ValueError, match="name"):
        ToolSpec.from_dict({"description": "no name"})


@pytest.mark.parametrize(("choice", "expected"), [
    (None, "auto"), ("auto", "auto"), ("none", "none"), (False, "none"), ("any", "required"),
    ("required", "required"), (True, "required"), ("add", "add"),
    ({"type": "function", "function": {"name": "add"}}, "add"), ({"name": "add"}, "add"),
])
def test_normalize_tool_choice(choice: object, expected: str) -> None:
    assert normalize_tool_choice(choice, [WEATHER, ADD]) == expected


def test_normalize_tool_choice_rejects_unknown_names_and_forcing_without_tools() -> None:
    with pytest.raises(ValueError, match="not one of the bound tools"):
        normalize_tool_choice("multiply", [ADD])
    with pytest.raises(ValueError, match="at least one tool"):
        normalize_tool_choice("any", [])


def test_template_supports_tools() -> None:
    assert template_supports_tools("{% if tools %}{{ tools | tojson }}{% endif %}")
    assert not template_supports_tools("{% for m in messages %}{{ m.content }}{% endfor %}")
    assert not template_supports_tools(None)


def test_tools_prompt_lists_every_tool_and_the_format() -> None:
    prompt = render_tools_prompt([WEATHER, ADD])
    assert '"name": "get_weather"' in prompt and '"name": "add"' in prompt
    assert '[{"name": "tool_name", "arguments": {"argument": "value"}}]' in prompt


def test_fallback_messages_rewrite_calls_and_results() -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris and 1+2?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c1", "type": "function",
             "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
            {"id": "c2", "type": "function", "function": {"name": "add",
                                                          "arguments": '{"a": 1, "b": 2}'}}]},
        {"role": "tool", "content": "sunny", "tool_call_id": "c1", "name": "get_weather"},
        {"role": "tool", "content": "3", "tool_call_id": "c2", "name": "add"},
    ]
    out = fallback_messages(messages, [WEATHER, ADD])
    assert [m["role"] for m in out] == ["system", "user", "assistant", "user"]
    assert out[0]["content"].startswith("Be brief.\n\nYou can call these tools")
    assert json.loads(out[2]["content"]) == [
        {"name": "get_weather", "arguments": {"city": "Paris"}},
        {"name": "add", "arguments": {"a": 1, "b": 2}}]
    assert "c1 (get_weather): sunny" in out[3]["content"]
    assert "c2 (add): 3" in out[3]["content"]
    assert all("tool_calls" not in m for m in out)
    assert messages[2]["tool_calls"]  # the input is not modified


def test_fallback_messages_without_tools_adds_no_system_prompt() -> None:
    out = fallback_messages([{"role": "user", "content": "hi"}], [])
    assert out == [{"role": "user", "content": "hi"}]


def test_schema_forcing_any_tool_allows_parallel_calls() -> None:
    schema = tool_calls_schema([WEATHER, ADD], "required", parallel=True)
    assert schema is not None
    assert schema["type"] == "array" and schema["minItems"] == 1 and "maxItems" not in schema
    names = [item["properties"]["name"]["const"] for item in schema["items"]["anyOf"]]
    assert names == ["get_weather", "add"]
    arguments = schema["items"]["anyOf"][1]["properties"]["arguments"]
    assert arguments["additionalProperties"] is False and arguments["required"] == ["a", "b"]


def test_schema_forcing_a_named_tool_or_no_parallel_calls_allows_one_call() -> None:
    named = tool_calls_schema([WEATHER, ADD], "add")
    assert named is not None and named["maxItems"] == 1
    assert named["items"]["properties"]["name"] == {"const": "add"}
    single = tool_calls_schema([WEATHER, ADD], "required", parallel=False)
    assert single is not None and single["maxItems"] == 1
    assert tool_calls_schema([ADD], "auto") is None
    assert tool_calls_schema([ADD], "none") is None


def test_inline_refs_resolves_defs_and_rejects_recursion() -> None:
    schema = {"type": "object", "properties": {"p": {"$ref": "#/$defs/P"}},
              "$defs": {"P": {"type": "object", "properties": {"x": {"type": "integer"}}}}}
    assert inline_refs(schema) == {"type": "object", "properties": {
        "p": {"type": "object", "properties": {"x": {"type": "integer"}}}}}
    loop = {"$ref": "#/$defs/N", "$defs": {"N": {"properties": {"n": {"$ref": "#/$defs/N"}}}}}
    with pytest.raises(ValueError, match="recursive"):
        inline_refs(loop)


@pytest.mark.parametrize("text", [
    '[{"name": "add", "arguments": {"a": 1, "b": 2}}]',
    '  {"name": "add", "arguments": {"a": 1, "b": 2}}',
    '{"name": "add", "parameters": {"a": 1, "b": 2}}',
    '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>',
    '{"tool_calls": [{"function": {"name": "add", "arguments": "{\\"a\\": 1, \\"b\\": 2}"}}]}',
])
def test_parse_reads_each_supported_format(text: str) -> None:
    parsed = parse_tool_calls(text)
    assert [(c.name, c.arguments) for c in parsed.calls] == [("add", {"a": 1, "b": 2})]
    assert parsed.content.strip() == "" and not parsed.invalid
    assert parsed.calls[0].id.startswith("call_")


def test_parse_keeps_plain_text_and_text_around_tagged_calls() -> None:
    assert parse_tool_calls("Paris is sunny.").content == "Paris is sunny."
    assert not parse_tool_calls("Paris is sunny.").calls
    mixed = parse_tool_calls('Let me check.<tool_call>{"name": "get_weather", '
                             '"arguments": {"city": "Oslo"}}</tool_call> Done.')
    assert mixed.content == "Let me check. Done."
    assert mixed.calls[0].arguments == {"city": "Oslo"}


def test_json_that_is_not_a_call_comes_back_as_content() -> None:
    for text in ['{"answer": 42}', "[1, 2, 3]", "[see above] is the answer"]:
        parsed = parse_tool_calls(text)
        assert parsed.content == text and not parsed.calls and not parsed.invalid


def test_parallel_calls_get_distinct_ids_and_quoted_braces_do_not_confuse() -> None:
    text = format_tool_calls([{"name": "get_weather", "arguments": {"city": "}{\"["}},
                              {"name": "add", "arguments": {"a": 1, "b": 2}}])
    parsed = parse_tool_calls(text)
    assert [c.name for c in parsed.calls] == ["get_weather", "add"]
    assert parsed.calls[0].arguments == {"city": '}{"['}
    assert parsed.calls[0].id != parsed.calls[1].id


def test_a_cut_off_call_is_reported_invalid() -> None:
    parsed = parse_tool_calls('[{"name": "add", "arguments": {"a": 1, "b"')
    assert not parsed.calls and parsed.content == ""
    assert len(parsed.invalid) == 1 and "ended inside" in parsed.invalid[0].error
    unclosed = parse_tool_calls('ok <tool_call>{"name": "add"')
    assert unclosed.content == "ok " and "not closed" in unclosed.invalid[0].error


def test_streaming_reports_each_call_when_it_completes() -> None:
    text = format_tool_calls([{"name": "get_weather", "arguments": {"city": "Paris"}},
                              {"name": "add", "arguments": {"a": 1, "b": 2}}])
    parser = ToolCallParser()
    seen: list[tuple[int, str]] = []
    for i, ch in enumerate(text):
        delta = parser.push(ch)
        assert delta.content == ""
        seen += [(i, c.name) for c in delta.calls]
    assert not parser.finish().calls
    first_end = text.index("}}") + 1
    assert seen == [(first_end, "get_weather"), (len(text) - 2, "add")]
    assert [c.name for c in parser.calls] == ["get_weather", "add"]


def test_streaming_text_is_released_at_once_but_a_partial_tag_is_held() -> None:
    parser = ToolCallParser()
    assert parser.push("Hello").content == "Hello"
    assert parser.push(" world <tool").content == " world "
    assert parser.push("_call>").content == ""
    delta = parser.push('{"name": "add", "arguments": {}}</tool_call>!')
    assert [c.name for c in delta.calls] == ["add"] and delta.content == "!"
    assert parser.push(" <to").content == " "
    assert parser.finish().content == "<to"
