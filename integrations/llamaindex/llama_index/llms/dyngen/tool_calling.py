"""Tool calling for LlamaIndex: tools to schemas, tool_choice to a `ToolTurn`, replies to
`ToolSelection`s.

`ToolTurn` is the one place that talks to the engine's tool support (rendering tools into the
prompt, the constraint that enforces a required call, parsing the output into calls); the rest
of this module is LlamaIndex glue.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from llama_index.core.base.llms.types import ChatMessage, ChatResponse, MessageRole
from llama_index.core.llms.llm import ToolSelection
from llama_index.llms.dyngen.messages import assistant_message, tool_calls_of

from dyngen_core.tools import (
    ToolCallParser,
    ToolFormat,
    ToolSpec,
    fallback_messages,
    normalize_tool_choice,
    template_supports_tools,
    tool_choice_constraint,
    tool_format_for,
    tool_markers_are_special,
)

if TYPE_CHECKING:
    from llama_index.core.tools.types import BaseTool


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


def resolve_tool_choice(choice: str | dict[str, Any] | None, required: bool) -> Any:
    """LlamaIndex's tool_required folded into tool_choice (which wins when it names a tool or
    says "none"); `dyngen_core.tools.normalize_tool_choice` reads the result."""
    if required and (choice is None or choice == "auto"):
        return "required"
    return choice


class ToolTurn:
    """A chat turn that offers tools (or replays earlier tool traffic without offering any).

    Rendering, the forcing constraint and the output format are `dyngen_core.tools`', shared
    with the LangChain adapter. One `ToolTurn` serves one reply: when streamed, it reads the
    reply incrementally, so each call keeps one id across the partial responses.

    tools: tool schemas (OpenAI form). choice: any tool_choice `normalize_tool_choice` reads.
    parallel: whether one reply may hold several calls.
    """

    def __init__(self, tools: Sequence[dict[str, Any]], choice: Any = "auto",
                 parallel: bool = False) -> None:
        self.specs = [ToolSpec.from_dict(t) for t in tools]
        self.choice = normalize_tool_choice(choice, self.specs)
        self.parallel = parallel
        self.tool_format = ToolFormat()
        self._parser = self._new_parser()
        self._fed = 0
        self._content = ""

    @classmethod
    def from_kwargs(cls, args: dict[str, Any]) -> ToolTurn | None:
        """From chat's tool keywords (tools, tool_choice, tool_required, parallel flag);
        None when no tools are offered."""
        tools = args.get("tools")
        if not tools:
            return None
        schemas = [t if isinstance(t, dict) else tool_schema(t) for t in tools]
        choice = resolve_tool_choice(args.get("tool_choice"), bool(args.get("tool_required")))
        return cls(schemas, choice, bool(args.get("allow_parallel_tool_calls", False)))

    def _new_parser(self) -> ToolCallParser:
        """A parser for this turn's reply: calls of the bound tools, in the model's format."""
        return ToolCallParser([spec.name for spec in self.specs] or None, self.tool_format)

    @classmethod
    def history_only(cls) -> ToolTurn:
        return cls([], "none")

    def render(self, tokenizer: Any, chat: list[dict[str, Any]]) -> str:
        """The prompt text: through the template when it handles tools, else the fallback.
        The template also sets the call format the reply is read in and steered to
        (`dyngen_core.tools.tool_format_for`).

        The tools are listed whatever tool_choice is ("none" is enforced by the constraint),
        so the turns of an agent loop keep one prompt prefix, shared in the cache.
        """
        if not tokenizer.has_chat_template:
            raise ValueError(
                "tool calling needs a chat template, and this model folder has none; add "
                "chat_template to tokenizer_config.json"
            )
        self.tool_format = tool_format_for(tokenizer.chat_template, tokenizer.piece_to_id)
        self._parser = self._new_parser()
        if template_supports_tools(tokenizer.chat_template):
            tools = [spec.as_dict() for spec in self.specs] or None
            return str(tokenizer.apply_chat_template(chat, add_generation_prompt=True,
                                                     tools=tools))
        messages = fallback_messages(chat, self.specs, "auto" if self.specs else "none")
        return str(tokenizer.apply_chat_template(messages, add_generation_prompt=True))

    def reads_special_markers(self, tokenizer: Any) -> bool:
        """Whether the reply must be decoded with special tokens: calls are read, and the
        model's call markers are special tokens (`tool_markers_are_special`)."""
        return bool(self.specs) and self.choice != "none" and \
            tool_markers_are_special(tokenizer, self.tool_format)

    def constraint(self) -> Any:
        """What enforces tool_choice (`dyngen_core.tools.tool_choice_constraint`): a forced
        choice gets calls only, in the model's own format; "auto" a grammar allowing calls or
        plain text, so a call the model makes always matches its tool's schema; "none" text
        only."""
        return tool_choice_constraint(self.specs, self.choice, parallel=self.parallel,
                                      tool_format=self.tool_format)

    def parse(self, text: str, *, final: bool) -> tuple[str, list[dict[str, Any]], list[Any]]:
        """(content, OpenAI-form calls, invalid calls) of the reply so far (``text`` is all of
        it). A call appears once its JSON is complete; held text is released at the end."""
        if self.choice == "none":
            return text, [], []
        delta = self._parser.push(text[self._fed:])
        self._fed = len(text)
        self._content += delta.content
        if final:
            self._content += self._parser.finish().content
        calls = [{"id": c.id, "type": "function",
                  "function": {"name": c.name, "arguments": c.arguments}}
                 for c in self._parser.calls]
        return self._content.strip() if final else self._content, calls, self._parser.invalid


def tool_selections(response: ChatResponse, error_on_no_tool_call: bool) -> list[ToolSelection]:
    """`ToolSelection`s from a (possibly partial, streamed) response's tool calls."""
    calls = tool_calls_of(response.message)
    if not calls and error_on_no_tool_call:
        invalid = response.message.additional_kwargs.get("invalid_tool_calls")
        if invalid:
            raise ValueError(
                f"the model's tool call could not be read: {invalid[0]['error']}; "
                f"its output: {invalid[0]['text'][:200]!r}"
            )
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
