"""The limited sandbox renders ordinary templates exactly as transformers does.

The limits hook into every loop, call, filter, operator and concatenation, so these templates
use each of those the way real chat templates do (macros, recursion, namespaces, %-formatting,
string repetition, filters that pad or join, autoescape blocks) and compare the text with
transformers' own renderer. Also: a model folder's malformed template metadata is a
TokenizerError, and the Tokenizer's limits reach its templates.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from dyngen_core.errors import TokenizerError
from dyngen_core.text.chat_template import ChatTemplate
from dyngen_core.text.template_sandbox import TemplateLimits
from dyngen_core.text.tokenizer import Tokenizer
from tests.tiny_models import trained_tokenizer_json

TEMPLATES = {
    "macros and namespaces": """
{%- macro render(m, prefix='') -%}{{ prefix }}{{ m.role|upper }}: {{ m.content|trim }}
{%- endmacro -%}
{%- macro box(width) -%}[{{ caller()|center(width) }}]{%- endmacro -%}
{%- set ns = namespace(count=0, last='') -%}
{%- for m in messages -%}
{%- set ns.count = ns.count + 1 -%}{%- set ns.last = ns.last ~ m.role[0] -%}
{{ render(m, prefix='%02d. ' % loop.index) }}{{ '\\n' if not loop.last }}
{%- endfor %}
{% call box(30) %}{{ ns.count }} messages, roles {{ ns.last }}{% endcall %}
{{ '=' * 20 }}{{ (['a'] * 3)|join('-') }}{{ 2 ** 8 }} {{ 7 // 2 }} {{ 7 % 3 }} {{ 1.5 * 2 }}""",
    "tools, filters and string methods": """
{%- if tools -%}
{%- for t in tools -%}
{{ t.function.name.ljust(12) }}|{{ t.function.description.replace('e', 'E') }}|
{{- t.function.parameters.properties.keys()|list|sort|join(', ') }}
{{ t|tojson(indent=2)|indent(4, first=True) }}
{% endfor -%}
{%- endif -%}
{%- for m in messages|selectattr('role', 'equalto', 'user') -%}
{{ '{:>8}|{}'.format(m.role, m.content.split()|map('capitalize')|join(' ')) }}
{{ '%s has %d chars'|format(m.role, m.content|length) }}
{%- endfor -%}
{{ messages|map(attribute='role')|unique|join(',') }} {{ messages[1:]|length }}
{{ {'b': 2, 'a': 1}|dictsort|map('first')|join }} {{ 'abc' ~ 1 ~ none ~ true }}""",
    "recursion, blocks and autoescape": """
{%- set tree = [{'n': 'a', 'c': [{'n': 'b', 'c': []}, {'n': 'c', 'c': [{'n': 'd', 'c': []}]}]}] -%}
{%- for node in tree recursive -%}
{{ '  ' * (loop.depth - 1) }}{{ node.n }}{{ loop.cycle('!', '?') }}
{% if node.c %}{{ loop(node.c) }}{% endif %}
{%- endfor -%}
{% set block %}{% for m in messages %}<{{ m.role }}>{% endfor %}{% endset %}{{ block|length }}
{% filter upper %}{% for m in messages %}{{ m.content[:5] }}{% endfor %}{% endfilter %}
{% autoescape true %}{{ messages[0].content ~ ' & <b>' }}{% endautoescape %}
{%- if add_generation_prompt %}<|assistant|>{% endif %}""",
}
CHAT = [
    {"role": "system", "content": "  Be brief & kind.  "},
    {"role": "user", "content": "what is the weather in zürich?"},
    {"role": "assistant", "content": "Let me check."},
    {"role": "user", "content": "and in bern"},
]
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "unit": {"type": "string"}}}}}]


@pytest.mark.parametrize("source", TEMPLATES.values(), ids=TEMPLATES.keys())
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_limited_sandbox_renders_like_transformers(source: str,
                                                   add_generation_prompt: bool) -> None:
    from transformers.utils.chat_template_utils import render_jinja_template

    ours = ChatTemplate(source).render(CHAT, tools=TOOLS,
                                       add_generation_prompt=add_generation_prompt)
    (theirs,), _ = render_jinja_template([CHAT], tools=TOOLS, chat_template=source,
                                         add_generation_prompt=add_generation_prompt)
    assert ours == theirs
    assert len(ours) > 50


def folder_with(tmp_path: Path, **config: Any) -> Path:
    (tmp_path / "tokenizer.json").write_text(trained_tokenizer_json(512))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    return tmp_path


@pytest.mark.parametrize(("config", "message"), [
    ({"chat_template": [{"template": "x"}]}, "each entry must be"),
    ({"chat_template": [{"name": "a", "template": 5}]}, "each entry must be"),
    ({"chat_template": 5}, "must be a string or a list of named templates"),
    ({"add_bos_token": "false"}, "add_bos_token='false', but it must be true or false"),
])
def test_malformed_template_metadata(tmp_path: Path, config: dict[str, Any],
                                     message: str) -> None:
    with pytest.raises(TokenizerError, match=message):
        Tokenizer.from_model_dir(folder_with(tmp_path, **config))


def test_unreadable_tokenizer_files(tmp_path: Path) -> None:
    folder = folder_with(tmp_path)
    (folder / "chat_template.jinja").write_bytes(b"\xff\xfe{{")
    with pytest.raises(TokenizerError, match="chat_template.jinja' is not readable UTF-8"):
        Tokenizer.from_model_dir(folder)
    (folder / "chat_template.jinja").unlink()
    (folder / "tokenizer_config.json").write_bytes(b"\xff")
    with pytest.raises(TokenizerError, match="tokenizer_config.json' is not readable JSON"):
        Tokenizer.from_model_dir(folder)
    (folder / "tokenizer.json").write_text('{"model": {"type": "BPE", "vocab": 5}}')
    with pytest.raises(TokenizerError, match="cannot be read by `tokenizers`"):
        Tokenizer.from_model_dir(folder)


def test_tokenizer_limits_reach_its_templates(tmp_path: Path) -> None:
    source = "{% for i in range(100) %}{{ 'x' * 100 }}{% endfor %}"
    tokenizer = Tokenizer.from_model_dir(folder_with(tmp_path, chat_template=source))
    assert tokenizer.template_limits == TemplateLimits()
    assert len(tokenizer.apply_chat_template(CHAT)) == 10_000
    tokenizer.template_limits = TemplateLimits(max_chars=5_000)
    with pytest.raises(TokenizerError, match="printed 5,100 characters, above its limit of "
                                             "5,000.*tokenizer.template_limits"):
        tokenizer.apply_chat_template(CHAT)
