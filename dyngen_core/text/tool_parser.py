"""Reading tool calls out of model output, whole or as it streams (see `dyngen_core.text.tools` for
the output format). Pure Python."""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from dyngen_core.errors import JobError

_TAG_OPEN = "<tool_call>"
_TAG_CLOSE = "</tool_call>"


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


@dataclass
class ToolStreamDelta:
    """What one `ToolCallParser.push` (or `finish`) revealed: text to show and calls completed."""

    content: str = ""
    calls: list[ToolCall] = field(default_factory=list)
    invalid: list[InvalidToolCall] = field(default_factory=list)


class ToolCallParser:
    """Reads tool calls out of model output as it streams.

    Text is shown at once unless it may belong to a call: output whose first non-space character
    is ``[`` or ``{`` is held as a JSON call list or call object, and a ``<tool_call>`` block is
    held until it closes. Each call is reported when its JSON value completes. `finish` reports
    held text that turned out not to be calls as content (or, when a call was cut off, as an
    invalid call).
    """

    def __init__(self) -> None:
        self._pending = ""       # text not yet classified or not yet released
        self._mode = "start"     # "start", "text", "json", "tag"
        # While only spaces came ("start") or a <tool_call> block is open ("tag"), pushed text
        # waits here unjoined, so a long wait costs linear time; ``_last`` holds its end.
        self._waiting: list[str] = []
        self._last = ""
        self._json = _JsonCallScanner()
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
        if self._mode in ("start", "tag") and self._pending:
            self._waiting, self._pending = [self._pending], ""
            self._last = self._waiting[0][-len(_TAG_CLOSE):]
        self.calls += delta.calls
        self.invalid += delta.invalid
        return delta

    def _still_waiting(self, text: str) -> bool:
        """Whether ``text`` leaves the parser where it was (more spaces at the start, or no end
        of the open <tool_call> block); it is then kept for later."""
        if self._mode == "start":
            waiting = not text.strip()
        elif self._mode == "tag":
            waiting = _TAG_CLOSE not in self._last + text
        else:
            return False
        if waiting:
            self._waiting.append(text)
            self._last = (self._last + text)[-len(_TAG_CLOSE):]
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
        else:
            delta.content += held
        self._mode = "text"
        self.calls += delta.calls
        self.invalid += delta.invalid
        return delta

    def _step(self, delta: ToolStreamDelta) -> bool:
        """Consume some of the pending text; True when another step may make progress."""
        if self._mode == "start":
            stripped = self._pending.lstrip()
            if not stripped:
                return False
            self._mode = "json" if stripped[0] in "[{" else "text"
            return True
        if self._mode == "json":
            self._pending, text = "", self._pending
            delta.calls += self._json.feed(text)
            return False
        if self._mode == "tag":
            end = self._pending.find(_TAG_CLOSE)
            if end < 0:
                return False
            body, self._pending = self._pending[:end], self._pending[end + len(_TAG_CLOSE):]
            self._mode = "text"
            try:
                delta.calls += _calls_from_value(json.loads(body))
            except (ValueError, KeyError, TypeError, RecursionError) as exc:
                delta.invalid.append(InvalidToolCall(body.strip(), str(exc), new_call_id()))
            return True
        start = self._pending.find(_TAG_OPEN)
        if start >= 0:
            delta.content += self._pending[:start]
            self._pending = self._pending[start + len(_TAG_OPEN):]
            self._mode = "tag"
            return True
        keep = _partial_suffix(self._pending, _TAG_OPEN)
        delta.content += self._pending[:len(self._pending) - keep]
        self._pending = self._pending[len(self._pending) - keep:]
        return False


def parse_tool_calls(text: str) -> ToolStreamDelta:
    """Read a whole output: its content (text outside calls), calls and invalid calls."""
    parser = ToolCallParser()
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
    in pieces and joined when read, so feeding costs time linear in the text."""

    def __init__(self) -> None:
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
        if self._in_string:
            if self._escaped:
                self._escaped = False
            elif ch == "\\":
                self._escaped = True
            elif ch == '"':
                self._in_string = False
            return True
        if ch == '"':
            self._in_string = True
            return True
        return False

    def _close_item(self, body: str) -> list[ToolCall]:
        try:
            calls = _calls_from_value(json.loads(body))
        except (ValueError, KeyError, TypeError, RecursionError):
            return []
        self.found_any = True
        return calls


def _joined(parts: list[str]) -> str:
    """``parts`` joined, kept as one piece for the next read."""
    if len(parts) > 1:
        parts[:] = ["".join(parts)]
    return parts[0] if parts else ""
