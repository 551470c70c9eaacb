"""The tool call formats of the model families dyngen loads: which one a chat template teaches,
reading each whole and streamed in any chunks, text that only mentions a tool, and the "auto"
constraint that steers into the template's own format."""

from __future__ import annotations

import random
import time
from pathlib import Path
from typing import Any

import pytest

from dyngen_core import Tokenizer
from dyngen_core.constraints import ConstraintCompiler
from dyngen_core.tools import (
    ToolCallParser,
    ToolFormat,
    ToolSpec,
    ToolStreamDelta,
    parse_tool_calls,
    tool_choice_constraint,
    tool_format_for,
    tool_markers_are_special,
)

# Excerpts of the real templates (the lines that teach the call format).
QWEN25_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\n' }}"
    '{{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and '
    "arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{{\\\"name\\\": "
    '<function-name>, \\"arguments\\": <args-json-object>}}\\n</tool_call><|im_end|>\\n" }}'
    "{%- endif %}"
)
LLAMA31_TEMPLATE = (
    "{%- if tools is not none and not tools_in_user_message %}"
    '{{- "You have access to the following functions. To call a function, please respond with '
    'JSON for a function call." }}'
    "{{- 'Respond in the format {\"name\": function name, \"parameters\": dictionary of argument "
    "name and its value}.' }}{%- endif %}"
    '{%- if builtin_tools is defined %}{{- "<|python_tag|>" + tool_call.name }}{%- endif %}'
)
LLAMA32_TEMPLATE = (
    "{%- if tools is not none %}{{- \"Environment: ipython\\n\" }}{%- endif %}"
    "{{- 'Respond in the format {\"name\": function name, \"parameters\": dictionary of argument "
    "name and its value}.' }}"
)
MISTRAL_TEMPLATE = (
    "{% if message['role'] == 'user' %}{% if tools is not none %}{{ '[AVAILABLE_TOOLS] ' }}"
    "{{ tools|tojson }}{{ '[/AVAILABLE_TOOLS]' }}{% endif %}"
    "{% elif message['tool_calls'] %}{{ '[TOOL_CALLS] [' }}{% for call in message['tool_calls'] %}"
    "{{ dict(id=call['id'], name=call['function']['name'], arguments=call['function']"
    "['arguments'])|tojson }}{% endfor %}{{ ']' }}{% endif %}"
)
# Mistral Small 3.2 / Devstral (the v11 tokenizers and later): a name and [ARGS] per call.
MISTRAL_V11_TEMPLATE = (
    "{%- if tools is not none %}{{- '[AVAILABLE_TOOLS]' + tools|tojson + '[/AVAILABLE_TOOLS]' }}"
    "{%- endif %}{%- for tool in message['tool_calls'] %}"
    "{%- set arguments = tool['function']['arguments'] %}"
    "{%- if arguments is not string %}{%- set arguments = arguments|tojson|safe %}{%- endif %}"
    "{{- '[TOOL_CALLS]' + tool['function']['name'] + '[ARGS]' + arguments }}{%- endfor %}"
)
SMOLLM2_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + "
    "message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}"
)

IDS = {"<tool_call>": 7, "</tool_call>": 8, "<|python_tag|>": 9, "[TOOL_CALLS]": 10,
       "[ARGS]": 11}
HERMES = ToolFormat("hermes", 7, 8)
LLAMA = ToolFormat("llama", 9)
MISTRAL = ToolFormat("mistral", 10)
MISTRAL_V11 = ToolFormat("mistral_v11", 10, None, 11)
NAMES = ["get_weather", "add"]
WEATHER_ARGS = {"location": "San Francisco, CA"}


@pytest.mark.parametrize(("template", "expected"), [
    (QWEN25_TEMPLATE, HERMES),
    (LLAMA31_TEMPLATE, LLAMA),
    (LLAMA32_TEMPLATE, ToolFormat("llama")),  # no <|python_tag|> in it
    (MISTRAL_TEMPLATE, MISTRAL),
    (MISTRAL_V11_TEMPLATE, MISTRAL_V11),
    (SMOLLM2_TEMPLATE, ToolFormat()),
    (None, ToolFormat()),
])
def test_the_format_is_read_from_the_template(template: str | None,
                                              expected: ToolFormat) -> None:
    found = tool_format_for(template, IDS.get)
    assert found.name == expected.name
    if expected.name == "llama" and template is LLAMA32_TEMPLATE:
        return  # the marker is still looked up in the vocabulary
    assert found == expected


