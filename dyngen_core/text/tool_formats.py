"""Tool call formats: how each model family writes a call (Llama 3.x, Mistral, Qwen/Hermes, and
dyngen's JSON call list for the rest, e.g. SmolLM), chosen from its chat template
(`tool_format_for`). The parser (`dyngen_core.text.tool_parser`) reads the markers defined here.
Pure Python."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

from dyngen_core.errors import JobError

# The texts that open, close and split calls in the native formats.
TAG_OPEN = "<tool_call>"
TAG_CLOSE = "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
MISTRAL_TAG = "[TOOL_CALLS]"
ARGS_TAG = "[ARGS]"
# The markers each format's calls start with; formats without one of their own read them all.
_MARKERS = {"hermes": (TAG_OPEN,), "llama": (PYTHON_TAG,), "mistral": (MISTRAL_TAG,),
            "mistral_v11": (MISTRAL_TAG,)}
ALL_MARKERS = (TAG_OPEN, PYTHON_TAG, MISTRAL_TAG)
FORMAT_NAMES = ("json", "hermes", "llama", "mistral", "mistral_v11")


@dataclass(frozen=True)
class ToolFormat:
    """How a model writes tool calls, as its chat template shows it (`tool_format_for`).

    name: "hermes" (``<tool_call>{...}</tool_call>`` blocks: Qwen2/2.5/3, Hermes), "llama" (a
    bare ``{"name", "parameters"}`` object, maybe after ``<|python_tag|>``: Llama 3.1-3.3),
    "mistral" (``[TOOL_CALLS]`` then a JSON list of calls: Mistral v3/v7 templates),
    "mistral_v11" (``[TOOL_CALLS]name[ARGS]{arguments}`` per call, back to back: the newer
    Mistral templates), or "json" (no format of its own: dyngen's JSON call list, the fallback
    prompt's format).
    marker_id, end_id, args_id: the ids of the marker that opens a call, of ``</tool_call>``
    (hermes) and of ``[ARGS]`` (mistral_v11), where each is one token of the vocabulary, else
    None.
    """

    name: str = "json"
    marker_id: int | None = None
    end_id: int | None = None
    args_id: int | None = None

    def __post_init__(self) -> None:
        if self.name not in FORMAT_NAMES:
            raise JobError(f"unknown tool call format {self.name!r}; use one of "
                           f"{', '.join(map(repr, FORMAT_NAMES))}")

    @property
    def marker(self) -> str | None:
        """The text that opens a call in this format, or None ("json")."""
        markers = _MARKERS.get(self.name)
        return markers[0] if markers else None

    @property
    def closer(self) -> str | None:
        """The text that closes a call in this format (``</tool_call>``), or None."""
        return TAG_CLOSE if self.name == "hermes" else None

    @property
    def args_marker(self) -> str | None:
        """The text between a call's name and its arguments (``[ARGS]``), or None."""
        return ARGS_TAG if self.name == "mistral_v11" else None

    @property
    def marker_ids(self) -> tuple[int, ...]:
        """The token ids of this format's markers that are single tokens."""
        ids = (self.marker_id, self.end_id, self.args_id)
        return tuple(i for i in ids if i is not None)


def tool_format_for(template: str | None,
                    piece_to_id: Callable[[str], int | None] | None = None) -> ToolFormat:
    """The tool call format a chat template teaches, read from the template's text:
    ``[TOOL_CALLS]`` is Mistral's (with ``[ARGS]`` too, Mistral v11's), ``<tool_call>``
    Hermes' (Qwen), ``<|python_tag|>`` or Llama's ``"parameters"`` instruction Llama's; a
    template that renders no tools, or none of these, gets "json". ``piece_to_id`` (a
    tokenizer's) finds the markers' token ids."""
    if not template or not re.search(r"\btools\b", template):
        return ToolFormat()
    if MISTRAL_TAG in template:
        name = "mistral_v11" if ARGS_TAG in template else "mistral"
    elif TAG_OPEN in template:
        name = "hermes"
    elif PYTHON_TAG in template or '"parameters": dictionary of argument' in template:
        name = "llama"
    else:
        return ToolFormat()
    marker = _MARKERS[name][0]
    lookup = piece_to_id or (lambda _piece: None)
    return ToolFormat(name, lookup(marker), lookup(TAG_CLOSE) if name == "hermes" else None,
                      lookup(ARGS_TAG) if name == "mistral_v11" else None)


def markers_read(tool_format: ToolFormat | None) -> tuple[str, ...]:
    """The call markers a parser reads for ``tool_format``: the format's own, or all of them
    for "json" or None (a model without a format of its own may write any of them)."""
    own = _MARKERS.get(tool_format.name) if tool_format is not None else None
    return own or ALL_MARKERS
