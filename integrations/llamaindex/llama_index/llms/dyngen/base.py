"""`DynGenLLM`: a LlamaIndex `FunctionCallingLLM` on dyngen's shared job queue.

Every call — sync, async, streaming, from any thread — becomes one `Job` submitted to the
process-wide `BackgroundGenerator` for the model folder (`shared_generator`), so concurrent
calls from a query engine batch together and prompts that share a prefix share cache pages.
Async methods hand their jobs over grouped per event-loop iteration (`JobSubmitter`) and await
the job's handle: they never block the event loop.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Generator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from llama_index.core.base.llms.types import (
    ChatMessage,
    ChatResponse,
    ChatResponseAsyncGen,
    ChatResponseGen,
    CompletionResponse,
    CompletionResponseAsyncGen,
    CompletionResponseGen,
    LLMMetadata,
)
from llama_index.core.bridge.pydantic import BaseModel, Field, PrivateAttr, model_validator
from llama_index.core.llms.callbacks import llm_chat_callback, llm_completion_callback
from llama_index.core.llms.function_calling import FunctionCallingLLM
from llama_index.core.llms.llm import ToolSelection
from llama_index.core.program.utils import FlexibleModel
from llama_index.core.prompts.base import BasePromptTemplate
from llama_index.core.types import PydanticProgramMode
from llama_index.llms.dyngen.chat import ChatTurn, prepare_turn
from llama_index.llms.dyngen.params import take_call_options
from llama_index.llms.dyngen.responses import (
    achat_stream,
    acompletion_stream,
    chat_stream,
    completion_stream,
)
from llama_index.llms.dyngen.streams import await_final, metrics, wait_final
from llama_index.llms.dyngen.structured import (
    astream_objects,
    parse_final,
    schema_messages,
    stream_objects,
    structured_kwargs,
)
from llama_index.llms.dyngen.submit import JobSubmitter, gather_engine_options
from llama_index.llms.dyngen.tool_calling import (
    prepare_tools_kwargs,
    tool_selections,
    validate_tool_response,
)

from dyngen_core import BackgroundGenerator, EngineOptions, JobHandle

if TYPE_CHECKING:
    from llama_index.core.tools.types import BaseTool

Model = TypeVar("Model", bound=BaseModel)


class DynGenLLM(FunctionCallingLLM):
    """A local model served by dyngen's dynamic-batching engine.

    Args:
        model_dir: folder of a Hugging Face Llama-family model (config.json, safetensors,
            tokenizer.json); `dyngen fetch-demo-model` gives a small one.
        max_tokens: most tokens generated per call (LlamaIndex's ``num_output``).
        temperature, top_p, top_k, min_p, repetition_penalty: sampling; None keeps the model's
            generation_config.json default. temperature 0 is greedy.
        seed: makes sampling reproducible, whatever else shares the batch.
        stop: strings that end generation (the model's end-of-turn tokens always do).
        context_window: report a smaller window to LlamaIndex than the model and cache allow
            (it decides how much retrieved text to pack into one prompt).
        timeout: seconds a call may take (a stream: counted from its first read); the job is
            then cancelled and TimeoutError raised. None (default): no limit.
        engine_options: an `EngineOptions` (or dict); or give its fields directly
            (cache_tokens, cache_mode, device, dtype, max_batch_size, max_chunk_size,
            attention_backend, dedup, prompt_cache; for speculative decoding
            draft_model_dir, use_ngram_draft, num_draft_tokens; tensor_parallel to split
            the model over that many processes of this host, one per GPU), which win over
            ``engine_options``; a bad value raises pydantic's ValidationError naming it.
            LLMs on the same folder with the same engine options share one engine — with
            each other and with dyngen's LangChain classes.

    Every generation field can be overridden per call as a keyword argument, as can
    ``constraint`` (a JSON schema dict, pydantic class, regex or choices; see
    `dyngen_core.constraints`), ``banned_strings`` and ``min_tokens``.
    """

    model_dir: str = Field(description="Folder of the model (config.json, weights, tokenizer).")
    max_tokens: int = Field(default=256, gt=0, description="Most tokens generated per call.")
    # Ranges are checked by SamplerSettings at construction, with the engine's own messages.
    temperature: float | None = Field(default=None, description="0 is greedy.")
    top_p: float | None = Field(default=None, description="Nucleus mass (0 or 1 = off).")
    top_k: int | None = Field(default=None, description="Keep the k likeliest (0 = off).")
    min_p: float | None = Field(default=None, description="Relative probability floor.")
    repetition_penalty: float | None = Field(default=None, description="> 1 discourages.")
    seed: int | None = Field(default=None)
    stop: list[str] = Field(default_factory=list, description="Strings that end generation.")
    context_window: int | None = Field(default=None, gt=0)
    timeout: float | None = Field(default=None, gt=0,
                                  description="Seconds a call may take (then TimeoutError).")
    engine_options: EngineOptions = Field(default_factory=EngineOptions)

    _jobs: JobSubmitter = PrivateAttr()
    _metadata: LLMMetadata = PrivateAttr()

    @model_validator(mode="before")
    @classmethod
    def _gather_engine_options(cls, data: Any) -> Any:
        return gather_engine_options(data)

    def __init__(self, **data: Any) -> None:
        super().__init__(**data)
        folder = Path(self.model_dir)
        self._jobs = JobSubmitter(folder, self.engine_options)
        self._metadata = LLMMetadata(
            context_window=self.context_window or self._jobs.usable_window,
            num_output=self.max_tokens,
            is_chat_model=True,
            is_function_calling_model=True,
            model_name=folder.resolve().name,
        )
        self._jobs.check(self._fields({}, "__init__"))

    @classmethod
    def class_name(cls) -> str:
        return "DynGenLLM"

    @property
    def metadata(self) -> LLMMetadata:
        return self._metadata

    def tokenize(self, text: str) -> list[int]:
        """The model's token ids for ``text``; ``Settings.tokenizer = llm.tokenize`` makes
        LlamaIndex count tokens (chunking, prompt packing) the way this model does."""
        return list(self._jobs.tokenizer.encode(text))

    @property
    def engine(self) -> BackgroundGenerator:
        """The shared `BackgroundGenerator` this LLM submits to now (for stats or direct jobs);
        a closed or stopped engine is replaced by a new one on the next call."""
        return self._jobs.engine

    # ---- completion ------------------------------------------------------------------------

    @llm_completion_callback()
    def complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        handle = self._submit_text(prompt, formatted, kwargs, "complete")
        final = wait_final(handle, self.timeout)
        return CompletionResponse(text=final["full_completion"], raw=metrics(final))

    @llm_completion_callback()
    def stream_complete(
        self, prompt: str, formatted: bool = False, **kwargs: Any
    ) -> CompletionResponseGen:
        handle = self._submit_text(prompt, formatted, kwargs, "stream_complete")
        return completion_stream(handle, self.timeout)

    @llm_completion_callback()
    async def acomplete(
        self, prompt: str, formatted: bool = False, **kwargs: Any
    ) -> CompletionResponse:
        handle = await self._asubmit_text(prompt, formatted, kwargs, "acomplete")
        final = await await_final(handle, self.timeout)
        return CompletionResponse(text=final["full_completion"], raw=metrics(final))

    @llm_completion_callback()
    async def astream_complete(
        self, prompt: str, formatted: bool = False, **kwargs: Any
    ) -> CompletionResponseAsyncGen:
        handle = await self._asubmit_text(prompt, formatted, kwargs, "astream_complete")
        return acompletion_stream(handle, self.timeout)

    # ---- chat ------------------------------------------------------------------------------

    @llm_chat_callback()
    def chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        turn, handle = self._submit_chat(messages, kwargs, "chat")
        final = wait_final(handle, self.timeout)
        return turn.response(final["full_completion"], raw=metrics(final))

    @llm_chat_callback()
    def stream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseGen:
        return chat_stream(*self._submit_chat(messages, kwargs, "stream_chat"), self.timeout)

    @llm_chat_callback()
    async def achat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        turn, handle = await self._asubmit_chat(messages, kwargs, "achat")
        final = await await_final(handle, self.timeout)
        return turn.response(final["full_completion"], raw=metrics(final))

    @llm_chat_callback()
    async def astream_chat(
        self, messages: Sequence[ChatMessage], **kwargs: Any
    ) -> ChatResponseAsyncGen:
        turn, handle = await self._asubmit_chat(messages, kwargs, "astream_chat")
        return achat_stream(turn, handle, self.timeout)

    # ---- tools -----------------------------------------------------------------------------

    def _prepare_chat_with_tools(
        self,
        tools: Sequence[BaseTool],
        user_msg: str | ChatMessage | None = None,
        chat_history: list[ChatMessage] | None = None,
        verbose: bool = False,
        allow_parallel_tool_calls: bool = False,
        tool_required: bool = False,
        tool_choice: str | dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> dict[str, Any]:
        """Chat keyword arguments for a tool-calling turn.

        tool_required (or tool_choice "required"): the reply must be a tool call; tool_choice
        may also name one tool, or be "none". The call is then enforced by constrained
        decoding, so its arguments always match the tool's schema.
        allow_parallel_tool_calls: let one reply hold several calls.
        """
        return prepare_tools_kwargs(
            tools, user_msg, chat_history,
            allow_parallel_tool_calls=allow_parallel_tool_calls,
            tool_required=tool_required, tool_choice=tool_choice, extra=kwargs,
        )

    def _validate_chat_with_tools_response(
        self,
        response: ChatResponse,
        tools: Sequence[BaseTool],
        allow_parallel_tool_calls: bool = False,
        **kwargs: Any,
    ) -> ChatResponse:
        return validate_tool_response(response, allow_parallel_tool_calls)

    def get_tool_calls_from_response(
        self, response: ChatResponse, error_on_no_tool_call: bool = True, **kwargs: Any
    ) -> list[ToolSelection]:
        """The tool calls in a response, also a partial one from a stream (calls still being
        written come back with the arguments written so far)."""
        return tool_selections(response, error_on_no_tool_call)

    # ---- structured output -----------------------------------------------------------------

    def structured_predict(
        self, output_cls: type[Model], prompt: BasePromptTemplate,
        llm_kwargs: dict[str, Any] | None = None, **prompt_args: Any,
    ) -> Model:
        """An ``output_cls`` object decoded under its JSON schema (constrained decoding).

        Other ``pydantic_program_mode`` values than DEFAULT take LlamaIndex's own route."""
        if self.pydantic_program_mode != PydanticProgramMode.DEFAULT:
            return super().structured_predict(output_cls, prompt, llm_kwargs, **prompt_args)
        messages = self._structured_messages(output_cls, prompt, prompt_args)
        response = self.chat(messages, **structured_kwargs(output_cls, llm_kwargs))
        return parse_final(response, output_cls)

    async def astructured_predict(
        self, output_cls: type[Model], prompt: BasePromptTemplate,
        llm_kwargs: dict[str, Any] | None = None, **prompt_args: Any,
    ) -> Model:
        """Async `structured_predict`."""
        if self.pydantic_program_mode != PydanticProgramMode.DEFAULT:
            return await super().astructured_predict(
                output_cls, prompt, llm_kwargs, **prompt_args)
        messages = self._structured_messages(output_cls, prompt, prompt_args)
        response = await self.achat(messages, **structured_kwargs(output_cls, llm_kwargs))
        return parse_final(response, output_cls)

    def stream_structured_predict(
        self, output_cls: type[Model], prompt: BasePromptTemplate,
        llm_kwargs: dict[str, Any] | None = None, **prompt_args: Any,
    ) -> Generator[Model | FlexibleModel, None, None]:
        """Partial objects (every field optional) as the reply streams, then the object."""
        if self.pydantic_program_mode != PydanticProgramMode.DEFAULT:
            return super().stream_structured_predict(
                output_cls, prompt, llm_kwargs, **prompt_args)
        messages = self._structured_messages(output_cls, prompt, prompt_args)
        responses = self.stream_chat(messages, **structured_kwargs(output_cls, llm_kwargs))
        return stream_objects(responses, output_cls)

    async def astream_structured_predict(
        self, output_cls: type[Model], prompt: BasePromptTemplate,
        llm_kwargs: dict[str, Any] | None = None, **prompt_args: Any,
    ) -> AsyncGenerator[Model | FlexibleModel, None]:
        """Async `stream_structured_predict`."""
        if self.pydantic_program_mode != PydanticProgramMode.DEFAULT:
            return await super().astream_structured_predict(
                output_cls, prompt, llm_kwargs, **prompt_args)
        messages = self._structured_messages(output_cls, prompt, prompt_args)
        responses = await self.astream_chat(
            messages, **structured_kwargs(output_cls, llm_kwargs))
        return astream_objects(responses, output_cls)

    def _structured_messages(
        self, output_cls: type[BaseModel], prompt: BasePromptTemplate, args: dict[str, Any]
    ) -> list[ChatMessage]:
        messages = self._extend_messages(prompt.format_messages(llm=self, **args))
        return schema_messages(messages, output_cls)

    # ---- helpers ---------------------------------------------------------------------------

    def _fields(self, kwargs: dict[str, Any], method: str) -> dict[str, Any]:
        """The LLM's generation fields overridden by the call's keywords (unknown ones raise)."""
        fields = {
            "max_tokens": self.max_tokens, "temperature": self.temperature,
            "top_p": self.top_p, "top_k": self.top_k, "min_p": self.min_p,
            "repetition_penalty": self.repetition_penalty, "seed": self.seed,
            "stop": list(self.stop),
        }
        fields.update(take_call_options(kwargs, method))
        return fields

    def _text_ids(self, prompt: str, formatted: bool) -> list[int]:
        to_prompt = self.completion_to_prompt
        text = prompt if formatted or to_prompt is None else to_prompt(prompt)
        return self._jobs.text_ids(text)

    def _submit_text(
        self, prompt: str, formatted: bool, kwargs: dict[str, Any], method: str
    ) -> JobHandle:
        fields = self._fields(dict(kwargs), method)
        return self._jobs.submit(self._text_ids(prompt, formatted), fields)

    async def _asubmit_text(
        self, prompt: str, formatted: bool, kwargs: dict[str, Any], method: str
    ) -> JobHandle:
        fields = self._fields(dict(kwargs), method)
        return await self._jobs.asubmit(self._text_ids(prompt, formatted), fields)

    def _chat_turn(self, messages: Sequence[ChatMessage], kwargs: dict[str, Any], method: str
                   ) -> tuple[ChatTurn, dict[str, Any]]:
        kwargs = dict(kwargs)
        turn = prepare_turn(self._jobs.tokenizer, messages, kwargs, self.messages_to_prompt)
        return turn, self._fields(kwargs, method)

    def _submit_chat(
        self, messages: Sequence[ChatMessage], kwargs: dict[str, Any], method: str
    ) -> tuple[ChatTurn, JobHandle]:
        turn, fields = self._chat_turn(messages, kwargs, method)
        return turn, self._jobs.submit(turn.input_ids, fields, turn.constraint,
                                       turn.decode_special_tokens)

    async def _asubmit_chat(
        self, messages: Sequence[ChatMessage], kwargs: dict[str, Any], method: str
    ) -> tuple[ChatTurn, JobHandle]:
        turn, fields = self._chat_turn(messages, kwargs, method)
        return turn, await self._jobs.asubmit(turn.input_ids, fields, turn.constraint,
                                              turn.decode_special_tokens)