def test_the_formats_of_the_local_model_folders() -> None:
    """The real templates, where their folders were fetched on this machine."""
    folders = {"Qwen2.5-Coder-1.5B-Instruct": "hermes", "SmolLM2-135M-Instruct": "json"}
    checked = 0
    for folder, name in folders.items():
        path = Path.home() / ".cache" / "dyngen" / folder
        if not (path / "tokenizer.json").exists():
            continue
        tokenizer = Tokenizer.from_model_dir(path)
        found = tool_format_for(tokenizer.chat_template, tokenizer.piece_to_id)
        assert found.name == name
        if name == "hermes":
            assert (found.marker_id, found.end_id) == (
                tokenizer.piece_to_id("<tool_call>"), tokenizer.piece_to_id("</tool_call>"))
        checked += 1
    if not checked:
        pytest.skip("no converted model folder in ~/.cache/dyngen")


def test_an_unknown_format_name_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown tool call format"):
        ToolFormat("xml")


WEATHER_CALL = '{"name": "get_weather", "arguments": {"location": "San Francisco, CA"}}'
CALLS_OF = {
    # Qwen2.5-Coder's answer to the agent-loop question: a fenced call, whole message.
    "fence": (None, f"```json\n{WEATHER_CALL}\n```", ""),
    "fence_list": (None, f"```json\n[{WEATHER_CALL}]\n```\n", ""),
    "fence_untagged": (None, f"  ```\n{WEATHER_CALL}\n```", ""),
    "hermes": (HERMES, f"<tool_call>\n{WEATHER_CALL}\n</tool_call>", ""),
    "hermes_text_first": (HERMES, f"Let me look.\n<tool_call>\n{WEATHER_CALL}\n</tool_call>",
                          "Let me look.\n"),
    "hermes_doubled_braces": (HERMES, "<tool_call>\n{" + WEATHER_CALL + "}\n</tool_call>", ""),
    "llama_tag": (LLAMA, '<|python_tag|>{"name": "get_weather", "parameters": '
                         '{"location": "San Francisco, CA"}}', ""),
    "llama_bare": (LLAMA, '{"name": "get_weather", "parameters": '
                          '{"location": "San Francisco, CA"}}', ""),
    "mistral": (MISTRAL, f"[TOOL_CALLS] [{WEATHER_CALL}]", ""),
    "mistral_text_first": (MISTRAL, f"Checking. [TOOL_CALLS][{WEATHER_CALL}]", "Checking. "),
    "json_list": (ToolFormat(), f"[{WEATHER_CALL}]", ""),
    "mistral_v11": (MISTRAL_V11, '[TOOL_CALLS]get_weather[ARGS]{"location": "San Francisco, '
                                 'CA"}', ""),
    "mistral_v11_text_first": (MISTRAL_V11, 'Checking.\n[TOOL_CALLS]get_weather[ARGS]'
                                            '{"location": "San Francisco, CA"}', "Checking.\n"),
    # [ARGS] dropped (decoded as a skipped special token): the name ends at the arguments.
    "mistral_v11_no_args_marker": (MISTRAL_V11, '[TOOL_CALLS]get_weather{"location": '
                                                '"San Francisco, CA"}', ""),
}


def _streamed(text: str, seed: int, tool_format: ToolFormat | None) -> ToolStreamDelta:
    """``text`` pushed in random chunks (some empty) then finished, gathered."""
    rng = random.Random(seed)
    parser = ToolCallParser(NAMES, tool_format)
    out = ToolStreamDelta()
    at = 0
    while at < len(text):
        step = rng.choice([0, 1, 1, 2, 3, 5, 8, 40])
        delta = parser.push(text[at:at + step])
        out.content += delta.content
        out.calls += delta.calls
        out.invalid += delta.invalid
        at += step
    last = parser.finish()
    return ToolStreamDelta(out.content + last.content, out.calls + last.calls,
                           out.invalid + last.invalid)


