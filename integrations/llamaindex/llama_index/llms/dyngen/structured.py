"""Structured output by constrained decoding: the reply is decoded under the output class's
JSON schema, so it always parses (unless max_tokens cuts it short, which is reported).

LlamaIndex's default route for a function-calling LLM wraps the object in a tool call, and its
streaming form does not require the call; going straight to the schema is shorter for the model
and enforced in every form (sync, async, streaming).
"""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator, AsyncIterator, Generator, Iterator, Sequence
from typing import Any, TypeVar

from llama_index.core.base.llms.types import ChatMessage, ChatResponse, MessageRole, TextBlock
from llama_index.core.bridge.pydantic import BaseModel, ValidationError
from llama_index.core.llms.utils import parse_partial_json
from llama_index.core.program.utils import FlexibleModel, create_flexible_model

Model = TypeVar("Model", bound=BaseModel)

_INSTRUCTION = "Reply with one JSON object that matches this JSON schema:\n{schema}"


def schema_messages(
    messages: Sequence[ChatMessage], output_cls: type[BaseModel]
) -> list[ChatMessage]:
    """The conversation with the output schema stated in its last user turn.

    The constraint alone guarantees the form; stating the schema lets the model know what each
    field is for, so the values make sense.
    """
    note = _INSTRUCTION.format(schema=json.dumps(_untitled(output_cls.model_json_schema())))
    out = list(messages)
    if out and out[-1].role == MessageRole.USER:
        last = out[-1]
        blocks = [*last.blocks, TextBlock(text=f"\n\n{note}")]
        out[-1] = ChatMessage(role=last.role, blocks=blocks,
                              additional_kwargs=last.additional_kwargs)
    else:
        out.append(ChatMessage(role=MessageRole.USER, content=note))
    return out


def _untitled(schema: Any) -> Any:
    # pydantic titles ("Place" for `place`) say nothing new, and small models copy them as
    # the values.
    if isinstance(schema, list):
        return [_untitled(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    return {k: _untitled(v) for k, v in schema.items()
            if not (k == "title" and isinstance(v, str))}


def parse_final(response: ChatResponse, output_cls: type[Model]) -> Model:
    """The finished reply as an ``output_cls`` instance, or a clear error."""
    text = response.message.content or ""
    try:
        return output_cls.model_validate_json(text)
    except ValidationError as exc:
        reason = (response.raw or {}).get("eos_reason") if isinstance(response.raw, dict) else None
        hint = (" the reply was cut at max_tokens before the JSON closed; raise max_tokens"
                if reason in ("max_new_tokens", "constraint_incomplete") else "")
        raise ValueError(
            f"structured output for {output_cls.__name__} did not validate:{hint} "
            f"({exc.error_count()} error(s); reply: {text[:200]!r})"
        ) from exc


def parse_partial(text: str, output_cls: type[BaseModel]) -> FlexibleModel | None:
    """The fields written so far, as a flexible model (every field optional); None when
    nothing parses yet."""
    try:
        value = parse_partial_json(text)
    except (ValueError, TypeError):
        return None
    if not isinstance(value, dict):
        return None
    flexible: type[FlexibleModel] = create_flexible_model(output_cls)
    return flexible.model_validate(value)


def stream_objects(
    responses: Iterator[ChatResponse], output_cls: type[Model]
) -> Generator[Model | FlexibleModel, None, None]:
    """Partial objects while the reply streams (each one differing from the last), then the
    validated object."""
    last: ChatResponse | None = None
    shown: FlexibleModel | None = None
    for last in responses:
        partial = parse_partial(last.message.content or "", output_cls)
        if partial is not None and last.raw is None and partial != shown:
            shown = partial
            yield partial
    if last is not None:
        yield parse_final(last, output_cls)


async def astream_objects(
    responses: AsyncIterator[ChatResponse], output_cls: type[Model]
) -> AsyncGenerator[Model | FlexibleModel, None]:
    """Async form of `stream_objects`."""
    last: ChatResponse | None = None
    shown: FlexibleModel | None = None
    async for last in responses:
        partial = parse_partial(last.message.content or "", output_cls)
        if partial is not None and last.raw is None and partial != shown:
            shown = partial
            yield partial
    if last is not None:
        yield parse_final(last, output_cls)


def structured_kwargs(output_cls: type[BaseModel], llm_kwargs: dict[str, Any] | None
                      ) -> dict[str, Any]:
    """Chat keywords for a structured call: the caller's, with the schema as the constraint."""
    kwargs = dict(llm_kwargs or {})
    for key in ("tools", "tool_choice", "tool_required", "allow_parallel_tool_calls"):
        kwargs.pop(key, None)  # programs pass these; the schema replaces any tool route
    kwargs["constraint"] = closed_schema(output_cls.model_json_schema())
    return kwargs


def closed_schema(schema: Any) -> Any:
    """``schema`` with ``additionalProperties: false`` on every object that leaves it open.

    pydantic's schemas allow extra keys by default; under constraint a small model then keeps
    inventing fields until max_tokens cuts the JSON off. Validation still uses the class, so
    a model configured with ``extra="allow"`` loses nothing it needs.
    """
    if isinstance(schema, list):
        return [closed_schema(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {key: closed_schema(value) for key, value in schema.items()}
    if out.get("type") == "object" and "properties" in out:
        out.setdefault("additionalProperties", False)
    return out
