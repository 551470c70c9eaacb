"""The requests the server reads, as pydantic models: ``/v1/chat/completions``
(`ChatCompletionRequest`) and ``/v1/completions`` (`CompletionRequest`).

Fields follow OpenAI's API reference; dyngen extensions (``top_k``, ``min_p``,
``repetition_penalty``, and vLLM's ``ignore_eos`` for benchmarks that need fixed lengths) are
marked. A value out of range or of the wrong type is a 400 naming
the field. Fields OpenAI defines that the server does not implement (``best_of`` > n,
``suffix``, ``echo``, audio, images) are refused with a 400 naming them rather than ignored;
fields OpenAI clients send that change nothing here (``user``, ``metadata``, ``store``,
``service_tier``) are accepted and ignored, as are unknown ones.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)

# At most this many stop sequences, as OpenAI allows.
MAX_STOPS = 4
# At most this many top logprobs per token (OpenAI: 20 for chat, 5 for completions).
MAX_TOP_LOGPROBS = 20


class _Lenient(BaseModel):
    """Unknown fields are ignored (clients send vendor extensions)."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)


class FunctionDefinition(_Lenient):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDefinition(_Lenient):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class FunctionCall(_Lenient):
    name: str
    arguments: str | dict[str, Any] = "{}"


class ToolCallMessage(_Lenient):
    """A tool call in an assistant message of the history."""

    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ContentPart(_Lenient):
    """One part of a message's content; only ``text`` parts (text-only models)."""

    type: Literal["text"]
    text: str


class ChatMessage(_Lenient):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallMessage] | None = None
    tool_call_id: str | None = None

    def text(self) -> str:
        """The content as one string (text parts joined)."""
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class JsonSchemaFormat(_Lenient):
    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] = Field(default_factory=lambda: {"type": "object"}, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Lenient):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("type 'json_schema' needs a 'json_schema' object with a 'schema'")
        return self


class StreamOptions(_Lenient):
    include_usage: bool = False


class GenerationRequest(_Lenient):
    """The fields both endpoints share."""

    model: str
    n: int = Field(default=1, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: list[str] = Field(default_factory=list)
    seed: int | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=0, description="dyngen extension")
    min_p: float | None = Field(default=None, ge=0, le=1, description="dyngen extension")
    repetition_penalty: float | None = Field(default=None, gt=0,
                                             description="dyngen extension")
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)
    logit_bias: dict[str, float] | None = None
    ignore_eos: bool = Field(default=False, description="dyngen extension, as vLLM's: "
                             "generate past the model's end-of-sequence tokens (until "
                             "max_tokens or a stop string)")
    user: str | None = None

    @field_validator("stop", mode="before")
    @classmethod
    def _stops(cls, value: Any) -> Any:
        stops = [value] if isinstance(value, str) else value if value is not None else []
        if not isinstance(stops, list):
            return stops  # the list type's own check reports it
        if len(stops) > MAX_STOPS:
            raise ValueError(f"at most {MAX_STOPS} stop sequences; got {len(stops)}")
        return [s for s in stops if s != ""]

    @field_validator("logit_bias")
    @classmethod
    def _biases(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        for token, bias in (value or {}).items():
            if not token.isdigit():
                raise ValueError(f"keys are token ids (as strings); got {token!r}")
            if not -100 <= bias <= 100:
                raise ValueError(f"biases are in [-100, 100]; token {token} has {bias}")
        return value

    @property
    def include_usage(self) -> bool:
        """Whether a stream ends with a usage chunk."""
        return bool(self.stream_options and self.stream_options.include_usage)


class ChatCompletionRequest(GenerationRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    tools: list[ToolDefinition] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormat | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    audio: dict[str, Any] | None = None
    modalities: list[str] | None = None

    @field_validator("top_logprobs")
    @classmethod
    def _top_needs_logprobs(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value and not info.data.get("logprobs"):
            raise ValueError("top_logprobs needs logprobs: true")
        return value

    @field_validator("audio", "modalities")
    @classmethod
    def _text_only(cls, value: Any) -> Any:
        if value is not None and value != ["text"]:
            raise ValueError("audio output is not supported: dyngen serves text-only models")
        return value

    @property
    def token_budget(self) -> int | None:
        """max_completion_tokens, else the deprecated max_tokens, else None (the context)."""
        return self.max_completion_tokens or self.max_tokens


class CompletionRequest(GenerationRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(default=16, ge=1)
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = Field(default=None, ge=1)

    @field_validator("prompt")
    @classmethod
    def _not_empty(cls, value: Any) -> Any:
        if isinstance(value, list) and (not value or any(v == [] for v in value)):
            raise ValueError("a prompt is empty; send text or at least one token id")
        return value

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, value: bool) -> bool:
        if value:
            raise ValueError("echo is not supported; prepend the prompt to the text yourself")
        return value

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, value: str | None) -> str | None:
        if value:
            raise ValueError("suffix (fill-in-the-middle) is not supported")
        return value

    @field_validator("best_of")
    @classmethod
    def _best_of_is_n(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value is not None and value != info.data.get("n", 1):
            raise ValueError("best_of other than n is not supported; ask for n choices")
        return value

    def prompts(self) -> list[str | list[int]]:
        """Each prompt, as text or token ids."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if all(isinstance(p, int) for p in prompt):
            return [list(prompt)]  # type: ignore[arg-type]
        return list(prompt)  # type: ignore[arg-type]