@pytest.mark.parametrize("case", sorted(CALLS_OF))
def test_each_format_is_read_whole_and_streamed_in_any_chunks(case: str) -> None:
    tool_format, text, content = CALLS_OF[case]
    whole = parse_tool_calls(text, NAMES, tool_format)
    assert [(c.name, c.arguments) for c in whole.calls] == [("get_weather", WEATHER_ARGS)]
    assert whole.content == content and not whole.invalid
    for seed in range(25):
        streamed = _streamed(text, seed, tool_format)
        assert [(c.name, c.arguments) for c in streamed.calls] == [("get_weather", WEATHER_ARGS)]
        assert streamed.content == content and not streamed.invalid


def test_parallel_calls_in_each_format() -> None:
    add = '{"name": "add", "arguments": {"a": 1, "b": 2}}'
    texts = {
        HERMES: f"<tool_call>\n{WEATHER_CALL}\n</tool_call>\n<tool_call>\n{add}\n</tool_call>",
        MISTRAL: f"[TOOL_CALLS] [{WEATHER_CALL}, {add}]",
        MISTRAL_V11: '[TOOL_CALLS]get_weather[ARGS]{"location": "San Francisco, CA"}'
                     '[TOOL_CALLS]add[ARGS]{"a": 1, "b": 2}',
        None: f"```json\n[{WEATHER_CALL}, {add}]\n```",
        # Llama 3.2: call objects separated by "; " (after <|python_tag|> or bare).
        LLAMA: f'<|python_tag|>{LLAMA_WEATHER}; {LLAMA_ADD}',
        ToolFormat("llama"): f"{LLAMA_WEATHER}; {LLAMA_ADD}\n",
        ToolFormat(): f"{WEATHER_CALL}\n{add}",
    }
    for tool_format, text in texts.items():
        for seed in range(10):
            streamed = _streamed(text, seed, tool_format)
            assert [c.name for c in streamed.calls] == ["get_weather", "add"]
            assert streamed.content.strip() == "" and len({c.id for c in streamed.calls}) == 2


LLAMA_WEATHER = '{"name": "get_weather", "parameters": {"location": "San Francisco, CA"}}'


def test_text_after_a_sequence_of_call_objects_is_content() -> None:
    """A call sequence ends at the first character that is neither a space, ';' nor '{'."""
    text = f"{LLAMA_WEATHER}; {LLAMA_ADD}; Done."
    for seed in range(10):
        streamed = _streamed(text, seed, ToolFormat("llama"))
        assert [c.name for c in streamed.calls] == ["get_weather", "add"]
        assert streamed.content == "Done." and not streamed.invalid
    cut = parse_tool_calls(f'{LLAMA_WEATHER}; {{"name": "add", "para', NAMES,
                           ToolFormat("llama"))
    assert [c.name for c in cut.calls] == ["get_weather"] and len(cut.invalid) == 1


MENTIONS = [
    "I can call get_weather for San Francisco, CA if you like.",
    'The call would look like {"name": "get_weather", "arguments": {}} in JSON.',
    f"Here is how a call looks:\n```json\n{WEATHER_CALL}\n```",  # a fence inside a reply
    f"```json\n{WEATHER_CALL}\n```\nThat is the call you would make.",  # not the whole reply
    '```json\n{"name": "get_time", "arguments": {}}\n```',  # no such tool bound
    '{"name": "get_time", "arguments": {}}',
    '```json\n{"location": "San Francisco, CA"}\n```',
    '```python\nprint({"name": "get_weather"})\n```',
    "```",
    "[TOOL_CALL] is not the marker",
    "<|python is not the tag",
]


@pytest.mark.parametrize("text", MENTIONS)
def test_text_that_mentions_a_tool_is_not_a_call(text: str) -> None:
    for tool_format in (None, HERMES, LLAMA, MISTRAL, MISTRAL_V11):
        whole = parse_tool_calls(text, NAMES, tool_format)
        assert whole.content == text and not whole.calls and not whole.invalid
        for seed in range(10):
            streamed = _streamed(text, seed, tool_format)
            assert streamed.content == text and not streamed.calls and not streamed.invalid


def test_only_the_templates_marker_is_read() -> None:
    text = f"<tool_call>\n{WEATHER_CALL}\n</tool_call>"
    assert parse_tool_calls(text, NAMES, MISTRAL).content == text
    assert len(parse_tool_calls(text, NAMES, HERMES).calls) == 1
    assert len(parse_tool_calls(text, NAMES, ToolFormat()).calls) == 1  # "json" reads all


