"""Reading tool calls out of model output, whole or as it streams (see `dyngen_core.text.tools` for
the output format, `dyngen_core.text.tool_formats` for the models' own formats). Pure Python."""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from dyngen_core.errors import JobError
from dyngen_core.text.tool_formats import (
    ARGS_TAG,
    MISTRAL_TAG,
    TAG_CLOSE,
    TAG_OPEN,
    ToolFormat,
    markers_read,
)


@dataclass(frozen=True)
class ToolCall:
    """A parsed call: tool name, arguments, and an id that tool results refer back to."""

    name: str
    arguments: dict[str, Any]
    id: str


@dataclass(frozen=True)
class InvalidToolCall:
    """Output that looked like a tool call but could not be read; ``text`` is the raw output."""

    text: str
    error: str
    id: str


def new_call_id() -> str:
    """A fresh id for a call the model made (tool results refer back to it)."""
    return "call_" + uuid.uuid4().hex[:24]


def call_dict(call: Mapping[str, Any]) -> dict[str, Any]:
    """``{"name", "arguments"}`` from an OpenAI-style call (``{"function": {...}}``), a
    LangChain-style one (``args``) or a plain one; string arguments are parsed as JSON."""
    function = call.get("function", call) if isinstance(call, Mapping) else None
    if not isinstance(function, Mapping) or "name" not in function:
        raise JobError(f"a tool call needs a 'name' (or a 'function' with one); got {call!r:.200}")
    arguments = function.get("arguments", function.get("args")) or {}
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except (ValueError, RecursionError) as exc:
            raise JobError(f"the arguments of tool call {function['name']!r} are not valid "
                           f"JSON ({exc}): {arguments!r:.200}") from None
    return {"name": function["name"], "arguments": arguments}


_FENCE = "```"
# The longest tool name read between [TOOL_CALLS] and [ARGS] (Mistral v11) before the call is
# given up as invalid.
_NAME_LIMIT = 256


@dataclass
class ToolStreamDelta:
    """What one `ToolCallParser.push` (or `finish`) revealed: text to show and calls completed."""

    content: str = ""
    calls: list[ToolCall] = field(default_factory=list)
    invalid: list[InvalidToolCall] = field(default_factory=list)


