"""The tool-call text format: tools into the prompt, the schema of a call, output into calls.

Calls are written the Hermes / Qwen way, which chat templates with native tool support expect:
``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`` (one block per call; a block
holding a JSON list of calls is read too). A template that references ``tools`` renders them
itself; for one that does not (e.g. plain ChatML), the tools and this format are described in
the system message, earlier calls are written into the assistant's text, and tool results go
back as ``<tool_response>`` user turns.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

from llama_index.core.llms.utils import parse_partial_json

CALL_OPEN = "<tool_call>\n"
CALL_CLOSE = "\n</tool_call>"
_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)

_FALLBACK_SYSTEM = (
    "You can call these tools (JSON schemas):\n<tools>\n{tools}\n</tools>\n"
    "To call a tool, reply with one block per call:\n"
    '<tool_call>\n{{"name": "<tool name>", "arguments": <arguments as a JSON object>}}\n'
    "</tool_call>\nTool results come back inside <tool_response></tool_response>. "
    "When you have what you need, answer in plain text."
)


def native_tools(tokenizer: Any) -> bool:
    """Whether the model's chat template renders tools itself."""
    template = tokenizer.chat_template or ""
    return re.search(r"\btools\b", template) is not None


def render(tokenizer: Any, chat: list[dict[str, Any]], schemas: Sequence[dict[str, Any]]) -> str:
    """Prompt text for ``chat`` offering ``schemas`` (none: only replay earlier tool traffic)."""
    if not tokenizer.has_chat_template:
        raise ValueError(
            "tool calling needs a chat template, and this model folder has none; add "
            "chat_template to tokenizer_config.json"
        )
    if native_tools(tokenizer):
        return str(tokenizer.apply_chat_template(
            chat, add_generation_prompt=True, tools=list(schemas) or None))
    return str(tokenizer.apply_chat_template(
        _describe_tools(_inline_tool_traffic(chat), schemas), add_generation_prompt=True))


def _describe_tools(
    chat: list[dict[str, Any]], schemas: Sequence[dict[str, Any]]
) -> list[dict[str, Any]]:
    if not schemas:
        return chat
    text = _FALLBACK_SYSTEM.format(tools="\n".join(json.dumps(s) for s in schemas))
    if chat and chat[0]["role"] == "system":
        return [{**chat[0], "content": f"{chat[0]['content']}\n\n{text}"}, *chat[1:]]
    return [{"role": "system", "content": text}, *chat]


def _inline_tool_traffic(chat: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for message in chat:
        if message["role"] == "tool":
            block = f"<tool_response>\n{message['content']}\n</tool_response>"
            if out and out[-1].get("_tool_results"):
                out[-1] = {**out[-1], "content": f"{out[-1]['content']}\n{block}"}
            else:
                out.append({"role": "user", "content": block, "_tool_results": True})
            continue
        plain = {k: v for k, v in message.items() if k not in ("tool_calls", "tool_call_id")}
        calls = message.get("tool_calls") or []
        if calls:
            written = "\n".join(format_call(c) for c in calls)
            plain["content"] = f"{message['content']}\n{written}".lstrip("\n")
        out.append(plain)
    return [{k: v for k, v in m.items() if k != "_tool_results"} for m in out]


def format_call(call: dict[str, Any]) -> str:
    """One OpenAI-form call written as a ``<tool_call>`` block."""
    function = call["function"]
    body = {"name": function["name"], "arguments": function.get("arguments") or {}}
    return f"{CALL_OPEN}{json.dumps(body)}{CALL_CLOSE}"


def calls_schema(schemas: Sequence[dict[str, Any]], parallel: bool) -> dict[str, Any]:
    """JSON schema of one call to any of ``schemas`` (a non-empty list of calls if parallel)."""
    options = [
        {
            "type": "object",
            "properties": {
                "name": {"const": s["function"]["name"]},
                "arguments": s["function"].get("parameters") or {"type": "object"},
            },
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for s in schemas
    ]
    one = options[0] if len(options) == 1 else {"anyOf": options}
    return {"type": "array", "items": one, "minItems": 1} if parallel else one


def parse(text: str, *, partial: bool = False) -> tuple[str, list[dict[str, Any]]]:
    """(prose, OpenAI-form calls) in model output.

    partial: the text is a stream's prefix; an unfinished last call comes back with what its
    arguments hold so far (and no call at all while its name is still being written).
    """
    calls: list[dict[str, Any]] = []
    for match in _BLOCK.finditer(text):
        closed = match.group(0).rstrip().endswith("</tool_call>")
        calls.extend(_calls_in(match.group(1), lenient=partial and not closed))
    prose = _BLOCK.sub("", text).strip() if calls or "<tool_call>" in text else text
    if not calls and "<tool_call>" not in text:
        bare = _calls_in(text.strip(), lenient=False) if text.strip().startswith("{") else []
        if bare:
            return "", bare
    return prose, calls


def _calls_in(body: str, lenient: bool) -> list[dict[str, Any]]:
    if lenient and '"arguments"' not in body:
        return []  # the name may still be half written
    try:
        value = parse_partial_json(body) if lenient else json.loads(body)
    except (ValueError, TypeError):
        return []
    items = value if isinstance(value, list) else [value]
    calls = []
    for item in items:
        if isinstance(item, dict) and isinstance(item.get("name"), str):
            arguments = item.get("arguments", item.get("parameters", {}))
            if isinstance(arguments, str):
                try:
                    arguments = json.loads(arguments)
                except json.JSONDecodeError:
                    arguments = {}
            calls.append({"id": item.get("id"), "type": "function",
                          "function": {"name": item["name"],
                                       "arguments": arguments if isinstance(arguments, dict)
                                       else {}}})
    return calls
