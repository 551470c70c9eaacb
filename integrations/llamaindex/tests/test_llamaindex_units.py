"""Adapter logic that needs no model: options, message conversion, tool turns, parsing."""

from __future__ import annotations

import pytest
from llama_index.core.base.llms.types import (
    ChatMessage,
    ChatResponse,
    ImageBlock,
    MessageRole,
    ToolCallBlock,
)
from llama_index.llms.dyngen import DynGenLLM
from llama_index.llms.dyngen.chat import ChatTurn
from llama_index.llms.dyngen.messages import assistant_message, to_template_messages
from llama_index.llms.dyngen.params import take_call_options
from llama_index.llms.dyngen.structured import parse_final, parse_partial, schema_messages
from llama_index.llms.dyngen.tool_calling import (
    ToolTurn,
    resolve_tool_choice,
    tool_selections,
    validate_tool_response,
)
from pydantic import BaseModel, ValidationError

ADD = {"type": "function", "function": {"name": "add", "description": "Add two ints",
       "parameters": {"type": "object", "properties": {"a": {"type": "integer"},
                      "b": {"type": "integer"}}, "required": ["a", "b"]}}}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}


def test_engine_options_are_validated_by_engine_options_before_any_load() -> None:
    # The folder does not exist: the error must be about the option, raised before loading.
    with pytest.raises(ValidationError, match="cache_mode"):
        DynGenLLM(model_dir="/nonexistent", cache_mode="q5")
    with pytest.raises(ValidationError, match="cache_tokens"):
        DynGenLLM(model_dir="/nonexistent", cache_tokens=1)
    with pytest.raises(ValidationError, match="max_batch_size"):
        DynGenLLM(model_dir="/nonexistent", engine_options={"max_batch_size": 0})
    with pytest.raises(ValidationError, match="tensor_parallel"):
        DynGenLLM(model_dir="/nonexistent", tensor_parallel=-1)


def test_no_engine_argument_means_the_engines_defaults() -> None:
    """Defaults are what users get: no engine argument asks for ``EngineOptions()``, the
    generator's own defaults (checked in the core's tests); checked without building one,
    which would load an engine of that size."""
    from dyngen_core import EngineOptions

    assert "engine_options" not in DynGenLLM._gather_engine_options({"model_dir": "m"})
    field = DynGenLLM.model_fields["engine_options"]
    assert field.default_factory is not None
    assert field.default_factory() == EngineOptions()  # type: ignore[call-arg]


def test_flat_engine_options_win_over_an_engine_options_object() -> None:
    from dyngen_core import EngineOptions

    data = DynGenLLM._gather_engine_options(
        {"model_dir": "m", "engine_options": EngineOptions(cache_tokens=512, dedup=False),
         "dedup": True})
    assert data["engine_options"] == EngineOptions(cache_tokens=512, dedup=True)
    assert "dedup" not in data
    data = DynGenLLM._gather_engine_options({"model_dir": "m", "tensor_parallel": 2})
    assert data["engine_options"] == EngineOptions(tensor_parallel=2)


def test_a_missing_model_folder_is_a_clear_error() -> None:
    from dyngen_core.errors import ModelFolderError

    with pytest.raises(ModelFolderError, match="does not exist"):
        DynGenLLM(model_dir="/nonexistent/model", cache_tokens=512)


def test_per_call_options_refuse_unknown_keywords() -> None:
    kwargs = {"max_tokens": 3, "temperature": 0.5, "constraint": ["a", "b"]}
    assert take_call_options(dict(kwargs), "complete") == kwargs
    with pytest.raises(TypeError, match=r"unexpected keyword argument\(s\) \['temprature'\]"):
        take_call_options({"temprature": 0.1}, "chat")