@pytest.mark.parametrize(("text", "error"), [
    ('[TOOL_CALLS]get_weather[ARGS]{"location": "Par', "ended inside"),
    ("[TOOL_CALLS]get_weather[ARGS] sunny", "not a JSON object"),
    ('[TOOL_CALLS][ARGS]{"location": "Paris"}', "no tool name"),
    ('[TOOL_CALLS]get_weather[ARGS]{"location": Paris}', "not valid JSON"),
    ("[TOOL_CALLS]" + "x" * 300, "no [ARGS]"),
])
def test_a_broken_mistral_v11_call_is_invalid_whole_and_streamed(text: str, error: str) -> None:
    for seed in range(10):
        streamed = _streamed(text, seed, MISTRAL_V11)
        assert not streamed.calls and len(streamed.invalid) == 1
        assert error in streamed.invalid[0].error
        assert (streamed.invalid[0].text + streamed.content).replace(" ", "") == \
            text.replace(" ", "")


def test_a_code_fence_is_released_once_it_cannot_be_a_call() -> None:
    parser = ToolCallParser(NAMES)
    assert parser.push("```").content == ""
    assert parser.push("js").content == ""
    assert parser.push("on\n").content == ""
    assert parser.push("x = 1").content == "```json\nx = 1"  # not JSON: released
    shown = ToolCallParser(NAMES)
    assert shown.push("```").content == ""
    assert shown.push("py").content == "```py"  # another language: released at once
    unbound = ToolCallParser()  # no bound tools: a fence is never held
    assert unbound.push("```json\n").content == "```json\n"


@pytest.mark.parametrize("text", [
    "```json" + " " * 1_000_000 + '{"a": 1}',
    "```json\n[" + "{" * 200_000,
    "[TOOL_CALLS]" + "[" * 200_000,
    "<|python_tag|" * 50_000,
    "text " + "[TOOL_CALLS" * 50_000,
    "[TOOL_CALLS]get_weather[ARGS]" + "{" * 200_000,
    "[TOOL_CALLS]x[ARGS]{}" * 20_000,
])
def test_long_output_parses_in_linear_time(text: str) -> None:
    start = time.perf_counter()
    parser = ToolCallParser(NAMES, MISTRAL_V11 if "[ARGS]" in text else None)
    for at in range(0, len(text), 7):
        parser.push(text[at:at + 7])
    parser.finish()
    assert time.perf_counter() - start < 10.0


# ---- the "auto" constraint, compiled for a vocabulary holding the markers as tokens ------------

WEATHER = ToolSpec("get_weather", "Weather in a place", {
    "type": "object", "properties": {"location": {"type": "string"}}, "required": ["location"]})
