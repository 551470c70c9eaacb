"""Tool calling for LlamaIndex: tools to schemas, tool_choice to a `ToolTurn`, replies to
`ToolSelection`s.

`ToolTurn` is the one place that talks to the engine's tool support (rendering tools into the
prompt, the constraint that enforces a required call, parsing the output into calls); the rest
of this module is LlamaIndex glue.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from llama_index.core.base.llms.types import ChatMessage, ChatResponse, MessageRole
from llama_index.core.llms.llm import ToolSelection

from llama_index.llms.dyngen import tool_format
from llama_index.llms.dyngen.messages import assistant_message, tool_calls_of

if TYPE_CHECKING:
    from llama_index.core.tools.types import BaseTool

# tool_choice values LlamaIndex integrations accept for "must call some tool".
_REQUIRED_WORDS = frozenset({"required", "any"})


def tool_schema(tool: BaseTool) -> dict[str, Any]:
    """The OpenAI-form schema of a LlamaIndex tool, under the tool's own name (agents look
    tools up by ``metadata.name``, so it must come back unchanged)."""
    schema = tool.metadata.to_openai_tool(skip_length_check=True)
    schema["function"]["name"] = tool.metadata.name
    return schema


def prepare_tools_kwargs(
    tools: Sequence[BaseTool],
    user_msg: str | ChatMessage | None,
    chat_history: Sequence[ChatMessage] | None,
    *,
    allow_parallel_tool_calls: bool,
    tool_required: bool,
    tool_choice: str | dict[str, Any] | None,
    extra: dict[str, Any],
) -> dict[str, Any]:
    """The keyword arguments `DynGenLLM.chat` takes for a turn offering ``tools``."""
    messages = list(chat_history or [])
    if isinstance(user_msg, str):
        messages.append(ChatMessage(role=MessageRole.USER, content=user_msg))
    elif user_msg is not None:
        messages.append(user_msg)
    return {
        "messages": messages,
        "tools": [tool_schema(tool) for tool in tools],
        "tool_choice": resolve_tool_choice(tool_choice, tool_required),
        "allow_parallel_tool_calls": allow_parallel_tool_calls,
        **extra,
    }


def resolve_tool_choice(choice: str | dict[str, Any] | None, required: bool) -> str:
    """One word for what the turn allows: "auto", "none", "required", or a tool's name.

    Accepts LlamaIndex's and OpenAI's spellings: "any"/"required", or
    ``{"type": "function", "function": {"name": ...}}``.
    """
    if isinstance(choice, dict):
        name = (choice.get("function") or {}).get("name") or choice.get("name")
        if not name:
            raise ValueError(f"tool_choice {choice!r} names no tool; expected "
                             "{'type': 'function', 'function': {'name': ...}}")
        return str(name)
    if choice is None or choice == "auto":
        return "required" if required else "auto"
    if choice in _REQUIRED_WORDS:
        return "required"
    return str(choice)


@dataclass
class ToolTurn:
    """A chat turn that offers tools (or replays earlier tool traffic without offering any).

    schemas: OpenAI-form tool schemas. choice: "auto", "none", "required" or a tool name.
    parallel: whether one reply may hold several calls.
    """

    schemas: list[dict[str, Any]]
    choice: str = "auto"
    parallel: bool = False
    turn_id: str = field(default_factory=lambda: uuid.uuid4().hex[:12])

    @classmethod
    def from_kwargs(cls, args: dict[str, Any]) -> ToolTurn | None:
        """From chat's tool keywords (tools, tool_choice, tool_required, parallel flag)."""
        tools = args.get("tools")
        if not tools:
            return None
        schemas = [t if isinstance(t, dict) else tool_schema(t) for t in tools]
        choice = resolve_tool_choice(args.get("tool_choice"), bool(args.get("tool_required")))
        names = {s["function"]["name"] for s in schemas}
        if choice not in ("auto", "none", "required") and choice not in names:
            raise ValueError(f"tool_choice {choice!r} is not one of the tools {sorted(names)}")
        return cls(schemas, choice, bool(args.get("allow_parallel_tool_calls", False)))

    @classmethod
    def history_only(cls) -> ToolTurn:
        return cls([], "none")

    @property
    def forced(self) -> bool:
        return self.choice not in ("auto", "none")

    def _offered(self) -> list[dict[str, Any]]:
        if self.choice in ("auto", "none", "required"):
            return self.schemas
        return [s for s in self.schemas if s["function"]["name"] == self.choice]

    def render(self, tokenizer: Any, chat: list[dict[str, Any]]) -> str:
        """The prompt text; a forced call also gets the call's opening written for the model."""
        text = tool_format.render(tokenizer, chat, self.schemas if self.choice != "none" else [])
        return text + tool_format.CALL_OPEN if self.forced else text

    def constraint(self, tokenizer: Any) -> Any:
        """The constraint for the reply: the schema of a call (or a list of calls) when one is
        required, else None (free text that may or may not contain calls)."""
        if not self.forced:
            return None
        return tool_format.calls_schema(self._offered(), self.parallel)

    def parse(self, text: str, *, final: bool) -> tuple[str, list[dict[str, Any]]]:
        """(prose, OpenAI-form calls) in ``text``; a partial call yields its arguments so far."""
        if self.choice == "none":
            return text, []
        if self.forced:
            text = tool_format.CALL_OPEN + text
        prose, calls = tool_format.parse(text, partial=not final)
        return prose, [_with_id(call, self.turn_id, i) for i, call in enumerate(calls)]


def _with_id(call: dict[str, Any], turn_id: str, index: int) -> dict[str, Any]:
    # Stable per position within a turn, so the partial responses of one stream name a call
    # the same way; unique across turns, so results pair with the right call in memory.
    return call if call.get("id") else {**call, "id": f"call_{turn_id}_{index}"}


def tool_selections(response: ChatResponse, error_on_no_tool_call: bool) -> list[ToolSelection]:
    """`ToolSelection`s from a (possibly partial, streamed) response's tool calls."""
    calls = tool_calls_of(response.message)
    if not calls and error_on_no_tool_call:
        raise ValueError(
            f"expected at least one tool call in the response, got none; the model replied: "
            f"{(response.message.content or '')[:200]!r} (pass tool_required=True to enforce one)"
        )
    return [
        ToolSelection(
            tool_id=call["id"] or f"call_{i}",
            tool_name=call["function"]["name"],
            tool_kwargs=call["function"]["arguments"],
        )
        for i, call in enumerate(calls)
    ]


def validate_tool_response(response: ChatResponse, allow_parallel: bool) -> ChatResponse:
    """Keep only the first call when parallel calls were not allowed."""
    calls = tool_calls_of(response.message)
    if allow_parallel or len(calls) <= 1:
        return response
    message = assistant_message(response.message.content or "", calls[:1])
    return ChatResponse(message=message, delta=response.delta, raw=response.raw,
                        additional_kwargs=response.additional_kwargs)