def test_messages_become_template_dicts_with_tool_calls_and_named_results() -> None:
    call = ToolCallBlock(tool_call_id="c1", tool_name="add", tool_kwargs={"a": 1, "b": 2})
    legacy = {"id": "c2", "type": "function",
              "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
    messages = [
        ChatMessage(role=MessageRole.DEVELOPER, content="Be brief."),
        ChatMessage(role="user", content="1+2 and Oslo?"),
        ChatMessage(role="assistant", blocks=[call]),
        ChatMessage(role="assistant", content="", additional_kwargs={"tool_calls": [legacy]}),
        ChatMessage(role="tool", content="3", additional_kwargs={"tool_call_id": "c1"}),
        ChatMessage(role="tool", content="rain", additional_kwargs={"tool_call_id": "c2"}),
    ]
    out = to_template_messages(messages)
    assert [m["role"] for m in out] == ["system", "user", "assistant", "assistant", "tool",
                                        "tool"]
    assert out[2]["tool_calls"] == [{"id": "c1", "type": "function",
                                     "function": {"name": "add", "arguments": {"a": 1, "b": 2}}}]
    assert out[3]["tool_calls"][0]["function"]["arguments"] == {"city": "Oslo"}
    assert (out[4]["name"], out[5]["name"]) == ("add", "get_weather")
    assert out[4]["tool_call_id"] == "c1" and out[4]["content"] == "3"


def test_non_text_content_is_refused_with_a_clear_error() -> None:
    image = ImageBlock(url="http://example.invalid/cat.png")
    with pytest.raises(ValueError, match="text only.*ImageBlock"):
        to_template_messages([ChatMessage(role="user", blocks=[image])])


def test_assistant_message_round_trips_tool_calls() -> None:
    calls = [{"id": "x", "type": "function", "function": {"name": "add",
                                                          "arguments": {"a": 1, "b": 2}}}]
    message = assistant_message("", calls)
    assert to_template_messages([message])[0]["tool_calls"] == calls
    assert message.additional_kwargs["tool_calls"] == calls


@pytest.mark.parametrize(("choice", "required", "expected"), [
    (None, False, "auto"), (None, True, "required"), ("auto", True, "required"),
    ("any", False, "required"), ("none", True, "none"), ("add", True, "add"),
    ({"type": "function", "function": {"name": "add"}}, False, "add"),
])
def test_tool_choice_and_tool_required_fold_into_one_choice(
    choice: object, required: bool, expected: str
) -> None:
    turn = ToolTurn.from_kwargs({"tools": [ADD, WEATHER],
                                 "tool_choice": resolve_tool_choice(choice, required)})
    assert turn is not None and turn.choice == expected


def test_forced_choices_get_a_constraint_and_auto_gets_none() -> None:
    parallel = ToolTurn([ADD, WEATHER], "required", parallel=True).constraint()
    assert parallel is not None and "maxItems" not in parallel
    single = ToolTurn([ADD, WEATHER], "required", parallel=False).constraint()
    assert single is not None and single["maxItems"] == 1
    named = ToolTurn([ADD, WEATHER], "get_weather").constraint()
    assert named is not None and named["items"]["properties"]["name"] == {"const": "get_weather"}
    auto = ToolTurn([ADD], "auto").constraint()
    assert auto.kind == "grammar" and '"const": "add"' in auto.source
    assert ToolTurn([ADD], "none").constraint().kind == "regex"  # text only: no call possible
    assert ToolTurn.history_only().constraint() is None
    with pytest.raises(ValueError, match="not one of the bound tools"):
        ToolTurn([ADD], "multiply")


def _stream(turn: ChatTurn, text: str, step: int) -> list[ChatResponse]:
    pieces = [text[i:i + step] for i in range(0, len(text), step)]
    out, so_far = [], ""
    for i, piece in enumerate(pieces):
        so_far += piece
        out.append(turn.response(so_far, delta=piece, final=i == len(pieces) - 1))
    return out


def test_streamed_tool_calls_keep_one_id_and_partial_responses_never_raise() -> None:
    text = '[{"name": "add", "arguments": {"a": 1, "b": 2}}, ' \
           '{"name": "get_weather", "arguments": {"city": "Oslo"}}]'
    turn = ChatTurn([1], tools=ToolTurn([ADD, WEATHER], "required", parallel=True))
    responses = _stream(turn, text, step=3)
    seen = [tool_selections(r, error_on_no_tool_call=False) for r in responses]
    counts = [len(s) for s in seen]
    assert counts[0] == 0 and counts == sorted(counts) and counts[-1] == 2
    first_ids = {s[0].tool_id for s in seen if s}
    assert len(first_ids) == 1  # the first call kept its id across partial responses
    final = seen[-1]
    assert [(c.tool_name, c.tool_kwargs) for c in final] == [
        ("add", {"a": 1, "b": 2}), ("get_weather", {"city": "Oslo"})]
    assert all(r.delta == "" for r in responses)  # the call JSON is not streamed as prose


def test_prose_streams_as_deltas_and_hermes_blocks_are_read_in_auto_mode() -> None:
    text = 'Let me check. <tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}' \
           '</tool_call>'
    turn = ChatTurn([1], tools=ToolTurn([WEATHER], "auto"))
    responses = _stream(turn, text, step=4)
    assert "".join(r.delta or "" for r in responses).strip() == "Let me check."
    assert responses[-1].message.content == "Let me check."
    calls = tool_selections(responses[-1], error_on_no_tool_call=True)
    assert [(c.tool_name, c.tool_kwargs) for c in calls] == [("get_weather", {"city": "Rome"})]


def test_no_tool_call_raises_only_when_asked_and_cut_calls_are_reported() -> None:
    plain = ChatTurn([1], tools=ToolTurn([ADD], "auto")).response("Just text.")
    assert tool_selections(plain, error_on_no_tool_call=False) == []
    with pytest.raises(ValueError, match="expected at least one tool call"):
        tool_selections(plain, error_on_no_tool_call=True)
    cut = ChatTurn([1], tools=ToolTurn([ADD], "required")).response('[{"name": "add", "argu')
    assert "ended inside" in cut.message.additional_kwargs["invalid_tool_calls"][0]["error"]
    with pytest.raises(ValueError, match="could not be read: the output ended inside"):
        tool_selections(cut, error_on_no_tool_call=True)


def test_tool_choice_none_reads_no_calls() -> None:
    turn = ChatTurn([1], tools=ToolTurn([ADD], "none"))
    reply = turn.response('[{"name": "add", "arguments": {"a": 1, "b": 2}}]')
    assert tool_selections(reply, error_on_no_tool_call=False) == []


def test_single_call_validation_keeps_the_first_call() -> None:
    calls = [{"id": str(i), "type": "function", "function": {"name": "add", "arguments": {}}}
             for i in range(2)]
    response = ChatResponse(message=assistant_message("", calls))
    assert len(tool_selections(validate_tool_response(response, False), True)) == 1
    assert len(tool_selections(validate_tool_response(response, True), True)) == 2


class City(BaseModel):
    name: str
    population: int


def test_structured_helpers_state_the_schema_and_parse_partial_and_final() -> None:
    messages = schema_messages([ChatMessage(role="user", content="Paris?")], City)
    assert '"population"' in (messages[-1].content or "") and len(messages) == 1
    partial = parse_partial('{"name": "Paris", "popul', City)
    assert partial is not None and partial.model_dump() == {"name": "Paris", "population": None}
    assert parse_partial("[1, 2", City) is None
    done = ChatResponse(message=ChatMessage(role="assistant",
                                            content='{"name": "Paris", "population": 2}'))
    assert parse_final(done, City) == City(name="Paris", population=2)
    cut = ChatResponse(message=ChatMessage(role="assistant", content='{"name": "Pa'),
                       raw={"eos_reason": "max_new_tokens"})
    with pytest.raises(ValueError, match="raise max_tokens"):
        parse_final(cut, City)


# A Hermes-style template that renders tools itself (as Qwen's and Hermes' do).
NATIVE_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}"
    "</tools><|im_end|>\n{% endif %}{% for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.tool_calls %}{% for c in m.tool_calls %}<tool_call>{{ c.function | tojson }}"
    "</tool_call>{% endfor %}{% else %}{{ m.content }}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
