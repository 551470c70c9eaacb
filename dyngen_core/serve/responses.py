"""Engine results into OpenAI response objects: one choice's output as it streams
(`ChoiceOutput`), and the completion objects, stream chunks and usage built from it.

Text passes through token by token. With tools offered, `dyngen_core.tools.ToolCallParser`
holds back output that may be a call and turns each completed call into a ``tool_calls``
entry (a call the parser could not read is shown as text). Logprobs are the log of each
token's probability in the distribution it was sampled from (after the request's sampling
settings), with the most likely alternatives when asked.
"""

from __future__ import annotations

import json
import math
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from dyngen_core import Result, Tokenizer
from dyngen_core.tools import ToolCall, ToolCallParser, ToolFormat, ToolStreamDelta

# eos_reason -> OpenAI finish_reason.
_FINISH_REASONS = {
    "stop_token": "stop",
    "stop_string": "stop",
    "max_new_tokens": "length",
    "constraint_incomplete": "length",
}
# The smallest probability a logprob is taken of (a probability of 0 would be -inf, not JSON).
_TINY = 1e-45


@dataclass
class ChoiceDelta:
    """What one result added to a choice (a stream chunk's), or, added up with `add`, what
    all of them did (a whole choice's)."""

    content: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)
    logprobs: list[dict[str, Any]] = field(default_factory=list)
    finish_reason: str | None = None

    def add(self, later: ChoiceDelta) -> None:
        """Append what ``later`` added (its finish reason, when it has one, ends the choice)."""
        self.content += later.content
        self.tool_calls += later.tool_calls
        self.logprobs += later.logprobs
        self.finish_reason = later.finish_reason or self.finish_reason


@dataclass
class ChoiceTotals:
    """A finished choice's token counts."""

    completion_tokens: int
    cached_tokens: int


class ChoiceOutput:
    """One choice's output, fed the job's results in order.

    tokenizer: the model's tokenizer (for the text of each logprob token).
    parse_tools: read tool calls out of the output.
    top_logprobs: None for no logprobs, else how many alternatives per token.
    tool_names, tool_format: the offered tools' names and the model's call format (as
    `ToolCallParser` takes them).
    """

    def __init__(self, tokenizer: Tokenizer, parse_tools: bool, top_logprobs: int | None,
                 tool_names: tuple[str, ...] = (), tool_format: ToolFormat | None = None
                 ) -> None:
        self.tokenizer = tokenizer
        self.parser = ToolCallParser(tool_names or None, tool_format) if parse_tools else None
        self.top_logprobs = top_logprobs
        self.num_calls = 0
        self.totals: ChoiceTotals | None = None

    def feed(self, result: Result) -> ChoiceDelta:
        """The delta ``result`` makes (empty for prefill progress, or while a possible tool
        call is held back)."""
        delta = ChoiceDelta()
        text = result.get("text") or ""
        if text:
            self._add(delta, self.parser.push(text) if self.parser else ToolStreamDelta(text))
        if self.top_logprobs is not None and result.get("token_ids"):
            delta.logprobs = self._logprobs(result)
        if result["eos"]:
            if self.parser is not None:
                self._add(delta, self.parser.finish())
            delta.finish_reason = self._finish_reason(result)
            self.totals = ChoiceTotals(int(result["new_tokens"]), int(result["cached_tokens"]))
        return delta

    def _add(self, delta: ChoiceDelta, parsed: ToolStreamDelta) -> None:
        delta.content += parsed.content + "".join(bad.text for bad in parsed.invalid)
        delta.tool_calls += parsed.calls
        self.num_calls += len(parsed.calls)

    def _finish_reason(self, result: Result) -> str:
        if self.num_calls:
            return "tool_calls"
        reason = str(result["eos_reason"])
        return _FINISH_REASONS.get(reason, reason)

    def _logprobs(self, result: Result) -> list[dict[str, Any]]:
        ids = list(result["token_ids"])
        probs = _floats(result.get("token_probs"), len(ids))
        top_ids = _rows(result.get("top_k_tokens"), len(ids))
        top_probs = _rows(result.get("top_k_probs"), len(ids))
        entries = []
        for i, token_id in enumerate(ids):
            entry = self._entry(token_id, probs[i] if i < len(probs) else 1.0)
            pairs = zip(top_ids[i] if i < len(top_ids) else [],
                        top_probs[i] if i < len(top_probs) else [], strict=False)
            entry["top_logprobs"] = [self._entry(int(t), float(p)) for t, p in pairs]
            entries.append(entry)
        return entries

    def _entry(self, token_id: int, prob: float) -> dict[str, Any]:
        text = self.tokenizer.decode([token_id])
        return {"token": text, "logprob": math.log(max(prob, _TINY)),
                "bytes": list(text.encode("utf-8"))}


