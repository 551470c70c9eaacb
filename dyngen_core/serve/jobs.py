"""A validated request into what the engine runs: prompt token ids, and one `Job` per choice.

Chat messages go through the model's chat template the way the adapters render them: a
template that reads ``tools`` gets the tools (unless tool_choice is "none"); one that does
not gets `dyngen_core.tools.fallback_messages`. tool_choice, parallel tool calls and
``response_format`` are enforced by constrained decoding (`tool_choice_constraint`, in the
call format the template teaches, `tool_format_for`; a JSON schema for response_format).
Sampling fields lay over the model's generation_config.json defaults.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from dyngen_core import Job, SamplerSettings, Tokenizer
from dyngen_core.serve.errors import RequestError, blame
from dyngen_core.serve.schemas import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    GenerationRequest,
    ResponseFormat,
)
from dyngen_core.tools import (
    ToolFormat,
    ToolSpec,
    call_dict,
    normalize_tool_choice,
    render_chat_prompt,
    tool_choice_constraint,
    tool_format_for,
    tool_markers_are_special,
)

if TYPE_CHECKING:
    from dyngen_core import BackgroundGenerator

# The schema `response_format: {"type": "json_object"}` holds output to.
JSON_OBJECT: dict[str, Any] = {"type": "object"}


@dataclass(frozen=True)
class PreparedPrompt:
    """One prompt's jobs (one per choice) and how to read their output.

    prompt_ids: the prompt's token ids.
    jobs: the jobs, in choice order.
    parse_tools: read tool calls out of the output (tools were offered and may be called).
    top_logprobs: None when logprobs were not asked for, else how many alternatives per token.
    tool_names: the offered tools' names (bare or fenced JSON calls count only for these).
    tool_format: the model's call format, read from its chat template.
    """

    prompt_ids: list[int]
    jobs: list[Job]
    parse_tools: bool
    top_logprobs: int | None
    tool_names: tuple[str, ...] = ()
    tool_format: ToolFormat = ToolFormat()


def prepare_chat(engine: BackgroundGenerator, request: ChatCompletionRequest) -> PreparedPrompt:
    """The jobs for a chat completion request; raises `RequestError` naming a bad field."""
    tools, choice = _chat_tools(request)
    tokenizer = engine.tokenizer
    tool_format = tool_format_for(tokenizer.chat_template, tokenizer.piece_to_id)
    constraint = _chat_constraint(request, tools, choice, tool_format)
    prompt = _chat_prompt(tokenizer, request, tools, choice)
    top = (request.top_logprobs or 0) if request.logprobs else None
    parse_tools = bool(tools) and choice != "none"
    special = parse_tools and tool_markers_are_special(tokenizer, tool_format)
    jobs = _jobs(engine, request, prompt, request.token_budget, constraint, top,
                 decode_special_tokens=special)
    return PreparedPrompt(prompt, jobs, parse_tools, top, tuple(t.name for t in tools),
                          tool_format)


def prepare_completions(engine: BackgroundGenerator,
                        request: CompletionRequest) -> list[PreparedPrompt]:
    """The jobs for each prompt of a completions request."""
    prepared = []
    prompts = completion_prompt_ids(engine.tokenizer, request)
    for index, ids in enumerate(prompts):
        param = "prompt" if isinstance(request.prompt, str) else f"prompt.{index}"
        jobs = _jobs(engine, request, ids, request.max_tokens, None, request.logprobs,
                     prompt_param=param)
        prepared.append(PreparedPrompt(ids, jobs, False, request.logprobs))
    return prepared


def chat_prompt_ids(tokenizer: Tokenizer, request: ChatCompletionRequest) -> list[int]:
    """The prompt token ids the server runs for a chat request (the same rendering as
    `prepare_chat`: request routers hash these); raises `RequestError` naming a bad field."""
    tools, choice = _chat_tools(request)
    return _chat_prompt(tokenizer, request, tools, choice)


def completion_prompt_ids(tokenizer: Tokenizer, request: CompletionRequest) -> list[list[int]]:
    """The prompt token ids of each prompt of a completions request, as the server runs
    them; raises `RequestError` naming a bad (empty) prompt."""
    prompts = []
    for index, prompt in enumerate(request.prompts()):
        param = "prompt" if isinstance(request.prompt, str) else f"prompt.{index}"
        with blame(param):
            prompts.append(prompt if isinstance(prompt, list)
                           else _encode_text(tokenizer, prompt))
    return prompts


def _chat_tools(request: ChatCompletionRequest) -> tuple[list[ToolSpec], str]:
    """The request's tools and its normalized tool choice."""
    with blame("tools"):
        tools = [ToolSpec.from_dict(t.model_dump(exclude_none=True)) for t in
                 request.tools or ()]
    with blame("tool_choice"):
        choice = normalize_tool_choice(request.tool_choice, tools)
    return tools, choice


def _chat_prompt(tokenizer: Tokenizer, request: ChatCompletionRequest,
                 tools: Sequence[ToolSpec], choice: str) -> list[int]:
    with blame("messages"):
        return render_chat(tokenizer, request.messages, tools, choice)


