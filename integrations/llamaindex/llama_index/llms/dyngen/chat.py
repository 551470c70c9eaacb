"""One chat turn: the prompt ids to submit, the constraint to decode under, and how to read
the reply back into a LlamaIndex `ChatResponse` (text, or text plus tool calls).

The prompt goes through the model's own chat template. A turn with tools is rendered,
constrained and parsed by `dyngen_core.tools` (shared with the LangChain adapter) through
`ToolTurn`; this module only adapts LlamaIndex objects to it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from llama_index.core.base.llms.generic_utils import (
    messages_to_prompt as generic_messages_to_prompt,
)
from llama_index.core.base.llms.types import ChatMessage, ChatResponse, MessageRole
from llama_index.llms.dyngen.messages import assistant_message, to_template_messages
from llama_index.llms.dyngen.tool_calling import ToolTurn

TOOL_KEYS = ("tools", "tool_choice", "tool_required", "allow_parallel_tool_calls")


@dataclass
class ChatTurn:
    """A prepared chat call. ``response`` is called once per streamed chunk (with the text so
    far) or once at the end; it keeps what it showed so that ``delta`` is the new content.
    ``decode_special_tokens``: the job writes special tokens into its text (the model's tool
    call markers are special tokens, `dyngen_core.tools.tool_markers_are_special`)."""

    input_ids: list[int]
    constraint: Any = None
    tools: ToolTurn | None = None
    decode_special_tokens: bool = False
    _shown: str = field(default="", repr=False)

    def response(
        self, text: str, *, delta: str | None = None, raw: Any = None, final: bool = True
    ) -> ChatResponse:
        """The assistant reply for generated ``text`` (all of it so far)."""
        if self.tools is None:
            message = ChatMessage(role=MessageRole.ASSISTANT, content=text)
            return ChatResponse(message=message, delta=delta, raw=raw)
        content, calls, invalid = self.tools.parse(text, final=final)
        message = assistant_message(content, calls)
        if invalid:
            message.additional_kwargs["invalid_tool_calls"] = [
                {"id": bad.id, "text": bad.text, "error": bad.error} for bad in invalid
            ]
        if delta is not None:
            # Stream the reply's prose, not the tool-call JSON the model writes.
            delta = _new_part(self._shown, content)
        self._shown = content
        return ChatResponse(message=message, delta=delta, raw=raw)


def prepare_turn(
    tokenizer: Any,
    messages: Sequence[ChatMessage],
    kwargs: dict[str, Any],
    messages_to_prompt: Callable[[Sequence[ChatMessage]], str] | None,
) -> ChatTurn:
    """Build the prompt for ``messages``; pops the tool keywords out of ``kwargs``.

    Without a chat template in the model folder, ``messages_to_prompt`` (LlamaIndex's generic
    one when None) renders the conversation as plain text (tools then need a template and are
    refused).
    """
    tool_args = {k: kwargs.pop(k) for k in TOOL_KEYS if k in kwargs}
    if not messages:
        raise ValueError("chat needs at least one message")
    chat = to_template_messages(messages)
    tools = ToolTurn.from_kwargs(tool_args)
    if tools is not None or _has_tool_traffic(chat):
        turn_tools = tools or ToolTurn.history_only()
        text = turn_tools.render(tokenizer, chat)
        ids = tokenizer.encode(text, encode_special_tokens=True)
        return ChatTurn(ids, constraint=turn_tools.constraint(), tools=tools,
                        decode_special_tokens=turn_tools.reads_special_markers(tokenizer))
    if tokenizer.has_chat_template:
        text = tokenizer.apply_chat_template(chat, add_generation_prompt=True)
        return ChatTurn(tokenizer.encode(text, encode_special_tokens=True))
    add_bos = bool(tokenizer.add_bos_token and tokenizer.bos_token_id is not None)
    render = messages_to_prompt or generic_messages_to_prompt
    return ChatTurn(tokenizer.encode(render(messages), add_bos=add_bos))


def _has_tool_traffic(chat: list[dict[str, Any]]) -> bool:
    # Earlier tool calls and results must be rendered the way tools are, even on a turn that
    # offers no tools, or a template without tool support would silently drop them.
    return any(m.get("tool_calls") or m["role"] == "tool" for m in chat)


def _new_part(shown: str, content: str) -> str:
    if content.startswith(shown):
        return content[len(shown):]
    # The final content is stripped of whitespace the stream already showed.
    return "" if shown.startswith(content) else content