HISTORY = [
    ChatMessage(role="user", content="1+2?"),
    ChatMessage(role="assistant", blocks=[ToolCallBlock(tool_call_id="c1", tool_name="add",
                                                        tool_kwargs={"a": 1, "b": 2})]),
    ChatMessage(role="tool", content="3", additional_kwargs={"tool_call_id": "c1"}),
]


def _tokenizer(template: str | None = None) -> object:
    from dyngen_core import Tokenizer
    from dyngen_core.cli.convert.demo import default_demo_dir, is_complete

    folder = default_demo_dir()
    if not is_complete(folder):
        pytest.skip("the demo model is fetched by the demo-model tests")
    tokenizer = Tokenizer.from_model_dir(folder)
    if template is None:
        return tokenizer
    return Tokenizer(tokenizer.backend, special_tokens=tokenizer.special_tokens,
                     eos_token_ids=tokenizer.eos_token_ids, chat_template=template)


def test_a_template_with_tool_support_renders_tools_and_calls_itself() -> None:
    text = ToolTurn([ADD], "auto").render(_tokenizer(NATIVE_TEMPLATE),
                                          to_template_messages(HISTORY))
    assert '<tools>{"type": "function", "function": {"name": "add"' in text
    assert '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>' in text
    assert "<|im_start|>tool\n3<|im_end|>" in text and "You can call these tools" not in text


def test_a_template_without_tool_support_gets_the_fallback() -> None:
    chatml = _tokenizer()
    offered = ToolTurn([ADD], "required").render(chatml, to_template_messages(HISTORY))
    assert "You can call these tools" in offered
    # Every tool_choice lists the tools in the same words: agent turns share the prefix.
    for choice in ("auto", "none", "add"):
        assert ToolTurn([ADD], choice).render(chatml, to_template_messages(HISTORY)) == offered
    assert '[{"name": "add", "arguments": {"a": 1, "b": 2}}]' in offered
    assert "Result of tool call c1 (add): 3" in offered
    replay = ToolTurn.history_only().render(chatml, to_template_messages(HISTORY))
    assert "Result of tool call c1 (add): 3" in replay and "You can call" not in replay
