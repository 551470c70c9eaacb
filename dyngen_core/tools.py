"""Tool calling, framework-neutral: the public contract the LangChain and LlamaIndex adapters
build on, for any front end that offers tools to a model.

Tools are plain data: `ToolSpec` (name, description, JSON schema of the arguments), read from
OpenAI-style dicts with `ToolSpec.from_dict`. A front end converts its own tool and message
types to these dicts; nothing here imports torch or a framework.

Output format. A model calls tools by answering with a JSON list, and nothing else::

    [{"name": "get_weather", "arguments": {"city": "Paris"}}]

tool_choice. `normalize_tool_choice(tool_choice, tools)` maps what callers pass (None/"auto",
"none", "any"/"required"/True, a tool name, ``{"type": "function", "function": {"name": ...}}``)
to "auto", "none", "required" or a tool name, and raises ValueError for a name not among the
tools. `tool_choice_constraint(tools, choice, parallel=True, tool_format=None)` is the
``Job(constraint=...)`` that enforces it: "required" or a name forces calls matching the
tools' schemas, written in the model's own format (below; exactly one call for a name, or
unless ``parallel``; for "json", the call list of `tool_calls_schema`); "auto" steers
without forcing: text that does not start with ``[``, ``{``, a space or
```` ```json ````, or calls in the model's own format, or one fenced JSON call or call list;
"none" allows only such text; without tools it is None.

Formats. `tool_format_for(chat_template, tokenizer.piece_to_id)` reads the `ToolFormat` a
model's template teaches: "hermes" (``<tool_call>{...}</tool_call>``: Qwen2/2.5/3, Hermes),
"llama" (a bare ``{"name", "parameters"}`` object, maybe after ``<|python_tag|>``: Llama 3.x),
"mistral" (``[TOOL_CALLS] [...]``), "mistral_v11" (``[TOOL_CALLS]name[ARGS]{...}`` per call:
Mistral Small 3.x, Devstral) or "json" (the output format above: templates without tools,
SmolLM). Pass it to `tool_choice_constraint` and `ToolCallParser`. Where its markers are
special tokens (`tool_markers_are_special`), jobs must decode special tokens
(``Job(decode_special_tokens=True)``) for the parser to see them.

Prompt. When the model's chat template reads a ``tools`` variable (`template_supports_tools`),
pass it the tools (`ToolSpec.as_dict`) and HF-style messages. Otherwise
`fallback_messages(messages, tools, tool_choice)` rewrites the messages for a template that
knows nothing of tools: a system message lists the tools and the output format
(`render_tools_prompt`), past calls are written in that format (`format_tool_calls`), and tool
results become user messages. `inline_refs` inlines a schema's local ``$ref``s (recursive
schemas raise ValueError).

Reading calls. `ToolCallParser(tool_names=None, tool_format=None)` reads calls out of output
as it streams: `push(text)` and `finish()` each return a `ToolStreamDelta` (``content`` to show,
completed ``calls`` as `ToolCall` with name, arguments and id, and ``invalid`` as
`InvalidToolCall`); `parse_tool_calls(text, tool_names=None, tool_format=None)` reads a whole
output. It reads the output format, a single ``{"name", "arguments"|"parameters"}`` object, a
fenced JSON call or call list that is the whole message (with ``tool_names`` given), and the
format's marked calls (``<tool_call>`` blocks, ``<|python_tag|>``, ``[TOOL_CALLS]``; all three
when the format is "json" or None; ``[TOOL_CALLS]name[ARGS]{...}`` calls back to back in
"mistral_v11"), keeping the text around them as content. With
``tool_names``, a bare or fenced call counts only when it names a bound tool: text that shows
a call of something else stays content. `new_call_id` makes a call id; `call_dict` reads an
OpenAI-, LangChain- or plain-style call into ``{"name", "arguments"}``.
"""

from __future__ import annotations

from dyngen_core.text.tools import (
    InvalidToolCall,
    ToolCall,
    ToolCallParser,
    ToolFormat,
    ToolSpec,
    ToolStreamDelta,
    call_dict,
    fallback_messages,
    format_tool_calls,
    inline_refs,
    new_call_id,
    normalize_tool_choice,
    parse_tool_calls,
    render_chat_prompt,
    render_tools_prompt,
    template_supports_tools,
    tool_calls_schema,
    tool_choice_constraint,
    tool_format_for,
    tool_markers_are_special,
)

__all__ = [
    "InvalidToolCall",
    "ToolCall",
    "ToolCallParser",
    "ToolFormat",
    "ToolSpec",
    "ToolStreamDelta",
    "call_dict",
    "fallback_messages",
    "format_tool_calls",
    "inline_refs",
    "new_call_id",
    "normalize_tool_choice",
    "parse_tool_calls",
    "render_chat_prompt",
    "render_tools_prompt",
    "template_supports_tools",
    "tool_calls_schema",
    "tool_choice_constraint",
    "tool_format_for",
    "tool_markers_are_special",
]