def render_chat(tokenizer: Tokenizer, messages: Sequence[ChatMessage],
                tools: Sequence[ToolSpec], tool_choice: str) -> list[int]:
    """Prompt token ids for ``messages`` through the model's chat template.

    A template with tools support gets the tools unless tool_choice is "none"; the fallback
    prompt lists them under every tool_choice, so an agent loop's turns share a cached prefix.
    """
    return render_chat_prompt(tokenizer, [_template_message(m) for m in messages], tools,
                              tool_choice)


def _template_message(message: ChatMessage) -> dict[str, Any]:
    """An OpenAI message as the dict chat templates read (transformers' shape: a call's
    ``function.arguments`` is a dict; "developer" is "system")."""
    role = "system" if message.role == "developer" else message.role
    entry: dict[str, Any] = {"role": role, "content": message.text()}
    if message.tool_calls:
        entry["tool_calls"] = [
            {"id": call.id or "", "type": "function", "function": call_dict(call.model_dump())}
            for call in message.tool_calls]
    if message.role == "tool":
        entry["tool_call_id"] = message.tool_call_id or ""
    if message.name:
        entry["name"] = message.name
    return entry


def _chat_constraint(request: ChatCompletionRequest, tools: Sequence[ToolSpec],
                     choice: str, tool_format: ToolFormat) -> Any:
    """The job constraint: the response format's, else the tool choice's (in the model's
    call format)."""
    constraint = response_format_constraint(request.response_format)
    if constraint is None:
        return tool_choice_constraint(tools, choice, request.parallel_tool_calls is not False,
                                      tool_format)
    if tools and choice not in ("auto", "none"):
        raise RequestError("a forced tool call (tool_choice) and a response_format cannot be "
                           "combined; drop one of them", "response_format")
    return constraint


def response_format_constraint(response_format: ResponseFormat | None) -> Any:
    """The JSON schema a response format holds output to, or None for text."""
    if response_format is None or response_format.type == "text":
        return None
    if response_format.type == "json_object":
        return JSON_OBJECT
    assert response_format.json_schema is not None
    return response_format.json_schema.schema_


def _encode_text(tokenizer: Tokenizer, text: str) -> list[int]:
    if not text:
        raise RequestError("prompt is empty; send at least one character", "prompt")
    add_bos = bool(tokenizer.add_bos_token) and tokenizer.bos_token_id is not None
    return list(tokenizer.encode(text, add_bos=add_bos))


def _jobs(engine: BackgroundGenerator, request: GenerationRequest, prompt: list[int],
          budget: int | None, constraint: Any, top_logprobs: int | None,
          prompt_param: str = "messages", decode_special_tokens: bool = False) -> list[Job]:
    """One job per choice: choice i samples with seed + i when a seed is given;
    ``decode_special_tokens`` where the tool call markers are special tokens. The jobs stop
    at the tokenizer's end-of-sequence ids (unless the request says ``ignore_eos``) and the
    request's stop strings."""
    max_tokens = _max_tokens(engine, len(prompt), budget, prompt_param)
    settings = sampler_settings(request, engine.generation_defaults)
    eos = () if request.ignore_eos else engine.tokenizer.eos_token_ids
    stops = [*eos, *request.stop]
    jobs = []
    for index in range(request.n):
        with blame("messages" if prompt_param == "messages" else prompt_param):
            jobs.append(Job(
                input_ids=prompt, max_new_tokens=max_tokens, stop_conditions=stops,
                gen_settings=settings,
                seed=None if request.seed is None else request.seed + index,
                return_probs=top_logprobs is not None,
                return_top_tokens=top_logprobs or 0,
                constraint=constraint, identifier=index,
                decode_special_tokens=decode_special_tokens))
    return jobs


def _max_tokens(engine: BackgroundGenerator, prompt_tokens: int, budget: int | None,
                param: str) -> int:
    """The job's token budget: the one asked for, else what is left of the context."""
    room = engine.max_job_tokens - prompt_tokens
    if room < 1:
        raise RequestError(
            f"the prompt is {prompt_tokens} tokens, which leaves no room in this model's "
            f"context of {engine.max_job_tokens} tokens; shorten it", param,
            code="context_length_exceeded")
    if budget is None:
        return room
    if budget > room:
        raise RequestError(
            f"the prompt ({prompt_tokens} tokens) plus max_tokens ({budget}) exceeds this "
            f"model's context of {engine.max_job_tokens} tokens; ask for at most {room}",
            "max_tokens", code="context_length_exceeded")
    return budget


def sampler_settings(request: GenerationRequest,
                     defaults: Mapping[str, Any]) -> SamplerSettings | None:
    """The request's sampling fields over the model's defaults; None when none is set."""
    fields = request.model_dump(include={"temperature", "top_p", "top_k", "min_p",
                                         "repetition_penalty"})
    with blame("temperature"):
        settings = SamplerSettings.from_framework_fields(fields, defaults)
    extra: dict[str, Any] = {}
    if request.presence_penalty:
        extra["token_presence_penalty"] = request.presence_penalty
    if request.frequency_penalty:
        extra["token_frequency_penalty"] = request.frequency_penalty
    if request.logit_bias:
        extra["token_bias"] = {int(k): v for k, v in request.logit_bias.items()}
    if not extra:
        return settings
    base = settings or SamplerSettings.from_generation_config(defaults)
    with blame("logit_bias" if "token_bias" in extra else "presence_penalty"):
        return SamplerSettings(**{**base.model_dump(), **extra})
