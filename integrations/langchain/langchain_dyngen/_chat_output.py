"""One chat job's results as LangChain message chunks.

Text is passed on token by token. With tools offered, `dyngen_core.tools.ToolCallParser` holds
back output that may be a call and turns each completed call into a tool-call chunk (with its
id); whatever is left when the job ends goes out with the last chunk, which also carries usage
metadata, the finish reason and the model name, and is marked ``chunk_position="last"``.
Non-streaming calls merge these same chunks, so both paths give the same message.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from langchain_core.messages import AIMessageChunk
from langchain_core.messages.tool import ToolCallChunk, tool_call_chunk
from langchain_core.outputs import ChatGenerationChunk

from dyngen_core import Result
from dyngen_core.tools import ToolCallParser, ToolFormat, ToolStreamDelta
from langchain_dyngen._runs import response_metadata, usage_metadata


class ChatChunker:
    """Turns the results of one job into `ChatGenerationChunk`s.

    model_name: reported in the last chunk's response metadata.
    parse_tools: read tool calls out of the output (tools were offered).
    tool_names, tool_format: the bound tools and the model's call format (`ToolCallParser`'s).
    """

    def __init__(self, model_name: str, parse_tools: bool, tool_names: Sequence[str] = (),
                 tool_format: ToolFormat | None = None) -> None:
        self.model_name = model_name
        self.parser = ToolCallParser(tool_names or None, tool_format) if parse_tools else None
        self.num_calls = 0
        self._next_index = 0

    def feed(self, result: Result) -> list[ChatGenerationChunk]:
        """The chunks this result produces (none while a possible tool call is held back)."""
        chunks: list[ChatGenerationChunk] = []
        text = result.get("text") or ""
        if text:
            delta = self.parser.push(text) if self.parser else ToolStreamDelta(content=text)
            if delta.content or delta.calls or delta.invalid:
                chunks.append(self._chunk(delta))
        if result["eos"]:
            rest = self.parser.finish() if self.parser else ToolStreamDelta()
            chunks.append(self._last_chunk(result, rest))
        return chunks

    def _chunk(self, delta: ToolStreamDelta) -> ChatGenerationChunk:
        return ChatGenerationChunk(message=AIMessageChunk(
            content=delta.content, tool_call_chunks=self._call_chunks(delta)))

    def _last_chunk(self, result: Result, rest: ToolStreamDelta) -> ChatGenerationChunk:
        call_chunks = self._call_chunks(rest)
        message = AIMessageChunk(
            content=rest.content,
            tool_call_chunks=call_chunks,
            usage_metadata=usage_metadata(result),
            response_metadata=response_metadata(result, self.model_name, self.num_calls > 0),
            chunk_position="last",
        )
        return ChatGenerationChunk(message=message)

    def _call_chunks(self, delta: ToolStreamDelta) -> list[ToolCallChunk]:
        chunks = [tool_call_chunk(name=call.name, args=json.dumps(call.arguments), id=call.id,
                                  index=self._take_index()) for call in delta.calls]
        self.num_calls += len(delta.calls)
        # Args that are a JSON string, not an object, make LangChain file the chunk under
        # invalid_tool_calls, with the raw output kept for the caller to inspect.
        chunks += [tool_call_chunk(name=None, args=json.dumps(bad.text), id=bad.id,
                                   index=self._take_index()) for bad in delta.invalid]
        return chunks

    def _take_index(self) -> int:
        self._next_index += 1
        return self._next_index - 1
