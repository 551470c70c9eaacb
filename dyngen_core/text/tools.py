"""Tool calling for every front end: tool specs, tool_choice, the prompt, the output format and
the constraint that forces calls. The models' own call formats live in
`dyngen_core.text.tool_formats`, the parser that reads calls out of model output (whole or
streamed) in `dyngen_core.text.tool_parser`; both are re-exported here.

Framework-neutral and pure Python (no torch, no LangChain, no LlamaIndex): the adapters convert
their own tool and message types to the plain dicts used here.

Output format. A model calls tools by answering with a JSON list, and nothing else::

    [{"name": "get_weather", "arguments": {"city": "Paris"}}]

This is what `tool_calls_schema` enforces by constrained decoding (tool_choice "required" or a
tool name) and what `fallback_messages` writes for past calls. Models trained on native tool
templates write calls their own way (`ToolFormat`, read from the template by `tool_format_for`):
the parser reads those formats, and the "auto" constraint steers into the model's own.

Templates. When a model's chat template handles ``tools`` (it reads a ``tools`` variable), the
adapters pass the tools and HF-style messages to it. Otherwise `fallback_messages` is the
documented fallback: a system message lists the tools and the format above, past calls are
written in that format, and tool results become user messages.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from dyngen_core.errors import JobError
from dyngen_core.text.constraints import Constraint
from dyngen_core.text.tokenizer import Tokenizer
from dyngen_core.text.tool_formats import ToolFormat, tool_format_for
from dyngen_core.text.tool_parser import (
    InvalidToolCall,
    ToolCall,
    ToolCallParser,
    ToolStreamDelta,
    call_dict,
    new_call_id,
    parse_tool_calls,
)

_TOOLS_VARIABLE = re.compile(r"\btools\b")


@dataclass(frozen=True)
class ToolSpec:
    """A tool the model may call: its name, what it does, and the JSON schema of its arguments
    (an object schema)."""

    name: str
    description: str = ""
    parameters: Mapping[str, Any] = field(default_factory=lambda: {"type": "object"})

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise JobError(f"a tool needs a non-empty string name; got {self.name!r}")
        if not isinstance(self.parameters, Mapping):
            raise JobError(f"the parameters of tool {self.name!r} must be a JSON schema object "
                           f"(a dict); got {type(self.parameters).__name__}")
        try:
            json.dumps(self.parameters)
        except (TypeError, ValueError, RecursionError) as exc:
            raise JobError(f"the parameters schema of tool {self.name!r} cannot be written as "
                           f"JSON ({exc}); pass a tree of plain dicts, lists, strings, numbers, "
                           "booleans and None") from None

    @classmethod
    def from_dict(cls, tool: Mapping[str, Any]) -> ToolSpec:
        """Read an OpenAI-style tool: ``{"type": "function", "function": {...}}`` or the bare
        ``{"name", "description", "parameters"}`` function dict."""
        function = tool.get("function", tool) if isinstance(tool, Mapping) else None
        if not isinstance(function, Mapping):
            raise JobError("a tool must be a dict with a 'name' (and 'description', "
                           "'parameters'), or one under 'function' (OpenAI style); got "
                           f"{tool!r:.200}")
        name = function.get("name")
        if not isinstance(name, str) or not name:
            raise JobError(f"a tool needs a non-empty 'name'; got {dict(tool)!r}")
        parameters = function.get("parameters") or {"type": "object", "properties": {}}
        return cls(name, str(function.get("description") or ""), parameters)

    def as_dict(self) -> dict[str, Any]:
        """The ``{"type": "function", "function": {...}}`` form chat templates expect."""
        return {"type": "function", "function": {
            "name": self.name, "description": self.description,
            "parameters": dict(self.parameters)}}


# ---- tool choice -----------------------------------------------------------------------------


def normalize_tool_choice(tool_choice: Any, tools: Sequence[ToolSpec]) -> str:
    """Map a tool_choice to "auto", "none", "required" or the name of one of ``tools``.

    Accepted: None/"auto", "none", "any"/"required"/True, a tool name, or
    ``{"type": "function", "function": {"name": ...}}`` / ``{"name": ...}``.
    """
    if isinstance(tool_choice, Mapping):
        function = tool_choice.get("function", tool_choice)
        if not isinstance(function, Mapping):
            raise JobError(f"tool_choice={tool_choice!r}: 'function' must be a dict with a "
                           "'name'")
        tool_choice = function.get("name")
    if tool_choice is None or tool_choice == "auto":
        return "auto"
    if tool_choice is False or tool_choice == "none":
        return "none"
    if tool_choice is True or tool_choice in ("any", "required"):
        if not tools:
            raise JobError(f"tool_choice={tool_choice!r} needs at least one tool")
        return "required"
    names = [t.name for t in tools]
    if not isinstance(tool_choice, str) or tool_choice not in names:
        raise JobError(
            f"tool_choice={tool_choice!r} is not one of the bound tools {names}; pass a tool "
            "name, 'auto', 'none', 'any' or 'required'"
        )
    return str(tool_choice)


# ---- prompt and history (the fallback for templates without tools support) -------------------


def template_supports_tools(template: str | None) -> bool:
    """Whether a chat template renders tools itself (it reads the ``tools`` variable)."""
    return bool(template) and bool(_TOOLS_VARIABLE.search(template or ""))


def render_tools_prompt(tools: Sequence[ToolSpec]) -> str:
    """The system text that tells a model without native tool support how to call ``tools``.

    It does not depend on tool_choice (constrained decoding enforces forced calls, and calls
    are not read under "none"), so the turns of an agent loop that change tool_choice share the
    whole prompt prefix in the cache.
    """
    listing = "\n".join(
        json.dumps({"name": t.name, "description": t.description,
                    "parameters": t.parameters}, ensure_ascii=False)
        for t in tools
    )
    return (
        f"You can call these tools:\n{listing}\n\n"
        "To call tools, answer with only a JSON list of calls, for example:\n"
        '[{"name": "tool_name", "arguments": {"argument": "value"}}]\n'
        "The results come back in the next message. If a tool helps, call it; otherwise "
        "answer normally."
    )


def format_tool_calls(calls: Sequence[Mapping[str, Any]]) -> str:
    """Calls (dicts with ``name`` and ``arguments``) written in the output format."""
    try:
        return json.dumps([{"name": c["name"], "arguments": c.get("arguments") or {}}
                           for c in calls], ensure_ascii=False)
    except (KeyError, TypeError, ValueError, RecursionError) as exc:
        raise JobError(f"tool calls must be dicts with a 'name' and JSON 'arguments' ({exc!r}); "
                       f"got {list(calls)!r:.200}") from None


def fallback_messages(
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[ToolSpec] = (),
    tool_choice: str = "auto",
) -> list[dict[str, Any]]:
    """Rewrite HF-style chat messages for a template that knows nothing of tools.

    An assistant message's ``tool_calls`` (``[{"id", "function": {"name", "arguments"}}]``) are
    appended to its content in the output format; consecutive ``tool`` messages become one user
    message listing each result; with ``tools`` the tools prompt (`render_tools_prompt`) is
    added to the first system message, or becomes one.

    tool_choice: "none" leaves the tools out. Any other value lists them, in the same words
    whatever the choice; an agent loop that lists them under "none" too (its reply constrained
    by `tool_choice_constraint`) keeps one prompt prefix, cached, across its turns.
    """
    out: list[dict[str, Any]] = []
    for message in messages:
        if not isinstance(message, Mapping):
            raise JobError(f"a chat message must be a dict with 'role' and 'content'; got "
                           f"{message!r}")
        role = message.get("role")
        if role == "tool":
            line = f"Result of tool call {message.get('tool_call_id') or ''} " \
                   f"({message.get('name') or 'tool'}): {message.get('content') or ''}"
            if out and out[-1].get("_tool_results"):
                out[-1]["content"] += "\n" + line
            else:
                out.append({"role": "user", "content": line, "_tool_results": True})
            continue
        plain = {k: v for k, v in message.items() if k not in ("tool_calls", "tool_call_id")}
        calls = message.get("tool_calls") or []
        if calls:
            written = format_tool_calls([call_dict(c) for c in calls])
            text = plain.get("content") or ""
            plain["content"] = f"{text}\n{written}" if text else written
        out.append(plain)
    for message in out:
        message.pop("_tool_results", None)
    if tools and tool_choice != "none":
        prompt = render_tools_prompt(tools)
        if out and out[0].get("role") == "system":
            out[0] = {**out[0], "content": f"{out[0].get('content') or ''}\n\n{prompt}".strip()}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out


# ---- the constraint ----------------------------------------------------------------------------


def tool_calls_schema(
    tools: Sequence[ToolSpec], tool_choice: str, parallel: bool = True
) -> dict[str, Any] | None:
    """The JSON schema that forces a tool call, or None when nothing is forced.

    tool_choice "required": a list of one or more calls of any of ``tools`` (exactly one unless
    ``parallel``); a tool name: exactly one call of that tool; "auto"/"none": None. Argument
    schemas are embedded as they are, their local ``$ref``s (``#/$defs/X``, ``#`` ...) pointed
    at where they now sit, so the schema grows linearly with the tools' schemas, and recursive
    ones work. Where an argument schema leaves it open, it allows no extra keys.
    """
    if tool_choice in ("auto", "none"):
        return None
    chosen = [t for t in tools if tool_choice == "required" or t.name == tool_choice]
    if len(chosen) == 1:
        items: dict[str, Any] = _call_schema(chosen[0], "/items")
    else:
        items = {"anyOf": [_call_schema(t, f"/items/anyOf/{i}") for i, t in enumerate(chosen)]}
    schema: dict[str, Any] = {"type": "array", "items": items, "minItems": 1}
    if not parallel or tool_choice != "required":
        schema["maxItems"] = 1
    return schema


# "none": only text that does not start like a JSON call.
_TEXT_ONLY = r"[^\[{\s][\s\S]*"
_COMPACT_JSON = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def tool_choice_constraint(
    tools: Sequence[ToolSpec], tool_choice: str, parallel: bool = True,
    tool_format: ToolFormat | None = None,
) -> Constraint | dict[str, Any] | None:
    """The constraint that enforces ``tool_choice`` on a reply, for ``Job(constraint=...)``.

    ``tool_format`` is the model's (`tool_format_for` of its template); None is "json".

    "required" or a tool name: calls only, in the model's own format, so the model writes what
    it was trained to: hermes ``<tool_call>\n{call}\n</tool_call>`` blocks (one per call),
    llama one ``{"name", "parameters"}`` object (after ``<|python_tag|>`` or not; Llama's
    format has one call a turn), mistral ``[TOOL_CALLS] [calls]``, mistral_v11
    ``[TOOL_CALLS]name[ARGS]{arguments}`` per call; "json" is `tool_calls_schema` (a JSON
    call list, the fallback prompt's format). A name allows exactly one call of that tool;
    "required" one or more of any (exactly one unless ``parallel``).

    "auto": a grammar that steers without forcing: the reply is text, or calls of the tools in
    the model's own format, or a bare JSON call or call list, or a fenced one
    (```` ```json ````). Text may not start with ``[``, ``{``, a space or an opening
    ```` ```json ````, nor hold the format's marker, so a call the model starts is always
    well-formed and matches its tool's schema (a Llama call says "parameters" where the others
    say "arguments"). Hermes and Mistral calls may follow text where their marker is one token
    of the vocabulary (``tool_format.marker_id``); where it is plain text, calls come first.
    "none": such text only, so no call can be made. Without tools: None.
    """
    if not tools:
        return None
    if tool_choice == "none":
        return Constraint.regex(_TEXT_ONLY)
    tool_format = tool_format or ToolFormat()
    if tool_choice == "auto":
        return Constraint.grammar(_auto_grammar(tools, parallel, tool_format))
    if tool_format.name == "json":
        return tool_calls_schema(tools, tool_choice, parallel)
    chosen = [t for t in tools if tool_choice == "required" or t.name == tool_choice]
    if not chosen:
        raise JobError(f"tool_choice={tool_choice!r} is not one of the bound tools "
                       f"{[t.name for t in tools]}")
    return Constraint.grammar(_forced_grammar(chosen, parallel and tool_choice == "required",
                                              tool_format))


def _forced_grammar(tools: Sequence[ToolSpec], parallel: bool, tool_format: ToolFormat) -> str:
    """The Lark grammar of a forced call of ``tools`` in ``tool_format`` (not "json"): calls
    only, one unless ``parallel``."""
    rules = _call_rules(tools, parallel, tool_format)
    if tool_format.name == "llama":
        # One call, its <|python_tag|> optional (Llama writes it for some calls only).
        rules = [rule for rule in rules if not rule.startswith("native:")]
        opener = "" if tool_format.marker_id is None else f"<[{tool_format.marker_id}]>? "
        rules.append(f"native: {opener}one")
    return "\n".join(["start: native", *rules]) + "\n"


def _call_rules(tools: Sequence[ToolSpec], parallel: bool, tool_format: ToolFormat) -> list[str]:
    """The grammar rules of calls of ``tools``: ``one`` (a bare call object), ``many`` (a
    JSON call list) and, where the format marks its calls, ``native`` (its marked calls)."""
    key = "parameters" if tool_format.name == "llama" else "arguments"
    single = json.dumps({**_one_call_schema(tools, key), "x-guidance": _COMPACT_JSON})
    rules = [
        f"one: %json {single}",  # the tools' schemas appear once
        'many: "[" one (", " one)* "]"' if parallel else 'many: "[" one "]"',
    ]
    opener = _token_or_text(tool_format.marker_id, tool_format.marker)
    if tool_format.name == "hermes":
        closer = _token_or_text(tool_format.end_id, tool_format.closer)
        rules.append(f'call: {opener} "\\n" one "\\n" {closer}')
        # A newline may end the calls: Qwen2.5 writes one after </tool_call> whether or not
        # another call follows (made to go on, it repeated its call).
        rules.append('native: call ("\\n" call)* "\\n"?' if parallel else 'native: call "\\n"?')
    elif tool_format.name == "mistral":
        rules.append(f'native: {opener} " "? many')
    elif tool_format.name == "mistral_v11":
        args = _token_or_text(tool_format.args_id, tool_format.args_marker)
        names = []
        for i, tool in enumerate(tools):
            schema = {**_arguments_schema(tool, ""), "x-guidance": _COMPACT_JSON}
            rules.append(f"call{i}: {opener} {json.dumps(tool.name)} {args} "
                         f"%json {json.dumps(schema)}")
            names.append(f"call{i}")
        rules.append(f"call: {' | '.join(names)}")
        rules.append("native: call+" if parallel else "native: call")
    elif tool_format.name == "llama" and tool_format.marker_id is not None:
        rules.append(f"native: {opener} one")
    return rules


def _auto_grammar(tools: Sequence[ToolSpec], parallel: bool, tool_format: ToolFormat) -> str:
    """The Lark grammar (as llguidance reads it; %json embeds a JSON schema) of "auto": text,
    calls in ``tool_format``, or a fenced call."""
    marker = tool_format.marker
    text = r"/[^\[{\s][\s\S]*/ & ~/```json[\s\S]*/"
    if marker is not None and tool_format.marker_id is None:
        # The marker is plain text for this vocabulary: text may not hold it.
        text += f" & ~/[\\s\\S]*{re.escape(marker)}[\\s\\S]*/"
    rules = [
        f"TEXT: {text}",
        *_call_rules(tools, parallel, tool_format),
        'fenced: "```json\\n" (one | many) "\\n```"',
    ]
    # A bare call object or list is allowed in every format (models drop their markers at
    # times), and a fenced one; ``native`` adds the format's marked calls.
    starts = ["TEXT", "one", "many", "fenced"]
    if any(rule.startswith("native:") for rule in rules):
        # Text before calls, where the marker is a token (a text lexeme ends where it comes).
        text_first = tool_format.name != "llama" and tool_format.marker_id is not None
        starts.append("TEXT? native" if text_first else "native")
    return "\n".join([f"start: {' | '.join(starts)}", *rules]) + "\n"


def _token_or_text(token_id: int | None, text: str | None) -> str:
    """A grammar item for a marker: its token, or its text when it is not one token."""
    if token_id is not None:
        return f"<[{token_id}]>"
    return json.dumps(text or "")


def _one_call_schema(tools: Sequence[ToolSpec], key: str) -> dict[str, Any]:
    """The schema of one call of any of ``tools``, at the root of its own schema."""
    if len(tools) == 1:
        return _call_schema(tools[0], "", key)
    return {"anyOf": [_call_schema(t, f"/anyOf/{i}", key) for i, t in enumerate(tools)]}


def _call_schema(tool: ToolSpec, at: str, key: str = "arguments") -> dict[str, Any]:
    """The schema of one call of ``tool``, to sit at JSON pointer ``at`` of the whole schema;
    ``key`` names its arguments ("parameters" in Llama's format)."""
    arguments = _arguments_schema(tool, f"{at}/properties/{key}")
    return {
        "type": "object",
        "properties": {"name": {"const": tool.name}, key: arguments},
        "required": ["name", key],
        "additionalProperties": False,
    }


def _arguments_schema(tool: ToolSpec, at: str) -> dict[str, Any]:
    """``tool.parameters`` to sit at JSON pointer ``at``: a copy whose local refs point there,
    its root ``$ref`` followed (so the keys added here apply to the object it names)."""
    parameters = dict(tool.parameters)
    target = _root_target(parameters)
    if target is not None:
        parameters = {**target, **{k: v for k, v in parameters.items() if k != "$ref"}}
    try:
        arguments: dict[str, Any] = json.loads(json.dumps(parameters))  # a copy, JSON only
    except (TypeError, ValueError, RecursionError) as exc:
        raise JobError(f"the parameters schema of tool {tool.name!r} cannot be written as "
                       f"JSON ({exc})") from None
    _rebase_refs(arguments, at)
    arguments.pop("title", None)
    arguments.setdefault("type", "object")
    arguments.setdefault("properties", {})
    arguments.setdefault("additionalProperties", False)
    return arguments


def _rebase_refs(schema: dict[str, Any], at: str) -> None:
    """Prefix the local ``$ref``s (``#`` and ``#/...``) in ``schema`` (a JSON tree) with
    ``at``, in place."""
    stack: list[Any] = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            ref = node.get("$ref")
            if isinstance(ref, str) and (ref == "#" or ref.startswith("#/")):
                node["$ref"] = "#" + at + ref[1:]
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)


def _root_target(schema: dict[str, Any]) -> dict[str, Any] | None:
    """The definition a schema's root ``$ref`` names inside the schema (following a chain of
    them), or None when the root has no such ``$ref``."""
    node: Any = schema
    seen: set[str] = set()
    while isinstance(node, Mapping) and isinstance(node.get("$ref"), str):
        ref = node["$ref"]
        if not ref.startswith("#/") or ref in seen:
            return None
        seen.add(ref)
        node = _pointer_target(schema, ref[2:].split("/"))
    return dict(node) if isinstance(node, Mapping) and node is not schema else None


def _pointer_target(root: Any, parts: list[str]) -> Any:
    """What a JSON pointer's ``parts`` name inside ``root`` (None when nothing)."""
    node = root
    for part in parts:
        key = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, Mapping):
            node = node.get(key)
        elif isinstance(node, list) and key.isdigit() and int(key) < len(node):
            node = node[int(key)]
        else:
            return None
    return node


# Most nodes `inline_refs` writes: definitions that use each other several times grow the
# inlined schema exponentially with their depth.
INLINED_NODES_LIMIT = 100_000


def inline_refs(schema: dict[str, Any], max_nodes: int = INLINED_NODES_LIMIT) -> dict[str, Any]:
    """Replace local ``{"$ref": "#/$defs/X"}`` (or ``#/definitions/X``) by the definition, for
    consumers that do not read ``$ref``. Each definition is resolved once; where it is used
    several times the result holds the same object (copy before editing one place).

    Raises `JobError` (a ValueError) when the schema is recursive (a ``$ref`` refers to
    itself), or when the inlined schema, written out, would have more than ``max_nodes`` JSON
    values (definitions that reuse each other grow it exponentially): keep the ``$ref``s then.
    """
    defs = {**schema.get("definitions", {}), **schema.get("$defs", {})}
    done: dict[str, tuple[Any, int]] = {}
    resolving: set[str] = set()

    def definition(name: str) -> tuple[Any, int]:
        if name not in done:
            if name in resolving:
                raise JobError(f"the schema is recursive ($defs {name!r} refers to itself); "
                               "it cannot be inlined: keep its $refs")
            resolving.add(name)
            done[name] = resolve(defs[name])
            resolving.discard(name)
        return done[name]

    def resolve(node: Any) -> tuple[Any, int]:
        """``node`` inlined, and how many JSON values it has written out."""
        if isinstance(node, list):
            parts = [resolve(n) for n in node]
            out: Any = [p for p, _ in parts]
            size = 1 + sum(n for _, n in parts)
        elif isinstance(node, dict):
            ref = node.get("$ref")
            name = ref.split("/")[-1] if isinstance(ref, str) else None
            if name is not None and name in defs:
                (target, target_size), (rest, rest_size) = definition(name), resolve(
                    {k: v for k, v in node.items() if k != "$ref"})
                out, size = {**target, **rest}, target_size + rest_size
            else:
                fields = {k: resolve(v) for k, v in node.items()
                          if k not in ("$defs", "definitions")}
                out = {k: v for k, (v, _) in fields.items()}
                size = 1 + sum(n for _, n in fields.values())
        else:
            return node, 1
        if size > max_nodes:
            raise JobError(f"the schema inlined would have more than {max_nodes} JSON values "
                           "(its $defs reuse each other); keep its $refs instead of inlining")
        return out, size

    resolved: dict[str, Any] = resolve(schema)[0]
    return resolved


def tool_markers_are_special(tokenizer: Tokenizer, tool_format: ToolFormat) -> bool:
    """Whether a job that reads calls in ``tool_format`` must decode special tokens: True when
    one of the format's marker tokens (Mistral's ``[TOOL_CALLS]`` and ``[ARGS]``, Llama's
    ``<|python_tag|>``) is a special token, which decoding otherwise drops. Stop tokens stay
    out of the text either way."""
    return any(not tokenizer.decode([i]) and tokenizer.decode([i], decode_special_tokens=True)
               for i in tool_format.marker_ids)


def render_chat_prompt(tokenizer: Tokenizer, messages: Sequence[dict[str, Any]],
                       tools: Sequence[ToolSpec], tool_choice: str) -> list[int]:
    """Prompt token ids for chat ``messages`` (dicts as chat templates read them: role,
    content, tool_calls with dict arguments) through the model's chat template.

    A template with tools support gets ``tools`` unless tool_choice is "none". Otherwise the
    fallback prompt (`fallback_messages`) lists the tools under every tool_choice (its text
    does not depend on it), so the turns of an agent loop share the cached prompt prefix.
    """
    dicts = list(messages)
    if template_supports_tools(tokenizer.chat_template):
        offered = [t.as_dict() for t in tools] if tool_choice != "none" else []
        text = tokenizer.apply_chat_template(dicts, add_generation_prompt=True,
                                             tools=offered or None)
    else:
        has_tool_turns = any(d.get("tool_calls") or d["role"] == "tool" for d in dicts)
        if tools or has_tool_turns:
            dicts = fallback_messages(dicts, tools)
        text = tokenizer.apply_chat_template(dicts, add_generation_prompt=True)
    return list(tokenizer.encode(text, encode_special_tokens=True))


__all__ = [
    "INLINED_NODES_LIMIT", "InvalidToolCall", "ToolCall", "ToolCallParser", "ToolFormat",
    "ToolSpec", "ToolStreamDelta", "fallback_messages", "format_tool_calls", "inline_refs",
    "new_call_id", "render_chat_prompt",
    "normalize_tool_choice", "parse_tool_calls", "render_tools_prompt",
    "template_supports_tools", "tool_calls_schema", "tool_choice_constraint",
    "tool_format_for", "tool_markers_are_special",
]