class ToolCallParser:
    """Reads tool calls out of model output as it streams.

    Text is shown at once unless it may belong to a call: output whose first non-space character
    is ``[`` or ``{`` is held as a JSON call list or call object; output that opens with a
    fence (```` ```json ````) is held while it may be a fenced call; a ``<tool_call>`` block is
    held until it closes; after ``<|python_tag|>`` or ``[TOOL_CALLS]`` the rest is read as JSON
    calls (in the "mistral_v11" format, ``[TOOL_CALLS]`` opens one ``name[ARGS]{arguments}``
    call, and text after it is read on, so calls may follow each other). Each call is
    reported when its JSON value completes, a fenced one at the end (it is a call only when it
    is the whole message). `finish` reports held text that turned out not
    to be calls as content (or, when a call was cut off, as an invalid call).

    tool_names: the bound tools. Given, a bare or fenced JSON call counts only when it names
    one of them (text that shows a call of something else is content). tool_format: the
    model's `ToolFormat`; its marker is the one read (all of them for "json" or None).
    """

    def __init__(self, tool_names: Iterable[str] | None = None,
                 tool_format: ToolFormat | None = None) -> None:
        self._names = frozenset(tool_names) if tool_names is not None else None
        self._markers = markers_read(tool_format)
        self._named_calls = tool_format is not None and tool_format.name == "mistral_v11"
        self._named: _NamedCall | None = None
        # After a marked call: spaces are held, shown only if text follows (not another call).
        self._after_call = False
        self._longest = max(len(m) for m in (*self._markers, TAG_CLOSE))
        self._pending = ""       # text not yet classified or not yet released
        self._mode = "start"     # "start", "text", "json", "tag", "fence", "named"
        # While only spaces came ("start") or a <tool_call> block is open ("tag"), pushed text
        # waits here unjoined, so a long wait costs linear time; ``_last`` holds its end.
        self._waiting: list[str] = []
        self._last = ""
        self._json = _JsonCallScanner(self._names)
        self._fence: _FencedCall | None = None
        self.calls: list[ToolCall] = []
        self.invalid: list[InvalidToolCall] = []

    def push(self, text: str) -> ToolStreamDelta:
        """Add streamed output; returns the content it releases and the calls it completes."""
        delta = ToolStreamDelta()
        if self._still_waiting(text):
            return delta
        self._pending = "".join(self._waiting) + self._pending + text
        self._waiting, self._last = [], ""
        while self._step(delta):
            pass
        if (self._mode in ("start", "tag") or self._after_call) and self._pending:
            self._waiting, self._pending = [self._pending], ""
            self._last = self._waiting[0][-len(TAG_CLOSE):]
        self.calls += delta.calls
        self.invalid += delta.invalid
        return delta

    def _still_waiting(self, text: str) -> bool:
        """Whether ``text`` leaves the parser where it was (more spaces at the start or after a
        call, or no end of the open <tool_call> block); it is then kept for later."""
        if self._mode == "start":
            waiting = not text.strip()
        elif self._mode == "tag":
            waiting = TAG_CLOSE not in self._last + text
        elif self._after_call:
            waiting = not text.strip()
        else:
            return False
        if waiting:
            self._waiting.append(text)
            self._last = (self._last + text)[-len(TAG_CLOSE):]
        return waiting

    def finish(self) -> ToolStreamDelta:
        """End of output: release or report whatever is still held."""
        delta = ToolStreamDelta()
        held, self._pending = "".join(self._waiting) + self._pending, ""
        self._waiting, self._last = [], ""
        scanner = self._json
        if self._mode == "json":
            cut_call = not scanner.done and '"name"' in scanner.raw
            if scanner.found_any or cut_call:
                if not scanner.done:
                    delta.invalid.append(InvalidToolCall(
                        scanner.raw.strip(), "the output ended inside a JSON tool call "
                        "(max_tokens reached?)", new_call_id()))
                delta.content += scanner.tail.strip()
            else:
                delta.content += scanner.raw + scanner.tail
        elif self._mode == "tag":
            delta.invalid.append(InvalidToolCall(held, "the <tool_call> block was not closed",
                                                 new_call_id()))
        elif self._mode == "named" and self._named is not None:
            delta.invalid.append(InvalidToolCall(
                self._named.raw(), "the output ended inside a [TOOL_CALLS] call (max_tokens "
                "reached?)", new_call_id()))
        elif self._mode == "fence" and self._fence is not None:
            calls = self._fence.calls()
            if calls:
                delta.calls += calls
            else:
                delta.content += self._fence.raw()
        elif not (self._after_call and not held.strip()):
            delta.content += held  # (spaces after the last call are dropped)
        self._mode = "text"
        self.calls += delta.calls
        self.invalid += delta.invalid
        return delta

    def _step(self, delta: ToolStreamDelta) -> bool:
        """Consume some of the pending text; True when another step may make progress."""
        if self._mode == "start":
            return self._classify_start()
        if self._mode == "json":
            self._pending, text = "", self._pending
            delta.calls += self._json.feed(text)
            return False
        if self._mode == "named" and self._named is not None:
            self._pending, text = "", self._pending
            rest = self._named.feed(text)
            if rest is None:
                return False
            self._named.report(delta)
            self._pending, self._mode, self._named = rest, "text", None
            self._after_call = True
            return True
        if self._mode == "fence" and self._fence is not None:
            self._pending, text = "", self._pending
            if self._fence.feed(text):
                return False
            self._pending, self._mode = self._fence.raw(), "text"
            return True
        if self._mode == "tag":
            end = self._pending.find(TAG_CLOSE)
            if end < 0:
                return False
            body, self._pending = self._pending[:end], self._pending[end + len(TAG_CLOSE):]
            self._mode, self._after_call = "text", True
            try:
                delta.calls += _calls_from_value(_loads_call(body))
            except (ValueError, KeyError, TypeError, RecursionError) as exc:
                delta.invalid.append(InvalidToolCall(body.strip(), str(exc), new_call_id()))
            return True
        return self._step_text(delta)

    def _classify_start(self) -> bool:
        """At the start of the output: choose what the first non-space text is."""
        stripped = self._pending.lstrip()
        if not stripped:
            return False
        for marker in self._markers:
            if stripped.startswith(marker):
                self._open_marker(marker, stripped[len(marker):])
                return True
            if marker.startswith(stripped):
                return False  # may still become the marker
        if stripped.startswith(_FENCE) and self._names:
            self._mode, self._fence = "fence", _FencedCall(self._names)
        elif _FENCE.startswith(stripped) and self._names:
            return False
        else:
            self._mode = "json" if stripped[0] in "[{" else "text"
        return True

    def _open_marker(self, marker: str, rest: str) -> None:
        """A call marker was read; ``rest`` is the text after it."""
        self._pending = rest
        if marker == TAG_OPEN:
            self._mode = "tag"
        elif self._named_calls:  # [TOOL_CALLS]name[ARGS]{...}
            self._mode, self._named = "named", _NamedCall()
        else:  # what follows <|python_tag|> or [TOOL_CALLS] is the calls' JSON
            self._mode, self._json = "json", _JsonCallScanner(None)

    def _step_text(self, delta: ToolStreamDelta) -> bool:
        """In text: release it up to the first call marker (or a partial one at the end)."""
        if self._after_call:
            stripped = self._pending.lstrip()
            if not stripped or any(m.startswith(stripped) for m in self._markers):
                return False  # spaces, maybe before another call: held
            if any(stripped.startswith(m) for m in self._markers):
                self._pending = stripped
            self._after_call = False
        found = [(at, m) for m in self._markers if (at := self._pending.find(m)) >= 0]
        if found:
            start, marker = min(found)
            delta.content += self._pending[:start]
            self._open_marker(marker, self._pending[start + len(marker):])
            return True
        keep = max(_partial_suffix(self._pending, m) for m in self._markers)
        delta.content += self._pending[:len(self._pending) - keep]
        self._pending = self._pending[len(self._pending) - keep:]
        return False


