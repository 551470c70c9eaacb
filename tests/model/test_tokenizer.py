"""Tokenizer on the converted demo model, against transformers.

Oracles: (1) transformers' own GGUF tokenizer (vocabulary, merges and special tokens read from the
GGUF by transformers, not by us), given llama.cpp's pre-tokenizer for ``tokenizer.ggml.pre =
"smollm"`` (each digit split off, then the GPT-2 regex). transformers has no split for "smollm"
and falls back to plain GPT-2, which differs from llama.cpp and from the original SmolLM2
tokenizer.json (Digits + ByteLevel) only on whitespace right before a digit; a second test checks
that the unmodified one agrees everywhere else. (2) transformers loading our converted folder
(tokenizer_config.json, chat template). Chat templates: transformers' apply_chat_template.
"""

from __future__ import annotations

import random
import re
from pathlib import Path
from typing import Any

import pytest
import tokenizers
from tokenizers import Regex, pre_tokenizers

from dyngen_core.errors import TokenizerError
from dyngen_core.text.tokenizer import Tokenizer

pytestmark = pytest.mark.demo

PIECES = [
    "Hello world", "  leading spaces", "trailing spaces   ", "multiple     spaces", "\t\ttabs",
    "new\nlines\n\n\n", "\r\n crlf", "日本語のテキスト", "中文字符测试", "한국어 텍스트",
    "Ελληνικά",
    "русский язык", "مرحبا", "emoji 😀👍🏽🇺🇸 ❤️‍🔥", "🎉🎉", "digits 1234567890", "3.14159",
    "1,000,000", "x=42;y=7", "  123", "\n\n 7", " 0", "def f(x):\n    return x ** 2\n",
    "for (int i = 0; i < n; ++i) { a[i] = b[i]; }", "<|im_start|>", "<|im_end|>",
    "<|endoftext|>", "<file_sep>", "<jupyter_code>", "don't I'm we'll they've", "naïve café",
    "\u00a0nbsp\u00a0", "zero\u200bwidth", "MiXeD CaSe", "https://example.com/a?b=c&d=1",
    "$100.00 (USD)", "#hashtag @user", "λ→∀∃ ∑ ≈", "𝔘𝔫𝔦𝔠𝔬𝔡𝔢", "", " ", "\n", "ÿ€𐍈",
]
SEPARATORS = ["", " ", "  ", "\n", "\t", "5", " 5", "\n\n"]


def sample_texts(count: int = 200) -> list[str]:
    rng = random.Random(0)
    texts = list(PIECES)
    while len(texts) < count:
        parts = rng.sample(PIECES, rng.randint(2, 4))
        texts.append("".join(p + rng.choice(SEPARATORS) for p in parts))
    return texts


TEXTS = sample_texts()


@pytest.fixture(scope="module")
def ours(demo_model_dir: Path) -> Tokenizer:
    return Tokenizer.from_model_dir(demo_model_dir)


@pytest.fixture(scope="module")
def gguf_tokenizer(demo_gguf_file: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(demo_gguf_file.parent, gguf_file=demo_gguf_file.name)


@pytest.fixture(scope="module")
def oracle(gguf_tokenizer: Any) -> tuple[tokenizers.Tokenizer, tokenizers.Tokenizer]:
    """transformers' GGUF tokenizer with llama.cpp's "smollm" pre-tokenizer; the second copy
    reads special-token strings as text (transformers' split_special_tokens=True)."""
    copies = []
    for split_specials in (False, True):
        backend = tokenizers.Tokenizer.from_str(gguf_tokenizer.backend_tokenizer.to_str())
        backend.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(r"\p{N}"), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ])
        backend.encode_special_tokens = split_specials
        copies.append(backend)
    return copies[0], copies[1]