ADD = ToolSpec("add", "Add two ints", {"type": "object", "properties": {
    "a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]})
MARKERS = ["<tool_call>", "</tool_call>", "<|python_tag|>", "[TOOL_CALLS]", "[ARGS]"]


@pytest.fixture(scope="module")
def vocabulary(demo_model_dir: Path) -> Any:
    """The demo tokenizer with the markers added as special tokens, as Qwen, Llama 3 and
    Mistral vocabularies hold them."""
    tokenizer = Tokenizer.from_model_dir(demo_model_dir)
    backend = tokenizer.backend
    backend.add_special_tokens(MARKERS)
    size = backend.get_vocab_size(with_added_tokens=True)
    compiler = ConstraintCompiler(backend.to_str(), tokenizer.eos_token_ids, size)
    return backend, compiler


def _allows(vocabulary: Any, template: str | None, text: str, parallel: bool = True) -> bool:
    backend, compiler = vocabulary
    tool_format = tool_format_for(template, backend.token_to_id)
    constraint = tool_choice_constraint([WEATHER, ADD], "auto", parallel, tool_format)
    matcher = compiler.matcher(constraint)
    ids = backend.encode(text, add_special_tokens=False).ids
    return all(matcher.accept(t) for t in ids) and matcher.is_accepting()


ADD_CALL = '{"name": "add", "arguments": {"a": 1, "b": 2}}'


@pytest.mark.parametrize(("template", "call"), [
    (QWEN25_TEMPLATE, f"<tool_call>\n{WEATHER_CALL}\n</tool_call>"),
    (QWEN25_TEMPLATE, f"Sure.\n<tool_call>\n{WEATHER_CALL}\n</tool_call>\n<tool_call>\n"
                      f"{ADD_CALL}\n</tool_call>"),
    (LLAMA31_TEMPLATE, '<|python_tag|>{"name": "get_weather", "parameters": '
                       '{"location": "Paris"}}'),
    (LLAMA31_TEMPLATE, '{"name": "add", "parameters": {"a": 1, "b": 2}}'),
    (MISTRAL_TEMPLATE, f"[TOOL_CALLS] [{WEATHER_CALL}, {ADD_CALL}]"),
    (SMOLLM2_TEMPLATE, f"[{WEATHER_CALL}, {ADD_CALL}]"),
    (QWEN25_TEMPLATE, f"```json\n{WEATHER_CALL}\n```"),
    (SMOLLM2_TEMPLATE, f"```json\n[{WEATHER_CALL}]\n```"),
    # A bare call, its marker dropped: still allowed, and still kept valid.
    (QWEN25_TEMPLATE, WEATHER_CALL),
    (MISTRAL_TEMPLATE, f"[{WEATHER_CALL}]"),
    (SMOLLM2_TEMPLATE, WEATHER_CALL),
    (MISTRAL_V11_TEMPLATE, '[TOOL_CALLS]get_weather[ARGS]{"location": "Paris"}'),
    (MISTRAL_V11_TEMPLATE, 'Sure.[TOOL_CALLS]get_weather[ARGS]{"location": "Paris"}'
                           '[TOOL_CALLS]add[ARGS]{"a": 1, "b": 2}'),
])
def test_auto_allows_calls_in_the_templates_format(vocabulary: Any, template: str,
                                                  call: str) -> None:
    assert _allows(vocabulary, template, call)
    assert _allows(vocabulary, template, "It is sunny in Paris.")
    assert _allows(vocabulary, template, "```python\nprint(1)\n```")


@pytest.mark.parametrize(("template", "bad"), [
    (QWEN25_TEMPLATE, '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'),
    (QWEN25_TEMPLATE, '<tool_call>\n{"name": "add", "arguments": {"a": "one", "b": 2}}\n'
                      "</tool_call>"),
    (QWEN25_TEMPLATE, '[{"name": "get_time", "arguments": {}}]'),
    (LLAMA31_TEMPLATE, WEATHER_CALL),  # Llama's calls say "parameters"
    (MISTRAL_TEMPLATE, '[TOOL_CALLS] [{"name": "get_time", "arguments": {}}]'),
    (SMOLLM2_TEMPLATE, '```json\n{"name": "get_time", "arguments": {}}\n```'),
    (SMOLLM2_TEMPLATE, '{"answer": 42}'),
    (SMOLLM2_TEMPLATE, " leading space"),
    (MISTRAL_V11_TEMPLATE, "[TOOL_CALLS]get_time[ARGS]{}"),
    (MISTRAL_V11_TEMPLATE, '[TOOL_CALLS]add[ARGS]{"a": 1}'),
])
def test_auto_keeps_a_started_call_valid(vocabulary: Any, template: str, bad: str) -> None:
    assert not _allows(vocabulary, template, bad)


def test_auto_with_one_call_at_a_time(vocabulary: Any) -> None:
    two = f"<tool_call>\n{WEATHER_CALL}\n</tool_call>\n<tool_call>\n{ADD_CALL}\n</tool_call>"
    assert _allows(vocabulary, QWEN25_TEMPLATE, two)
    assert not _allows(vocabulary, QWEN25_TEMPLATE, two, parallel=False)
    assert not _allows(vocabulary, SMOLLM2_TEMPLATE, f"[{WEATHER_CALL}, {ADD_CALL}]",
                       parallel=False)


def test_auto_with_markers_that_are_plain_text(demo_model_dir: Path) -> None:
    """A vocabulary without the marker tokens: the markers are text, text may not hold one,
    and calls come first."""
    tokenizer = Tokenizer.from_model_dir(demo_model_dir)
    compiler = ConstraintCompiler.from_tokenizer(tokenizer, tokenizer.vocab_size)
    tool_format = tool_format_for(QWEN25_TEMPLATE, tokenizer.piece_to_id)
    assert tool_format == ToolFormat("hermes")
    constraint = tool_choice_constraint([WEATHER, ADD], "auto", True, tool_format)

    def allows(text: str) -> bool:
        matcher = compiler.matcher(constraint)
        return all(matcher.accept(t) for t in tokenizer.encode(text)) and \
            matcher.is_accepting()

    assert allows(f"<tool_call>\n{WEATHER_CALL}\n</tool_call>")
    assert allows("It is sunny.")
    assert not allows(f"Sure.\n<tool_call>\n{WEATHER_CALL}\n</tool_call>")
    assert not allows('Sure.\n<tool_call>\n{"name": "get_time"}\n</tool_call>')
    assert not allows("Sure, <tool_call> then prose")


# ---- forced tool_choice: calls only, in the template's own format ----------------------------

WEATHER_PARIS = '{"name": "get_weather", "arguments": {"location": "Paris"}}'
LLAMA_PARIS = '{"name": "get_weather", "parameters": {"location": "Paris"}}'
LLAMA_ADD = '{"name": "add", "parameters": {"a": 1, "b": 2}}'
V11_PARIS = '[TOOL_CALLS]get_weather[ARGS]{"location": "Paris"}'
V11_ADD = '[TOOL_CALLS]add[ARGS]{"a": 1, "b": 2}'
# Per format: the calls a forced choice allows (choice, text, parallel, the names read back).
FORCED_ALLOWS = {
    QWEN25_TEMPLATE: [
        ("required", f"<tool_call>\n{WEATHER_PARIS}\n</tool_call>", True, ["get_weather"]),
        ("required", f"<tool_call>\n{WEATHER_PARIS}\n</tool_call>\n<tool_call>\n{ADD_CALL}"
                     "\n</tool_call>", True, ["get_weather", "add"]),
        ("add", f"<tool_call>\n{ADD_CALL}\n</tool_call>", True, ["add"]),
        # A newline after the last call, as Qwen2.5 writes it, ends the calls.
        ("required", f"<tool_call>\n{WEATHER_PARIS}\n</tool_call>\n", True, ["get_weather"]),
        ("add", f"<tool_call>\n{ADD_CALL}\n</tool_call>\n", True, ["add"]),
    ],
    LLAMA31_TEMPLATE: [
        ("required", f"<|python_tag|>{LLAMA_PARIS}", True, ["get_weather"]),
        ("required", LLAMA_PARIS, True, ["get_weather"]),
        ("add", LLAMA_ADD, True, ["add"]),
        # Llama 3.2's parallel calls.
        ("required", f"<|python_tag|>{LLAMA_PARIS}; {LLAMA_ADD}", True, ["get_weather", "add"]),
    ],
    MISTRAL_TEMPLATE: [
        ("required", f"[TOOL_CALLS] [{WEATHER_PARIS}, {ADD_CALL}]", True, ["get_weather", "add"]),
        ("get_weather", f"[TOOL_CALLS][{WEATHER_PARIS}]", True, ["get_weather"]),
    ],
    MISTRAL_V11_TEMPLATE: [
        ("required", V11_PARIS, True, ["get_weather"]),
        ("required", V11_PARIS + V11_ADD, True, ["get_weather", "add"]),
        ("add", V11_ADD, True, ["add"]),
    ],
}
# Per format: what a forced choice refuses (choice, text, parallel).
FORCED_REFUSES = {
    QWEN25_TEMPLATE: [
        ("required", f"[{WEATHER_PARIS}]", True),  # dyngen's generic list
        ("required", WEATHER_PARIS, True),  # a bare call: the marker is required
        ("required", f"Sure.\n<tool_call>\n{WEATHER_PARIS}\n</tool_call>", True),
        ("required", "It is sunny.", True),
        ("add", f"<tool_call>\n{WEATHER_PARIS}\n</tool_call>", True),
        ("required", f"<tool_call>\n{WEATHER_PARIS}\n</tool_call>\n<tool_call>\n{ADD_CALL}"
                     "\n</tool_call>", False),
    ],
    LLAMA31_TEMPLATE: [
        ("required", f"[{WEATHER_PARIS}]", True),
        ("required", WEATHER_PARIS, True),  # "arguments" is not Llama's key
        ("required", f"{LLAMA_PARIS}; {LLAMA_ADD}", False),  # one call unless parallel
        ("required", f"{LLAMA_PARIS};{LLAMA_ADD}", True),  # "; " exactly
        ("add", LLAMA_PARIS, True),
    ],
    MISTRAL_TEMPLATE: [
        ("required", f"[{WEATHER_PARIS}]", True),
        ("required", f"Sure. [TOOL_CALLS] [{WEATHER_PARIS}]", True),
        ("get_weather", f"[TOOL_CALLS] [{WEATHER_PARIS}, {WEATHER_PARIS}]", True),
        ("required", f"[TOOL_CALLS] [{WEATHER_PARIS}, {ADD_CALL}]", False),
    ],
    MISTRAL_V11_TEMPLATE: [
        ("required", f"[{WEATHER_PARIS}]", True),
        ("required", f"[TOOL_CALLS] [{WEATHER_PARIS}]", True),  # the older list
        ("required", "Sure." + V11_PARIS, True),
        ("add", V11_PARIS, True),
        ("required", V11_PARIS + V11_ADD, False),
    ],
}


def _forced_allows(vocabulary: Any, template: str, choice: str, text: str,
                   parallel: bool) -> bool:
    backend, compiler = vocabulary
    tool_format = tool_format_for(template, backend.token_to_id)
    constraint = tool_choice_constraint([WEATHER, ADD], choice, parallel, tool_format)
    matcher = compiler.matcher(constraint)
    ids = backend.encode(text, add_special_tokens=False).ids
    return all(matcher.accept(t) for t in ids) and matcher.is_accepting()


@pytest.mark.parametrize(("template", "case"), [
    (template, case) for template, cases in FORCED_ALLOWS.items() for case in cases])
def test_a_forced_call_is_written_in_the_templates_format_and_read_back(
        vocabulary: Any, template: str, case: tuple[str, str, bool, list[str]]) -> None:
    choice, text, parallel, names = case
    assert _forced_allows(vocabulary, template, choice, text, parallel)
    tool_format = tool_format_for(template, vocabulary[0].token_to_id)
    whole = parse_tool_calls(text, NAMES, tool_format)
    assert [c.name for c in whole.calls] == names and not whole.content and not whole.invalid
    for seed in range(10):
        streamed = _streamed(text, seed, tool_format)
        assert [c.name for c in streamed.calls] == names
        assert not streamed.content.strip() and not streamed.invalid


@pytest.mark.parametrize(("template", "case"), [
    (template, case) for template, cases in FORCED_REFUSES.items() for case in cases])
def test_a_forced_call_refuses_other_formats_text_and_other_tools(
        vocabulary: Any, template: str, case: tuple[str, str, bool]) -> None:
    choice, text, parallel = case
    assert not _forced_allows(vocabulary, template, choice, text, parallel)


def test_a_forced_call_without_a_format_is_the_json_list() -> None:
    """Templates without tools (SmolLM2, the fallback prompt) keep dyngen's call list."""
    constraint = tool_choice_constraint([WEATHER, ADD], "required", True, ToolFormat())
    assert isinstance(constraint, dict) and constraint["type"] == "array"
    with pytest.raises(ValueError, match="not one of the bound tools"):
        tool_choice_constraint([WEATHER], "add", True, HERMES)


def test_markers_that_are_special_tokens_need_special_tokens_decoded(
        demo_model_dir: Path) -> None:
    """Decoding drops special tokens (Mistral's [TOOL_CALLS], Llama's <|python_tag|>), so a job
    reading such a format must decode them; markers that are text (or plain tokens) need not."""
    tokenizer = Tokenizer.from_model_dir(demo_model_dir)
    special = tokenizer.piece_to_id("<|im_start|>")  # a special token of this vocabulary
    plain = tokenizer.piece_to_id("hello")
    assert special is not None and plain is not None
    assert tool_markers_are_special(tokenizer, ToolFormat("mistral", special))
    assert tool_markers_are_special(tokenizer, ToolFormat("mistral_v11", plain, None, special))
    assert not tool_markers_are_special(tokenizer, ToolFormat("llama", plain))
    assert not tool_markers_are_special(tokenizer, ToolFormat("hermes"))