def parse_tool_calls(text: str, tool_names: Iterable[str] | None = None,
                     tool_format: ToolFormat | None = None) -> ToolStreamDelta:
    """Read a whole output: its content (text outside calls), calls and invalid calls
    (``tool_names`` and ``tool_format`` as for `ToolCallParser`)."""
    parser = ToolCallParser(tool_names, tool_format)
    first = parser.push(text)
    last = parser.finish()
    return ToolStreamDelta(first.content + last.content, first.calls + last.calls,
                           first.invalid + last.invalid)


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``marker``."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def _loads_call(body: str) -> Any:
    """``body`` read as JSON; a call written with doubled braces (``{{"name": ...}}``, as some
    templates show the format) is read without them."""
    try:
        return json.loads(body)
    except ValueError:
        text = body.strip()
        if text.startswith("{{") and text.endswith("}}"):
            return json.loads(text[1:-1])
        raise


def _calls_from_value(value: Any) -> list[ToolCall]:
    """Calls from a parsed JSON value: a call object, a list of them, or {"tool_calls": [...]}."""
    if isinstance(value, dict) and isinstance(value.get("tool_calls"), list):
        value = value["tool_calls"]
    items = value if isinstance(value, list) else [value]
    calls = []
    for item in items:
        if not isinstance(item, dict):
            raise ValueError(f"a tool call must be a JSON object; got {item!r}")
        call = call_dict({**item, "arguments": item.get("arguments", item.get("parameters"))})
        if not isinstance(call["arguments"], dict):
            raise ValueError(f"tool call arguments must be a JSON object; got {item!r}")
        calls.append(ToolCall(str(call["name"]), call["arguments"],
                              str(item.get("id") or new_call_id())))
    return calls


