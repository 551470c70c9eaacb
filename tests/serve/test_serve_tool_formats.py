"""dyngen serve reads and forces tool calls in the format the model's chat template teaches:
the demo model's weights behind a Hermes-style (Qwen) template, through the ``openai`` client.

The demo vocabulary has no ``<tool_call>`` token, so the markers are plain text here; the
constraint still makes the model write them, and the server reads them back as tool calls."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from dyngen_core import Tokenizer, shared_generator
from dyngen_core.serve.options import ServeOptions
from dyngen_core.tools import ToolFormat, tool_format_for, tool_markers_are_special
from tests.serve.conftest import DEMO_ENGINE
from tests.serve.test_serve_openai import ADD, WEATHER

pytestmark = pytest.mark.demo

MODEL = "demo-hermes"
# The lines of Qwen2.5's template that matter here: the tools in the system turn, past calls
# as <tool_call> blocks, tool results as <tool_response> in a user turn.
HERMES_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nYou are a helpful assistant.\n\n# Tools\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
    "{%- for tool in tools %}\n{{ tool | tojson }}{%- endfor %}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ message.content }}"
    "\n</tool_response><|im_end|>\n"
    "{%- elif message.tool_calls %}<|im_start|>assistant\n"
    "{%- for call in message.tool_calls %}<tool_call>\n"
    '{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}'
    "\n</tool_call>{%- endfor %}<|im_end|>\n"
    "{%- else %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}"
)


@pytest.fixture(scope="module")
def hermes_model_dir(demo_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The demo model's files (weights linked, not copied) with a Hermes-style template."""
    folder = tmp_path_factory.mktemp("demo-hermes")
    for item in demo_model_dir.iterdir():
        if item.name != "tokenizer_config.json":
            (folder / item.name).symlink_to(item)
    config = json.loads((demo_model_dir / "tokenizer_config.json").read_text())
    config["chat_template"] = HERMES_TEMPLATE
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


@pytest.fixture(scope="module")
def hermes_client(hermes_model_dir: Path) -> Iterator[Any]:
    import openai

    from dyngen_core.serve.app import create_app
    from dyngen_core.serve.server import ServerThread

    engine = shared_generator(str(hermes_model_dir), engine_options=DEMO_ENGINE)
    options = ServeOptions(model_dir=str(hermes_model_dir), model_name=MODEL,
                           engine_options=DEMO_ENGINE)
    with ServerThread(create_app(engine, options)) as running:
        yield openai.OpenAI(base_url=running.base_url + "/v1", api_key="unused",
                            max_retries=0, timeout=120)


ASK = [{"role": "user", "content": "What is 2 plus 3?"}]


def _raw(choice: Any) -> str:
    """The reply's text as the model wrote it, from its logprobs' tokens."""
    return "".join(entry.token for entry in choice.logprobs.content)


def test_the_template_teaches_hermes(hermes_model_dir: Path) -> None:
    tokenizer = Tokenizer.from_model_dir(hermes_model_dir)
    found = tool_format_for(tokenizer.chat_template, tokenizer.piece_to_id)
    assert found == ToolFormat("hermes")  # no marker tokens in this vocabulary
    assert not tool_markers_are_special(tokenizer, found)


def test_a_named_tool_choice_is_written_as_a_tool_call_block(hermes_client: Any) -> None:
    reply = hermes_client.chat.completions.create(
        model=MODEL, messages=ASK, tools=[WEATHER, ADD],
        tool_choice={"type": "function", "function": {"name": "add"}},
        max_tokens=64, temperature=0, logprobs=True)
    choice = reply.choices[0]
    raw = _raw(choice)
    assert raw.startswith('<tool_call>\n{"name": "add", "arguments": {')
    assert raw.rstrip("\n").endswith("}\n</tool_call>")
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.function.name == "add"
    jsonschema.validate(json.loads(call.function.arguments), ADD["function"]["parameters"])


def test_required_calls_stream_back_as_tool_calls(hermes_client: Any) -> None:
    chunks = list(hermes_client.chat.completions.create(
        model=MODEL, messages=ASK, tools=[WEATHER, ADD], tool_choice="required",
        max_tokens=96, temperature=0, stream=True))
    deltas = [d for c in chunks for d in (c.choices[0].delta.tool_calls or [])]
    assert deltas and [d.index for d in deltas] == list(range(len(deltas)))
    for delta in deltas:
        tool = {"add": ADD, "get_weather": WEATHER}[delta.function.name]
        jsonschema.validate(json.loads(delta.function.arguments),
                            tool["function"]["parameters"])
    assert not "".join(c.choices[0].delta.content or "" for c in chunks).strip()
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_past_calls_and_results_go_through_the_template(hermes_client: Any) -> None:
    history: list[dict[str, Any]] = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "5"},
    ]
    plain = hermes_client.chat.completions.create(
        model=MODEL, messages=history, tools=[WEATHER, ADD], tool_choice="none",
        max_tokens=8, temperature=0)
    assert plain.choices[0].message.content and not plain.choices[0].message.tool_calls
    forced = hermes_client.chat.completions.create(
        model=MODEL, messages=history, tools=[WEATHER, ADD], tool_choice="required",
        parallel_tool_calls=False, max_tokens=64, temperature=0)
    assert len(forced.choices[0].message.tool_calls) == 1
