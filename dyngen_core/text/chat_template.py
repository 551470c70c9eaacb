"""Rendering a model's jinja2 chat template the way Hugging Face transformers does.

The template runs in the limited sandbox of `template_sandbox` (untrusted code, bounded in time
and size by `TemplateLimits`). What it sees matches transformers: messages with None-valued keys
dropped, reasoning under each of its names, the special tokens (``bos_token``, ``eos_token``,
...), ``tools`` as JSON schemas, ``documents``, ``add_generation_prompt`` and any extra keyword,
all rebuilt from plain JSON types. Pure Python: no torch.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import jinja2

from dyngen_core.errors import TokenizerError
from dyngen_core.text.template_sandbox import LimitedTemplate, TemplateLimits

_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "
# Names a message's reasoning may travel under; templates read the first (and gpt-oss `thinking`).
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


class ChatTemplate:
    """One compiled chat template.

    source: the jinja2 template text.
    special_tokens: names the template may read, e.g. ``{"bos_token": "<s>", ...}``; keyword
        arguments given at render time override them.
    limits: how long one render may run and how much text it may produce.
    """

    def __init__(self, source: str, special_tokens: Mapping[str, str] | None = None,
                 limits: TemplateLimits | None = None) -> None:
        self.source = source
        self.special_tokens = dict(special_tokens or {})
        self.limits = limits or TemplateLimits()
        fix = "fix chat_template in tokenizer_config.json or pass chat_template=... explicitly"
        try:
            self._template = LimitedTemplate(source, self.limits)
        except jinja2.TemplateSyntaxError as exc:
            raise TokenizerError(
                f"the chat template does not compile (line {exc.lineno}: {exc.message}); {fix}"
            ) from exc
        except Exception as exc:  # deep nesting (RecursionError), a compiler limit
            raise TokenizerError(
                f"the chat template does not compile ({type(exc).__name__}: {exc}); {fix}"
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
        text = self._template.render({
            "messages": chat,
            "tools": _tool_schemas(tools),
            "documents": _documents(documents),
            "add_generation_prompt": add_generation_prompt,
            **context,
        })
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