def _floats(value: Any, count: int) -> list[float]:
    """A tensor, array or list of per-token probabilities as floats."""
    if value is None:
        return []
    values = value.tolist() if hasattr(value, "tolist") else value
    if not isinstance(values, list):
        values = [values]
    return [float(v) for v in _flatten(values)][:count]


def _rows(value: Any, count: int) -> list[list[float]]:
    """Per-token rows of top-k values (one row for a single token)."""
    if value is None:
        return []
    values = value.tolist() if hasattr(value, "tolist") else value
    if values and not isinstance(values[0], list):
        values = [values]
    return list(values)[:count]


def _flatten(values: list[Any]) -> list[Any]:
    return [v for row in values for v in (row if isinstance(row, list) else [row])]


# ---- response objects ------------------------------------------------------------------------


def new_id(prefix: str) -> str:
    """A response id, e.g. ``chatcmpl-...``."""
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    """The ``created`` timestamp (seconds)."""
    return int(time.time())


def usage(prompt_tokens: Sequence[int], totals: Sequence[ChoiceTotals | None],
          choices_per_prompt: int) -> dict[str, Any]:
    """OpenAI usage: each prompt counted once, every choice's tokens; cached_tokens are the
    prompt tokens the first choice of each prompt found in the cache."""
    completion = sum(t.completion_tokens for t in totals if t is not None)
    firsts = totals[::choices_per_prompt]
    cached = sum(t.cached_tokens for t in firsts if t is not None)
    prompt = sum(prompt_tokens)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def tool_call_dict(call: ToolCall, index: int | None = None) -> dict[str, Any]:
    """A call as OpenAI writes it (``arguments`` a JSON string); ``index`` for stream deltas."""
    out: dict[str, Any] = {"id": call.id, "type": "function",
                           "function": {"name": call.name,
                                        "arguments": json.dumps(call.arguments,
                                                                ensure_ascii=False)}}
    if index is not None:
        out = {"index": index, **out}
    return out


def chat_logprobs(entries: list[dict[str, Any]] | None) -> dict[str, Any] | None:
    """A chat choice's ``logprobs`` object."""
    return None if entries is None else {"content": entries, "refusal": None}


def completion_logprobs(entries: list[dict[str, Any]] | None,
                        text_offset: int = 0) -> dict[str, Any] | None:
    """A completions choice's (legacy) ``logprobs`` object."""
    if entries is None:
        return None
    offsets, position = [], text_offset
    for entry in entries:
        offsets.append(position)
        position += len(entry["token"])
    return {"tokens": [e["token"] for e in entries],
            "token_logprobs": [e["logprob"] for e in entries],
            "top_logprobs": [{t["token"]: t["logprob"] for t in e["top_logprobs"]}
                             for e in entries],
            "text_offset": offsets}


def chat_message(content: str, calls: list[ToolCall]) -> dict[str, Any]:
    """A finished choice's assistant message."""
    message: dict[str, Any] = {"role": "assistant", "content": content or (None if calls else ""),
                               "refusal": None}
    if calls:
        message["tool_calls"] = [tool_call_dict(call) for call in calls]
    return message


# The ``object`` of a streamed chunk, by endpoint.
CHAT_CHUNK = "chat.completion.chunk"
COMPLETION_CHUNK = "text_completion"


def stream_chunk(object_type: str, response_id: str, created: int, model: str,
                 choices: list[dict[str, Any]], usage_: dict[str, Any] | None = None,
                 with_usage: bool = False) -> dict[str, Any]:
    """One streamed object, a `CHAT_CHUNK` or a `COMPLETION_CHUNK` (``object_type``); with
    ``with_usage`` it carries ``usage_`` (null in every chunk but the last)."""
    chunk: dict[str, Any] = {"id": response_id, "object": object_type,
                             "created": created, "model": model, "system_fingerprint": None,
                             "choices": choices}
    if with_usage:
        chunk["usage"] = usage_
    return chunk
