"""LlamaIndex `ChatMessage` objects to the plain dicts a chat template reads, and back.

Chat templates (and `dyngen_core.tools`) speak the OpenAI / transformers message shape:
``{"role", "content", "tool_calls": [{"id", "type": "function", "function": {"name",
"arguments"}}], "tool_call_id"}``. LlamaIndex keeps tool calls as `ToolCallBlock`s (newer
agents) or in ``additional_kwargs["tool_calls"]`` (older integrations); both are read here.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from llama_index.core.base.llms.types import (
    ChatMessage,
    MessageRole,
    TextBlock,
    ThinkingBlock,
    ToolCallBlock,
)

# Provider-specific roles LlamaIndex defines, folded into the three a template knows.
_ROLE_ALIASES = {
    MessageRole.DEVELOPER.value: "system",
    MessageRole.CHATBOT.value: "assistant",
    MessageRole.MODEL.value: "assistant",
    MessageRole.FUNCTION.value: "tool",
}


def to_template_messages(messages: Sequence[ChatMessage]) -> list[dict[str, Any]]:
    """Convert a conversation to template dicts (text only; images and audio are refused).

    A tool result that names only its call id gets the tool's name from that call, since
    templates and the tools fallback show results by tool name.
    """
    out = [_to_template_message(message) for message in messages]
    names = {c["id"]: c["function"]["name"] for m in out for c in m.get("tool_calls", [])}
    for message in out:
        if message["role"] == "tool" and "name" not in message:
            name = names.get(message.get("tool_call_id"))
            if name is not None:
                message["name"] = name
    return out


def _to_template_message(message: ChatMessage) -> dict[str, Any]:
    role = _ROLE_ALIASES.get(message.role.value, message.role.value)
    out: dict[str, Any] = {"role": role, "content": _text_of(message)}
    calls = tool_calls_of(message)
    if calls:
        out["tool_calls"] = calls
    call_id = message.additional_kwargs.get("tool_call_id")
    if call_id is not None:
        out["tool_call_id"] = str(call_id)
    name = message.additional_kwargs.get("name")
    if name is not None:
        out["name"] = str(name)
    return out


def _text_of(message: ChatMessage) -> str:
    parts: list[str] = []
    for block in message.blocks:
        if isinstance(block, TextBlock):
            parts.append(block.text)
        elif isinstance(block, (ToolCallBlock, ThinkingBlock)):
            continue  # tool calls travel in "tool_calls"; past reasoning is not replayed
        else:
            raise ValueError(
                f"DynGenLLM handles text only, but a {message.role.value} message holds a "
                f"{type(block).__name__}; convert it to text before sending it"
            )
    return "".join(parts)


def tool_calls_of(message: ChatMessage) -> list[dict[str, Any]]:
    """The tool calls an assistant message made, in OpenAI form with dict arguments."""
    calls = [
        _openai_call(block.tool_call_id, block.tool_name, block.tool_kwargs)
        for block in message.blocks
        if isinstance(block, ToolCallBlock)
    ]
    if calls:
        return calls
    for raw in message.additional_kwargs.get("tool_calls") or []:
        # Dicts (OpenAI JSON) or objects (OpenAI SDK types) from other integrations' histories.
        function = _field(raw, "function") or raw
        calls.append(_openai_call(
            _field(raw, "id"), _field(function, "name"), _field(function, "arguments")))
    return calls


def _field(value: Any, name: str) -> Any:
    return value.get(name) if isinstance(value, dict) else getattr(value, name, None)


def _openai_call(call_id: Any, name: Any, arguments: Any) -> dict[str, Any]:
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError:
            arguments = {"input": arguments}
    return {
        "id": None if call_id is None else str(call_id),
        "type": "function",
        "function": {"name": str(name), "arguments": dict(arguments or {})},
    }


def assistant_message(text: str, calls: Sequence[dict[str, Any]]) -> ChatMessage:
    """An assistant `ChatMessage` holding ``text`` and ``calls`` (OpenAI-form tool calls).

    Calls become `ToolCallBlock`s (what current LlamaIndex agents read) and are mirrored in
    ``additional_kwargs["tool_calls"]`` for code written against older integrations.
    """
    blocks: list[Any] = [TextBlock(text=text)] if text or not calls else []
    for call in calls:
        function = call["function"]
        blocks.append(
            ToolCallBlock(
                tool_call_id=call.get("id"),
                tool_name=function["name"],
                tool_kwargs=function.get("arguments") or {},
            )
        )
    extra = {"tool_calls": [dict(call) for call in calls]} if calls else {}
    return ChatMessage(role=MessageRole.ASSISTANT, blocks=blocks, additional_kwargs=extra)
