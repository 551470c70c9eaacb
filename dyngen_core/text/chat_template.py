"""Rendering a model's jinja2 chat template the way Hugging Face transformers does.

Templates come from model folders, so they are untrusted code: they run in jinja2's immutable
sandbox. The environment matches transformers' (trim_blocks, lstrip_blocks, loopcontrols, the
``{% generation %}`` tag, ``raise_exception``, ``strftime_now``, a ``tojson`` that keeps non-ASCII
text and does not escape HTML), and so does what a template sees: messages with None-valued keys
dropped, the special tokens (``bos_token``, ``eos_token``, ...), ``tools`` as JSON schemas,
``documents``, ``add_generation_prompt`` and any extra keyword. Pure Python: no torch.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment

from dyngen_core.errors import TokenizerError

_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "
# Names a message's reasoning may travel under; templates read the first (and gpt-oss `thinking`).
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


class _GenerationTag(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` marks assistant text for training masks in
    transformers; for rendering it only outputs its body."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        call = self.call_method("_render_body")
        return jinja2.nodes.CallBlock(call, [], [], body).set_lineno(lineno)

    def _render_body(self, caller: Any) -> str:
        return str(caller())


class _TemplateNamespace(jinja2.utils.Namespace):
    """jinja2's ``namespace`` without underscore-prefixed attributes (no reach into internals)."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805  (jinja2's signature trick)
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _check_namespace_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _check_namespace_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)


def _check_namespace_name(name: Any) -> None:
    if isinstance(name, str) and name.startswith("_"):
        raise jinja2.exceptions.SecurityError(
            f"chat templates cannot store underscore-prefixed attributes, got {name!r}"
        )


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | str | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _dict_factory(*args: Any, **kwargs: Any) -> dict[Any, Any]:
    return dict(*args, **kwargs)


def _new_environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _dict_factory
    env.globals["namespace"] = _TemplateNamespace
    return env


class ChatTemplate:
    """One compiled chat template.

    source: the jinja2 template text.
    special_tokens: names the template may read, e.g. ``{"bos_token": "<s>", ...}``; keyword
        arguments given at render time override them.
    """

    def __init__(self, source: str, special_tokens: Mapping[str, str] | None = None) -> None:
        self.source = source
        self.special_tokens = dict(special_tokens or {})
        try:
            self._template = _new_environment().from_string(source)
        except jinja2.TemplateSyntaxError as exc:
            raise TokenizerError(
                f"the chat template does not compile (line {exc.lineno}: {exc.message}); fix "
                "chat_template in tokenizer_config.json or pass chat_template=... explicitly"
            ) from exc

    def render(
        self,
        messages: Sequence[Any],
        *,
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        documents: Sequence[Mapping[str, Any]] | None = None,
        continue_final_message: bool = False,
        **kwargs: Any,
    ) -> str:
        """Render a conversation to the prompt text (special tokens still written as text).

        messages: dicts (or pydantic models / dataclasses) with at least ``role`` and ``content``.
        add_generation_prompt: end with the header that starts an assistant turn.
        tools: JSON schemas of callable tools, as OpenAI / transformers write them.
        documents: dicts with ``title`` and ``text`` for retrieval-augmented templates.
        continue_final_message: end the text inside the last message, so the model continues it
            (exclusive with ``add_generation_prompt``).
        kwargs: extra variables for the template (e.g. ``enable_thinking=False``).
        """
        if continue_final_message and add_generation_prompt:
            raise TokenizerError(
                "continue_final_message and add_generation_prompt exclude each other; pass "
                "add_generation_prompt=False to continue the last message"
            )
        chat = _alias_reasoning(_normalize_messages(messages))
        final_text = _tag_final_message(chat) if continue_final_message else None
        context = {**self.special_tokens, **_plain(kwargs)}
        try:
            text = self._template.render(
                messages=chat,
                tools=_tool_schemas(tools),
                documents=_documents(documents),
                add_generation_prompt=add_generation_prompt,
                **context,
            )
        except jinja2.TemplateError as exc:
            raise TokenizerError(f"the chat template failed to render: {exc}") from exc
        return text if final_text is None else _cut_at_tag(text, final_text)


def _normalize_messages(messages: Sequence[Any]) -> list[dict[str, Any]]:
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise TokenizerError(
            "messages must be a list of dicts like {'role': 'user', 'content': 'Hi'}, "
            f"got {type(messages).__name__}"
        )
    if not messages:
        raise TokenizerError("cannot render an empty conversation; give at least one message")
    chat = []
    for message in _plain(list(messages)):
        if not isinstance(message, dict):
            raise TokenizerError(
                f"each message must be a dict with 'role' and 'content', got {message!r}"
            )
        # APIs send content=None or tool_calls=None; many templates render "None" for those.
        chat.append({k: v for k, v in message.items() if v is not None})
    return chat


def _alias_reasoning(chat: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for message in chat:
        present = (message[k] for k in _REASONING_FIELDS if message.get(k) is not None)
        reasoning = next(present, None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        out.append(message)
    return out


def _tool_schemas(tools: Sequence[Any] | None) -> list[Any] | None:
    if tools is None:
        return None
    for tool in tools:
        if not isinstance(tool, Mapping):
            raise TokenizerError(
                f"each tool must be a JSON schema dict like {{'type': 'function', 'function': "
                f"{{'name': ..., 'parameters': ...}}}}, got {type(tool).__name__}"
            )
    return [_plain(tool) for tool in tools]


def _documents(documents: Sequence[Any] | None) -> list[Any] | None:
    if documents is None:
        return None
    for document in documents:
        if not isinstance(document, Mapping):
            raise TokenizerError("documents must be dicts with 'title' and 'text' keys")
    return [_plain(document) for document in documents]


def _plain(value: Any) -> Any:
    """Rebuild a value out of JSON types, so the sandbox never sees rich objects' methods."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, (str, int, float)):
        return _scalar(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(item) for item in value]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):
        return _plain(value.model_dump())
    return f"<{type(value).__name__}>"


def _scalar(value: str | int | float) -> str | int | float:
    # Subclasses (str and int enums, numpy-like scalars) carry methods; strip to the base type.
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    return float.__float__(value)


def _tag_final_message(chat: list[dict[str, Any]]) -> str:
    final = chat[-1]
    content = final.get("content")
    if isinstance(content, list):
        for block in reversed(content):
            if isinstance(block, dict) and "text" in block:
                text = str(block["text"])
                block["text"] = text + _CONTINUE_TAG
                return text
    elif isinstance(content, str):
        final["content"] = content + _CONTINUE_TAG
        return content
    raise TokenizerError("continue_final_message is set but the last message has no text content")


def _cut_at_tag(rendered: str, final_text: str) -> str:
    tag = _CONTINUE_TAG.strip()
    if final_text.strip() not in rendered or tag not in rendered:
        raise TokenizerError(
            "continue_final_message is set but the template dropped part of the last message, "
            "so the text cannot end inside it"
        )
    at = rendered.rindex(tag)
    if rendered[at : at + len(_CONTINUE_TAG)] == _CONTINUE_TAG:
        return rendered[:at]
    return rendered[:at].rstrip()