class _JsonCallScanner:
    """Follows a JSON call list (or one call object) as it streams, returning each call object
    as soon as its closing brace arrives. Tracks nesting and strings, nothing more.

    ``raw`` is the text fed up to the value's end, ``tail`` what came after it; both are kept
    in pieces and joined when read, so feeding costs time linear in the text. With ``names``,
    only calls of those tools count."""

    def __init__(self, names: frozenset[str] | None = None) -> None:
        self._names = names
        self._raw: list[str] = []
        self._tail: list[str] = []
        self._item: list[str] | None = None  # the pieces of the call object being read
        self._depth = 0
        self._in_string = False
        self._escaped = False
        self._is_list: bool | None = None
        self.done = False
        self.found_any = False

    @property
    def raw(self) -> str:
        return _joined(self._raw)

    @property
    def tail(self) -> str:
        return _joined(self._tail)

    def feed(self, text: str) -> list[ToolCall]:
        if self.done:
            self._tail.append(text)
            return []
        calls: list[ToolCall] = []
        item_from = 0 if self._item is not None else None
        for at, ch in enumerate(text):
            if self._string_char(ch):
                continue
            if ch in "[{":
                if self._is_list is None:
                    self._is_list = ch == "["
                self._depth += 1
                if ch == "{" and self._depth == (2 if self._is_list else 1):
                    self._item, item_from = [], at
            elif ch in "]}":
                self._depth -= 1
                if ch == "}" and self._item is not None and item_from is not None and \
                        self._depth == (1 if self._is_list else 0):
                    body = "".join(self._item) + text[item_from:at + 1]
                    self._item = item_from = None
                    calls += self._close_item(body)
                if self._depth == 0:
                    self.done = True
                    self._raw.append(text[:at + 1])
                    self._tail.append(text[at + 1:])
                    return calls
        self._raw.append(text)
        if self._item is not None and item_from is not None:
            self._item.append(text[item_from:])
        return calls

    def _string_char(self, ch: str) -> bool:
        return _string_step(self, ch)

    def _close_item(self, body: str) -> list[ToolCall]:
        try:
            calls = _calls_from_value(_loads_call(body))
        except (ValueError, KeyError, TypeError, RecursionError):
            return []
        if self._names is not None:
            calls = [call for call in calls if call.name in self._names]
        self.found_any = self.found_any or bool(calls)
        return calls


class _NamedCall:
    """Follows one Mistral v11 call after its ``[TOOL_CALLS]``: the tool's name up to
    ``[ARGS]`` (or up to the arguments' ``{``, where the marker was dropped), then the
    arguments' JSON object. `feed` returns the text after the call once the call is complete
    (or cannot be one), else None; `report` then adds the call (or the invalid call) to a
    delta. Held text is kept in pieces, so feeding costs linear time."""

    def __init__(self) -> None:
        self._name = ""                      # the text after the marker, while no [ARGS] came
        self._args: list[str] | None = None  # the arguments' pieces, once the name is read
        self._depth = 0
        self._in_string = False
        self._escaped = False
        self._error = ""
        self._marked = False  # whether [ARGS] came

    def raw(self) -> str:
        """The call's text as read (for an invalid call)."""
        if self._args is None or not self._marked:
            return MISTRAL_TAG + self._name + _joined(self._args or [])
        return f"{MISTRAL_TAG}{self._name}{ARGS_TAG}{_joined(self._args)}"

    def feed(self, text: str) -> str | None:
        """Add output; the text after the call once it is complete, else None."""
        if self._args is None:
            self._name += text
            args_at, brace_at = self._name.find(ARGS_TAG), self._name.find("{")
            if args_at >= 0 and (brace_at < 0 or args_at < brace_at):
                text = self._name[args_at + len(ARGS_TAG):]
                self._name, self._marked = self._name[:args_at], True
            elif brace_at >= 0:
                text, self._name = self._name[brace_at:], self._name[:brace_at]
            elif len(self._name) > _NAME_LIMIT:
                self._error = f"no [ARGS] within {_NAME_LIMIT} characters of [TOOL_CALLS]"
                self._args = []
                return ""
            else:
                return None
            self._args = []
        return self._feed_args(text)

    def _feed_args(self, text: str) -> str | None:
        assert self._args is not None
        for at, ch in enumerate(text):
            if self._depth == 0:
                if ch.isspace():
                    continue
                if ch != "{":
                    self._error = "the arguments after [ARGS] are not a JSON object"
                    self._args.append(text[:at])
                    return text[at:]
            if _string_step(self, ch):
                continue
            if ch in "[{":
                self._depth += 1
            elif ch in "]}":
                self._depth -= 1
                if self._depth == 0:
                    self._args.append(text[:at + 1])
                    return text[at + 1:]
        self._args.append(text)
        return None

    def report(self, delta: ToolStreamDelta) -> None:
        """Add the completed call to ``delta``: a call, or an invalid call saying what was
        wrong."""
        name, error = self._name.strip(), self._error
        arguments: Any = None
        if not error and not name:
            error = "no tool name between [TOOL_CALLS] and [ARGS]"
        if not error:
            try:
                arguments = json.loads(_joined(self._args or []))
            except (ValueError, RecursionError) as exc:
                error = f"the arguments are not valid JSON ({exc})"
        if not error and not isinstance(arguments, dict):
            error = "the arguments are not a JSON object"
        if error:
            delta.invalid.append(InvalidToolCall(self.raw(), error, new_call_id()))
        else:
            delta.calls.append(ToolCall(name, arguments, new_call_id()))


