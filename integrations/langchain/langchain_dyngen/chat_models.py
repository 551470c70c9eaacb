"""`ChatDynGen`: a LangChain chat model on dyngen's shared job queue."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun
from langchain_core.language_models import BaseChatModel, LanguageModelInput
from langchain_core.language_models.chat_models import LangSmithParams, generate_from_stream
from langchain_core.messages import AIMessage, BaseMessage
from langchain_core.outputs import ChatGenerationChunk, ChatResult
from langchain_core.runnables import Runnable, RunnableConfig
from langchain_core.runnables.config import get_config_list
from langchain_core.tools import BaseTool
from langchain_core.utils.function_calling import convert_to_openai_tool
from pydantic import Field, PrivateAttr, field_validator, model_validator

from dyngen_core import EngineOptions, Tokenizer
from dyngen_core.tools import (
    ToolFormat,
    ToolSpec,
    normalize_tool_choice,
    tool_choice_constraint,
    tool_format_for,
    tool_markers_are_special,
)
from langchain_dyngen._batch import coalesced_batch, run_coroutine_blocking, submit
from langchain_dyngen._chat_output import ChatChunker
from langchain_dyngen._engine import (
    ENGINE_OPTION_NAMES,
    SERIALIZED_SECRETS,
    check_model_dir,
    engine_for,
    gather_engine_options,
    generation_fields,
    identifying_params,
    langsmith_params,
    model_dir_from_env,
    model_name_for,
    reject_unknown_arguments,
    with_plain_engine_options,
)
from langchain_dyngen._messages import render_chat, tool_specs
from langchain_dyngen._params import COMMON_CALL_OPTIONS, Generation, take_call_options
from langchain_dyngen._runs import aiterate_results, iterate_results
from langchain_dyngen._structured import StructuredMethod, structured_runnable

if TYPE_CHECKING:
    from dyngen_core import BackgroundGenerator, Job, JobHandle

_CALL_OPTIONS = (*COMMON_CALL_OPTIONS, "tools", "tool_choice", "parallel_tool_calls")

@dataclass(frozen=True)
class _ChatCall:
    """One prepared call: the engine, the job, and how to read its output."""

    engine: BackgroundGenerator
    job: Job
    model_name: str
    parse_tools: bool
    tool_names: tuple[str, ...] = ()
    tool_format: ToolFormat | None = None


class ChatDynGen(BaseChatModel):
    """Chat model running a local Llama-family model on dyngen's dynamic-batching engine.

    Every call — invoke, batch, stream, async, from any thread — becomes a job in one shared
    queue per model folder and engine options, so concurrent prompts run in the same batch and
    prompts sharing a prefix (a RAG document) prefill it once. A second object for the same
    folder and options reuses the loaded engine.

    Setup: ``pip install langchain-dyngen``; ``dyngen fetch-demo-model`` prints a demo folder.

    Example::

        from langchain_dyngen import ChatDynGen

        chat = ChatDynGen(model_dir="/models/SmolLM2-135M-Instruct", max_tokens=128,
                          temperature=0.2, cache_tokens=16384)
        chat.invoke("What is a paged KV cache?").content
        answers = chat.batch([f"Question {i}" for i in range(64)])   # all 64 at once

    Generation fields (each may be overridden per call, e.g. ``invoke(..., max_tokens=8)``):
        max_tokens: most tokens generated per call.
        temperature, top_p, top_k, min_p, repetition_penalty: sampling (`SamplerSettings`
            temperature, top_p, top_k, min_p, token_repetition_penalty). Unset fields keep the
            model's generation_config.json defaults; temperature 0 is greedy.
        seed: makes sampling reproducible, whatever else shares the batch.
        stop: strings that end the reply (cut from it); a call's ``stop`` replaces them.

    Other fields:
        model_dir: the model folder (Hugging Face layout: config.json, safetensors, tokenizer);
            default ``$DYNGEN_MODEL_DIR``. Serialized (``dumpd``), the object names that
            variable in place of the folder; ``load(..., secrets_from_env=True)`` reads it back.
        model_name: the name reported in response metadata (default: the folder's name).
        streaming: make invoke stream internally (so callbacks see each token).
        timeout: seconds a call may take; the job is then cancelled and TimeoutError raised.
        engine_options: an `EngineOptions`; its fields (cache_tokens, cache_mode, device, dtype,
            max_batch_size, max_chunk_size, attention_backend, dedup, prompt_cache, for
            speculative decoding draft_model_dir, use_ngram_draft, num_draft_tokens, and
            tensor_parallel: split the model over that many processes of this host, one per
            GPU) may also be given flat to the constructor. A bad value raises pydantic's
            ValidationError naming the field.

    Per-call options: the generation fields, ``model`` (another model folder, same engine
    options), ``constraint`` (any `Job` constraint: JSON schema, pydantic class, regex,
    choices), and what `bind_tools` binds. Unknown options raise TypeError.

    Tools: `bind_tools` with tool_choice "auto", "none", "any"/"required" or a tool name, each
    enforced by constrained decoding; parallel calls; calls parsed into ``tool_calls`` with ids.
    A chat template without tools support gets the documented fallback prompt of
    `dyngen_core.tools` (the demo model's ChatML template is one). Structured output: see
    `with_structured_output`. Usage metadata counts prompt tokens served from the prefix cache
    as ``input_token_details["cache_read"]``.
    """

    model_dir: str = Field(default_factory=model_dir_from_env, validate_default=True)
    model_name: str | None = None
    max_tokens: int = Field(default=256, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    stop: list[str] | None = None
    streaming: bool = False
    timeout: float | None = Field(default=None, gt=0)
    engine_options: EngineOptions = Field(default_factory=EngineOptions)

    _tokenizer: Tokenizer | None = PrivateAttr(default=None)

    @model_validator(mode="before")
    @classmethod
    def _collect_engine_options(cls, data: Any) -> Any:
        if isinstance(data, dict):
            data = gather_engine_options(dict(data))
            accepted = [*cls.model_fields, *(f.alias for f in cls.model_fields.values()
                                             if f.alias)]
            reject_unknown_arguments(cls.__name__, data, [*accepted, *ENGINE_OPTION_NAMES])
        return data

    @field_validator("model_dir", mode="before")
    @classmethod
    def _check_model_dir(cls, value: Any) -> str:
        return check_model_dir(value)

    # ---- serialization ---------------------------------------------------------------------

    @classmethod
    def is_lc_serializable(cls) -> bool:
        return True

    @property
    def lc_secrets(self) -> dict[str, str]:
        return dict(SERIALIZED_SECRETS)

    def to_json(self) -> Any:
        return with_plain_engine_options(super().to_json())

    # ---- identity ------------------------------------------------------------------------

    @property
    def _llm_type(self) -> str:
        return "dyngen-chat"

    @property
    def _identifying_params(self) -> dict[str, Any]:
        return identifying_params(self)

    def _get_ls_params(self, stop: list[str] | None = None, **kwargs: Any) -> LangSmithParams:
        return LangSmithParams(**langsmith_params(self, "chat", stop, kwargs))  # type: ignore[typeddict-item]

    def get_token_ids(self, text: str) -> list[int]:
        """Token ids of ``text`` with this model's tokenizer (loads only the tokenizer)."""
        if self._tokenizer is None:
            self._tokenizer = Tokenizer.from_model_dir(self.model_dir)
        return self._tokenizer.encode(text)

    def _model_name(self, override: str | None) -> str:
        return model_name_for(self.model_dir, self.model_name, override)

    # ---- calls ---------------------------------------------------------------------------

    def _model_dir_for(self, options: dict[str, Any]) -> str:
        override = options.get("model")
        return check_model_dir(override) if override else self.model_dir

    def _prepare(self, engine: BackgroundGenerator, messages: list[BaseMessage],
                 stop: list[str] | None, options: dict[str, Any]) -> _ChatCall:
        tools = tool_specs(options.get("tools"))
        choice = normalize_tool_choice(options.get("tool_choice"), tools)
        constraint = options.get("constraint")
        tokenizer = engine.tokenizer
        tool_format = tool_format_for(tokenizer.chat_template, tokenizer.piece_to_id)
        if constraint is None:
            constraint = tool_choice_constraint(
                tools, choice, options.get("parallel_tool_calls", True), tool_format)
        elif tools and choice not in ("auto", "none"):
            raise ValueError("a forced tool call (tool_choice) and a constraint cannot be "
                             "combined; drop one of them")
        prompt = render_chat(engine.tokenizer, messages, tools, choice)
        generation = Generation.from_fields(generation_fields(self), options, stop)
        parse_tools = bool(tools) and choice != "none"
        special = parse_tools and tool_markers_are_special(tokenizer, tool_format)
        return _ChatCall(engine, generation.job(engine, prompt, constraint, special),
                         self._model_name(options.get("model")),
                         parse_tools=parse_tools,
                         tool_names=tuple(t.name for t in tools), tool_format=tool_format)

    def _start(self, messages: list[BaseMessage], stop: list[str] | None,
               kwargs: dict[str, Any]) -> tuple[_ChatCall, JobHandle]:
        options = take_call_options(kwargs, _CALL_OPTIONS, "ChatDynGen")
        engine = engine_for(self._model_dir_for(options), self.engine_options)
        call = self._prepare(engine, messages, stop, options)
        return call, engine.submit(call.job)

    async def _astart(self, messages: list[BaseMessage], stop: list[str] | None,
                      kwargs: dict[str, Any]) -> tuple[_ChatCall, JobHandle]:
        options = take_call_options(kwargs, _CALL_OPTIONS, "ChatDynGen")
        # The first call loads the model: off the event loop.
        engine = await asyncio.to_thread(engine_for, self._model_dir_for(options),
                                         self.engine_options)
        call = self._prepare(engine, messages, stop, options)
        return call, await submit(engine, call.job)

    def _stream(self, messages: list[BaseMessage], stop: list[str] | None = None,
                run_manager: CallbackManagerForLLMRun | None = None,
                **kwargs: Any) -> Iterator[ChatGenerationChunk]:
        call, handle = self._start(messages, stop, kwargs)
        chunker = ChatChunker(call.model_name, call.parse_tools, call.tool_names,
                              call.tool_format)
        for result in iterate_results(handle, self.timeout):
            for chunk in chunker.feed(result):
                if run_manager is not None:
                    run_manager.on_llm_new_token(chunk.text, chunk=chunk)
                yield chunk

    async def _astream(self, messages: list[BaseMessage], stop: list[str] | None = None,
                       run_manager: AsyncCallbackManagerForLLMRun | None = None,
                       **kwargs: Any) -> AsyncIterator[ChatGenerationChunk]:
        call, handle = await self._astart(messages, stop, kwargs)
        chunker = ChatChunker(call.model_name, call.parse_tools, call.tool_names,
                              call.tool_format)
        async for result in aiterate_results(handle, self.timeout):
            for chunk in chunker.feed(result):
                if run_manager is not None:
                    await run_manager.on_llm_new_token(chunk.text, chunk=chunk)
                yield chunk

    def _generate(self, messages: list[BaseMessage], stop: list[str] | None = None,
                  run_manager: CallbackManagerForLLMRun | None = None,
                  **kwargs: Any) -> ChatResult:
        return generate_from_stream(self._stream(messages, stop, run_manager, **kwargs))

    async def _agenerate(self, messages: list[BaseMessage], stop: list[str] | None = None,
                         run_manager: AsyncCallbackManagerForLLMRun | None = None,
                         **kwargs: Any) -> ChatResult:
        chunks = [c async for c in self._astream(messages, stop, run_manager, **kwargs)]
        return generate_from_stream(iter(chunks))

    def batch(self, inputs: list[LanguageModelInput],
              config: RunnableConfig | list[RunnableConfig] | None = None, *,
              return_exceptions: bool = False, **kwargs: Any) -> list[AIMessage]:
        """Run every input at once: all jobs enter the engine's queue together (LangChain's
        default thread pool would feed it a few at a time). Runs `abatch` on a private event
        loop; per-input configs and callbacks are honoured."""
        if not inputs:
            return []
        return run_coroutine_blocking(lambda: self.abatch(
            inputs, config, return_exceptions=return_exceptions, **kwargs))

    async def abatch(self, inputs: list[LanguageModelInput],
                     config: RunnableConfig | list[RunnableConfig] | None = None, *,
                     return_exceptions: bool = False, **kwargs: Any) -> list[AIMessage]:
        """Run every input concurrently and submit their jobs to the engine in one call, so
        they enter the same scheduling step. A ``max_concurrency`` in the config is honoured
        (then inputs run in LangChain's usual way, at most that many at a time)."""
        configs = get_config_list(config, len(inputs))
        if not inputs or configs[0].get("max_concurrency") is not None:
            return await super().abatch(inputs, config, return_exceptions=return_exceptions,
                                        **kwargs)
        results = await coalesced_batch(lambda item, cfg: self.ainvoke(item, cfg, **kwargs),
                                    inputs, configs, return_exceptions)
        return results  # type: ignore[return-value]

    # ---- tools and structured output -----------------------------------------------------

    def bind_tools(
        self,
        tools: Sequence[dict[str, Any] | type | Callable[..., Any] | BaseTool],
        *,
        tool_choice: str | dict[str, Any] | bool | None = None,
        parallel_tool_calls: bool | None = None,
        strict: bool | None = None,
        **kwargs: Any,
    ) -> Runnable[LanguageModelInput, AIMessage]:
        """Offer ``tools`` to the model.

        tools: LangChain tools, functions, pydantic classes, TypedDicts or OpenAI tool dicts.
        tool_choice: "auto" (default; the model decides), "none" (no call), "any"/"required"/
            True (at least one call) or a tool name (one call of it). Every choice is enforced
            by constrained decoding: a call, when made, always parses and matches its tool's
            schema ("auto" allows a call list or text that does not start with "[", "{" or a
            space; "none" only such text).
        parallel_tool_calls: allow several calls in one reply (default True; a named
            tool_choice always gives one call).
        strict: passed to `convert_to_openai_tool` (closes argument schemas); forced calls
            follow the schema either way.
        kwargs: further per-call options to bind.
        """
        formatted = [convert_to_openai_tool(tool, strict=strict) for tool in tools]
        normalize_tool_choice(tool_choice, [ToolSpec.from_dict(t) for t in formatted])
        return super().bind(tools=formatted, tool_choice=tool_choice,
                            parallel_tool_calls=parallel_tool_calls, **kwargs)

    def with_structured_output(
        self,
        schema: dict[str, Any] | type,
        *,
        include_raw: bool = False,
        method: StructuredMethod = "json_schema",
        strict: bool | None = None,
        **kwargs: Any,
    ) -> Runnable[LanguageModelInput, dict[str, Any] | Any]:
        """A runnable whose output follows ``schema`` (a pydantic class gives instances, a
        TypedDict or JSON schema gives dicts).

        method: "json_schema" (default: the reply is constrained to the schema),
            "function_calling" (the schema is a tool the model must call) or "json_mode" (the
            reply is constrained to a JSON object; describe the keys in the prompt).
        include_raw: return ``{"raw", "parsed", "parsing_error"}`` instead of raising on a
            parsing error.
        strict: accepted for compatibility; constrained decoding always enforces the schema.
        """
        if kwargs:
            raise ValueError(f"with_structured_output got unsupported arguments {kwargs}")
        return structured_runnable(self, schema, method, include_raw, strict)