@pytest.fixture(scope="module")
def hf_folder(demo_model_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(demo_model_dir)


def test_ids_equal_the_oracle_on_200_strings(
    ours: Tokenizer, oracle: tuple[tokenizers.Tokenizer, tokenizers.Tokenizer]
) -> None:
    assert len(TEXTS) == 200
    parsing, splitting = oracle
    for text in TEXTS:
        expected = parsing.encode(text, add_special_tokens=False).ids
        assert ours.encode(text, encode_special_tokens=True) == expected, repr(text)
        assert ours.encode(text) == splitting.encode(text, add_special_tokens=False).ids, text


def test_plain_transformers_gguf_tokenizer_differs_only_before_digits(
    ours: Tokenizer, gguf_tokenizer: Any
) -> None:
    differing = [t for t in TEXTS if ours.encode(t, encode_special_tokens=True)
                 != gguf_tokenizer(t, add_special_tokens=False)["input_ids"]]
    assert all(re.search(r"\s\d", t) for t in differing), differing
    assert ours.encode("  1") == [ours.piece_to_id("ĠĠ"), ours.piece_to_id("1")]


def test_transformers_reads_our_folder_the_same_way(ours: Tokenizer, hf_folder: Any) -> None:
    for text in TEXTS:
        ids = hf_folder(text, add_special_tokens=False)["input_ids"]
        assert ours.encode(text, encode_special_tokens=True) == ids, repr(text)
        assert ours.decode(ids, decode_special_tokens=True) == hf_folder.decode(
            ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        assert ours.decode(ids) == hf_folder.decode(
            ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)


def test_decode_round_trip(ours: Tokenizer) -> None:
    for text in TEXTS:
        assert ours.decode(ours.encode(text)) == text
        assert ours.decode(ours.encode(text, encode_special_tokens=True),
                           decode_special_tokens=True) == text
    assert ours.encode_batch(TEXTS[:20], add_bos=True) == [
        ours.encode(t, add_bos=True) for t in TEXTS[:20]]


def test_special_tokens_and_ids(ours: Tokenizer) -> None:
    assert ours.encode("<|im_end|>", encode_special_tokens=True) == [2]
    assert ours.encode("<|im_end|>") != [2] and 2 not in ours.encode("<|im_end|>")
    assert (ours.bos_token_id, ours.eos_token_id, ours.pad_token_id, ours.unk_token_id) == (
        1, 2, 2, 0)
    assert ours.eos_token_ids == (2,) and ours.vocab_size == 49152
    assert ours.special_token_ids == set(range(17))
    assert ours.encode("Hi", add_bos=True) == [1, *ours.encode("Hi")]
    assert ours.encode("<|im_start|>Hi", add_bos=True, encode_special_tokens=True)[:2] != [1, 1]


CONVERSATIONS = [
    [{"role": "user", "content": "What is 2+2?"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi 👋"}],
    [{"role": "user", "content": "Name a fruit."}, {"role": "assistant", "content": "Apple."},
     {"role": "user", "content": "Another,\nplease."}],
    [{"role": "system", "content": ""}, {"role": "user", "content": "  spaced  "},
     {"role": "assistant", "content": "日本語"}],
]


@pytest.mark.parametrize("conversation", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_demo_chat_template_renders_like_transformers(
    ours: Tokenizer, hf_folder: Any, gguf_tokenizer: Any,
    conversation: list[dict[str, str]], add_generation_prompt: bool,
) -> None:
    rendered = ours.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt)
    for reference in (hf_folder, gguf_tokenizer):
        assert rendered == reference.apply_chat_template(
            conversation, tokenize=False, add_generation_prompt=add_generation_prompt)


# A template exercising what real ones use: tools and tojson, namespace, loop controls,
# raise_exception, strftime_now, the generation tag, special-token variables, documents.
RICH_TEMPLATE = """{{ bos_token }}
{%- set ns = namespace(system=none) -%}
{%- for m in messages if m.role == 'system' %}{% set ns.system = m.content %}{% endfor -%}
{%- if tools %}<tools>{{ tools | tojson }}</tools>
<tools_indented>{{ tools[0] | tojson(indent=2) }}</tools_indented>
{% endif -%}
{%- if documents %}{% for d in documents %}[{{ d.title }}] {{ d.text }}
{% endfor %}{% endif -%}
Today: {{ strftime_now('%Y') }}|{{ ns.system or 'no system' }}
{% for m in messages %}
{%- if m.role == 'system' %}{% continue %}{% endif -%}
{%- if m.role not in ['user', 'assistant', 'tool'] %}
{{ raise_exception('bad role ' + m.role) }}{% endif -%}
<|im_start|>{{ m.role }}
{% if m.role == 'assistant' %}{% generation %}{{ m.content }}{% endgeneration %}
{%- if m.tool_calls %}{% for c in m.tool_calls %}
<call>{{ c.function | tojson }}</call>{% endfor %}{% endif -%}
{% else %}{{ m.content }}{% endif %}<|im_end|>
{% if loop.index > 20 %}{% break %}{% endif -%}
{% endfor -%}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}{{ extra | default('') }}{{ eos_token }}"""

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather for a city, e.g. Zürich",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}]
TOOL_CHAT = [
    {"role": "system", "content": "Use tools <b>wisely</b>."},
    {"role": "user", "content": "Weather in Zürich?"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function",
         "function": {"name": "get_weather", "arguments": {"city": "Zürich"}}}]},
    {"role": "tool", "content": "21°C", "tool_call_id": None},
]


@pytest.mark.parametrize("options", [
    {"tools": TOOLS}, {"tools": None}, {"documents": [{"title": "Doc", "text": "Body"}]},
    {"extra": "X", "add_generation_prompt": False}, {"eos_token": "<override>"},
])
def test_rich_template_renders_like_transformers(
    ours: Tokenizer, hf_folder: Any, options: dict[str, Any]
) -> None:
    options = {"add_generation_prompt": True, **options}
    rendered = ours.apply_chat_template(TOOL_CHAT, chat_template=RICH_TEMPLATE, **options)
    expected = hf_folder.apply_chat_template(
        TOOL_CHAT, chat_template=RICH_TEMPLATE, tokenize=False, **options)
    assert rendered == expected
    assert "Zürich" in rendered and "None" not in rendered


def test_continue_final_message_like_transformers(ours: Tokenizer, hf_folder: Any) -> None:
    chat = [{"role": "user", "content": "Count"}, {"role": "assistant", "content": "1, 2,"}]
    rendered = ours.apply_chat_template(chat, add_generation_prompt=False,
                                        continue_final_message=True)
    assert rendered.endswith("1, 2,")
    assert rendered == hf_folder.apply_chat_template(
        chat, tokenize=False, continue_final_message=True)


def test_template_errors_are_tokenizer_errors(ours: Tokenizer) -> None:
    with pytest.raises(TokenizerError, match="bad role robot"):
        ours.apply_chat_template([{"role": "robot", "content": "x"}], chat_template=RICH_TEMPLATE)
    with pytest.raises(TokenizerError, match="does not compile"):
        ours.apply_chat_template(CONVERSATIONS[0], chat_template="{% for %}")
    with pytest.raises(TokenizerError, match="failed to render"):  # the sandbox holds
        ours.apply_chat_template(CONVERSATIONS[0], chat_template="{{ messages.__class__ }}"
                                 "{{ ''.__class__.__mro__[1].__subclasses__() }}")
    with pytest.raises(TokenizerError, match="JSON schema"):
        ours.apply_chat_template(CONVERSATIONS[0], tools=[print])  # type: ignore[list-item]


def test_missing_files_and_templates(demo_model_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(TokenizerError, match="tokenizer.json"):
        Tokenizer.from_model_dir(tmp_path)
    (tmp_path / "tokenizer.json").write_bytes((demo_model_dir / "tokenizer.json").read_bytes())
    bare = Tokenizer.from_model_dir(tmp_path)
    assert not bare.has_chat_template and bare.eos_token_id is None
    with pytest.raises(TokenizerError, match="no chat template; pass a prompt string"):
        bare.apply_chat_template(CONVERSATIONS[0])
    with pytest.raises(TokenizerError, match="no BOS token"):
        bare.encode("hi", add_bos=True)
    (tmp_path / "chat_template.jinja").write_text("{{ messages[0].content }}!")
    (tmp_path / "generation_config.json").write_text('{"eos_token_id": [2, 0]}')
    configured = Tokenizer.from_model_dir(tmp_path)
    assert configured.apply_chat_template(CONVERSATIONS[0]) == "What is 2+2?!"
    assert configured.eos_token_ids == (2, 0) and configured.eos_token_id == 2