def _string_step(state: Any, ch: str) -> bool:
    """Follow JSON strings one character at a time (``state`` has ``_in_string`` and
    ``_escaped``); True when ``ch`` is part of a string (its quotes included)."""
    if state._in_string:
        if state._escaped:
            state._escaped = False
        elif ch == "\\":
            state._escaped = True
        elif ch == '"':
            state._in_string = False
        return True
    if ch == '"':
        state._in_string = True
        return True
    return False


_BRACKET = re.compile(r"[\[{]")
_FENCE_TAGS = ("", "json")
_HEADER_LIMIT = 64  # longest text before the JSON of a fenced call: the fence and its tag


class _FencedCall:
    """Follows output that opens with a code fence while it may be a fenced JSON call
    (```` ```json ````, then a call object or list naming bound tools, then the closing fence
    and nothing else). `feed` says whether it still may be; `calls` gives the calls once the
    output has ended. Held text is kept in pieces (`raw`), so feeding costs linear time."""

    def __init__(self, names: frozenset[str]) -> None:
        self._raw: list[str] = []
        self._head = ""      # the text before the JSON: spaces, the fence, its tag
        self._in_body = False
        self._json = _JsonCallScanner(names)
        self._closing = ""   # the non-space text after the JSON
        self._found: list[ToolCall] = []

    def raw(self) -> str:
        return _joined(self._raw)

    def feed(self, text: str) -> bool:
        """Add output; False once it cannot be a fenced call."""
        self._raw.append(text)
        if not self._in_body:
            rest = self._read_head(text)
            if rest is None:
                return False
            text = rest
        if text and not self._json.done:
            self._found += self._json.feed(text)
            text = self._json.tail if self._json.done else ""
        self._closing += "".join(text.split())
        return _FENCE.startswith(self._closing)

    def calls(self) -> list[ToolCall]:
        """The calls, when the whole output was one fenced call of bound tools (else none)."""
        whole = self._json.done and self._closing in ("", _FENCE)
        return self._found if whole else []

    def _read_head(self, text: str) -> str | None:
        """Read the fence's opening; the text from the JSON's first bracket on ('' before
        it), or None when this is not the opening of a fenced call."""
        bracket = _BRACKET.search(text)
        self._head += text if bracket is None else text[:bracket.start()]
        head = self._head.lstrip()
        tag, newline, after = head[len(_FENCE):].partition("\n")
        tag = tag.strip()
        fits = len(self._head) <= _HEADER_LIMIT and not after.strip() and (
            tag in _FENCE_TAGS if newline or bracket else "json".startswith(tag))
        if not fits:
            return None
        if bracket is None:
            return ""
        self._in_body = True
        return text[bracket.start():]


def _joined(parts: list[str]) -> str:
    """``parts`` joined, kept as one piece for the next read."""
    if len(parts) > 1:
        parts[:] = ["".join(parts)]
    return parts[0] if parts else ""
