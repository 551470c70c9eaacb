"""LangChain messages and tools into the model's prompt.

Messages become the dicts chat templates read (transformers' shape: ``role``, ``content``,
``tool_calls`` with ``function.arguments`` as a dict, ``tool_call_id``). A template that renders
tools itself gets the tools and these messages; for one that does not, the documented fallback
of `dyngen_core.tools.fallback_messages` describes the tools in the system message and writes
calls and results as text.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from langchain_core.messages import (
    AIMessage,
    BaseMessage,
    ChatMessage,
    HumanMessage,
    SystemMessage,
    ToolMessage,
)
from langchain_core.utils.function_calling import convert_to_openai_tool

from dyngen_core.tools import ToolSpec, render_chat_prompt

# Content blocks a text-only model cannot take; other non-text blocks (tool_use, thinking,
# reasoning) are carried elsewhere in the message or have no place in the prompt.
_MEDIA_BLOCKS = frozenset({"image", "image_url", "audio", "input_audio", "video", "file"})


def _role(message: BaseMessage) -> str:
    if isinstance(message, SystemMessage):
        return "system"
    if isinstance(message, HumanMessage):
        return "user"
    if isinstance(message, AIMessage):
        return "assistant"
    if isinstance(message, ToolMessage):
        return "tool"
    if isinstance(message, ChatMessage):
        return message.role
    raise ValueError(f"dyngen chat models cannot take a {type(message).__name__} message")


def _text(message: BaseMessage) -> str:
    if isinstance(message.content, list):
        for block in message.content:
            if isinstance(block, Mapping) and block.get("type") in _MEDIA_BLOCKS:
                raise ValueError(
                    f"dyngen models are text-only; a message holds a {block['type']!r} block"
                )
    return message.text


def to_chat_dicts(messages: Sequence[BaseMessage]) -> list[dict[str, Any]]:
    """LangChain messages as chat-template message dicts."""
    out: list[dict[str, Any]] = []
    for message in messages:
        entry: dict[str, Any] = {"role": _role(message), "content": _text(message)}
        if isinstance(message, AIMessage) and message.tool_calls:
            entry["tool_calls"] = [
                {"id": call.get("id") or "", "type": "function",
                 "function": {"name": call["name"], "arguments": call["args"]}}
                for call in message.tool_calls
            ]
        if isinstance(message, ToolMessage):
            entry["tool_call_id"] = message.tool_call_id
            if message.name:
                entry["name"] = message.name
        out.append(entry)
    return out


def tool_specs(tools: Sequence[Any] | None) -> list[ToolSpec]:
    """Bound tools (OpenAI dicts, as `bind_tools` stores them, or anything
    `convert_to_openai_tool` reads) as `ToolSpec`s."""
    specs = []
    for tool in tools or ():
        if not (isinstance(tool, Mapping) and tool.get("type") == "function"):
            tool = convert_to_openai_tool(tool)
        specs.append(ToolSpec.from_dict(tool))
    return specs


def render_chat(
    tokenizer: Any, messages: Sequence[BaseMessage], tools: Sequence[ToolSpec],
    tool_choice: str,
) -> list[int]:
    """Prompt token ids for ``messages`` through the model's chat template.

    A template with tools support gets ``tools`` unless tool_choice is "none". The fallback
    prompt lists them under every tool_choice (its text does not depend on it), so the turns of
    an agent loop share the cached prompt prefix.
    """
    return render_chat_prompt(tokenizer, to_chat_dicts(messages), tools, tool_choice)
