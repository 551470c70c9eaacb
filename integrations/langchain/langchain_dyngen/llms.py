"""`DynGenLLM`: a LangChain text-completion LLM on dyngen's shared job queue."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from typing import TYPE_CHECKING, Any

from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun
from langchain_core.language_models import BaseLLM
from langchain_core.language_models.llms import LangSmithParams
from langchain_core.outputs import Generation, GenerationChunk, LLMResult
from pydantic import Field, PrivateAttr, field_validator, model_validator

from dyngen_core import EngineOptions, Result, Tokenizer
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
from langchain_dyngen._params import COMMON_CALL_OPTIONS, take_call_options
from langchain_dyngen._params import Generation as GenerationRequest
from langchain_dyngen._runs import aiterate_results, iterate_results, response_metadata

if TYPE_CHECKING:
    from dyngen_core import BackgroundGenerator, Job


class DynGenLLM(BaseLLM):
    """Text-completion LLM running a local Llama-family model on dyngen's engine.

    The prompt is the model's input as written (special-token markup such as ``<|im_start|>``
    is read as those tokens; a BOS token is added when the tokenizer config asks for one).
    ``generate``/``batch`` with many prompts submits them all in one step, so they run in one
    batch and share common prefixes. Same engine sharing as `ChatDynGen`.

    Example::

        from langchain_dyngen import DynGenLLM

        llm = DynGenLLM(model_dir="/models/SmolLM2-135M-Instruct", max_tokens=64, temperature=0)
        llm.invoke("The capital of France is")
        llm.batch([f"{n} + {n} =" for n in range(100)])

    Fields: ``model_dir`` (default: ``$DYNGEN_MODEL_DIR``), ``model_name``, ``max_tokens``,
    ``temperature``, ``top_p``, ``top_k``, ``min_p``, ``repetition_penalty``, ``seed``,
    ``stop``, ``timeout`` and ``engine_options`` (or its fields given flat) mean what they mean
    for `ChatDynGen`. Per-call options: the generation fields, ``model`` (another folder) and
    ``constraint``.
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
    timeout: float | None = Field(default=None, gt=0)
    engine_options: EngineOptions = Field(default_factory=EngineOptions)

    _tokenizer: Tokenizer | None = PrivateAttr(default=None)

    @model_validator(mode="before")
    @classmethod
    def _collect_engine_options(cls, data: Any) -> Any:
        if isinstance(data, dict):
            data = gather_engine_options(dict(data))
            reject_unknown_arguments(cls.__name__, data, [*cls.model_fields, *ENGINE_OPTION_NAMES])
        return data

    @field_validator("model_dir", mode="before")
    @classmethod
    def _check_model_dir(cls, value: Any) -> str:
        return check_model_dir(value)

    @classmethod
    def is_lc_serializable(cls) -> bool:
        return True

    @property
    def lc_secrets(self) -> dict[str, str]:
        return dict(SERIALIZED_SECRETS)

    def to_json(self) -> Any:
        return with_plain_engine_options(super().to_json())

    @property
    def _llm_type(self) -> str:
        return "dyngen"

    @property
    def _identifying_params(self) -> dict[str, Any]:
        return identifying_params(self)

    def _get_ls_params(self, stop: list[str] | None = None, **kwargs: Any) -> LangSmithParams:
        return LangSmithParams(**langsmith_params(self, "llm", stop, kwargs))  # type: ignore[typeddict-item]

    def get_token_ids(self, text: str) -> list[int]:
        """Token ids of ``text`` with this model's tokenizer (loads only the tokenizer)."""
        if self._tokenizer is None:
            self._tokenizer = Tokenizer.from_model_dir(self.model_dir)
        return self._tokenizer.encode(text)

    def _model_name(self, override: str | None) -> str:
        return model_name_for(self.model_dir, self.model_name, override)

    # ---- calls ---------------------------------------------------------------------------

    def _options(self, kwargs: dict[str, Any]) -> tuple[dict[str, Any], str]:
        options = take_call_options(kwargs, COMMON_CALL_OPTIONS, "DynGenLLM")
        override = options.get("model")
        return options, check_model_dir(override) if override else self.model_dir

    def _jobs(self, engine: BackgroundGenerator, prompts: list[str], stop: list[str] | None,
              options: dict[str, Any]) -> list[Job]:
        tokenizer = engine.tokenizer
        add_bos = bool(tokenizer.add_bos_token and tokenizer.bos_token_id is not None)
        request = GenerationRequest.from_fields(generation_fields(self), options, stop)
        return [request.job(engine, tokenizer.encode(p, add_bos=add_bos,
                                                     encode_special_tokens=True),
                            options.get("constraint")) for p in prompts]

    def _final_generation(self, text: str, final: Result, model_name: str) -> Generation:
        info = {**response_metadata(final, model_name),
                "usage": {"prompt_tokens": final["prompt_tokens"],
                          "completion_tokens": final["new_tokens"],
                          "cached_tokens": final["cached_tokens"]}}
        return Generation(text=text, generation_info=info)

    def _collect(self, results: Iterator[Result], model_name: str,
                 run_manager: CallbackManagerForLLMRun | None) -> Generation:
        final = None
        for final in results:
            text = final.get("text")
            if text and run_manager is not None:
                run_manager.on_llm_new_token(text)
        assert final is not None
        return self._final_generation(str(final["full_completion"]), final, model_name)

    async def _acollect(self, results: AsyncIterator[Result], model_name: str,
                        run_manager: AsyncCallbackManagerForLLMRun | None) -> Generation:
        final = None
        async for final in results:
            text = final.get("text")
            if text and run_manager is not None:
                await run_manager.on_llm_new_token(text)
        assert final is not None
        return self._final_generation(str(final["full_completion"]), final, model_name)

    def _generate(self, prompts: list[str], stop: list[str] | None = None,
                  run_manager: CallbackManagerForLLMRun | None = None,
                  **kwargs: Any) -> LLMResult:
        options, model_dir = self._options(kwargs)
        engine = engine_for(model_dir, self.engine_options)
        handles = engine.submit_many(self._jobs(engine, prompts, stop, options))
        name = self._model_name(options.get("model"))
        # One deadline for the whole call: every job's timeout starts now.
        streams = [iterate_results(h, self.timeout) for h in handles]
        try:
            generations = [self._collect(s, name, run_manager) for s in streams]
        finally:
            for handle in handles:
                handle.cancel()
        return _llm_result(generations, name)

    async def _agenerate(self, prompts: list[str], stop: list[str] | None = None,
                         run_manager: AsyncCallbackManagerForLLMRun | None = None,
                         **kwargs: Any) -> LLMResult:
        options, model_dir = self._options(kwargs)
        engine = await asyncio.to_thread(engine_for, model_dir, self.engine_options)
        handles = engine.submit_many(self._jobs(engine, prompts, stop, options))
        name = self._model_name(options.get("model"))
        streams = [aiterate_results(h, self.timeout) for h in handles]
        try:
            generations = await asyncio.gather(
                *(self._acollect(s, name, run_manager) for s in streams))
        finally:
            for handle in handles:
                handle.cancel()
        return _llm_result(list(generations), name)

    def _stream(self, prompt: str, stop: list[str] | None = None,
                run_manager: CallbackManagerForLLMRun | None = None,
                **kwargs: Any) -> Iterator[GenerationChunk]:
        options, model_dir = self._options(kwargs)
        engine = engine_for(model_dir, self.engine_options)
        (handle,) = engine.submit_many(self._jobs(engine, [prompt], stop, options))
        name = self._model_name(options.get("model"))
        for result in iterate_results(handle, self.timeout):
            chunk = _chunk(result, name)
            if chunk is not None:
                if run_manager is not None:
                    run_manager.on_llm_new_token(chunk.text, chunk=chunk)
                yield chunk

    async def _astream(self, prompt: str, stop: list[str] | None = None,
                       run_manager: AsyncCallbackManagerForLLMRun | None = None,
                       **kwargs: Any) -> AsyncIterator[GenerationChunk]:
        options, model_dir = self._options(kwargs)
        engine = await asyncio.to_thread(engine_for, model_dir, self.engine_options)
        (handle,) = engine.submit_many(self._jobs(engine, [prompt], stop, options))
        name = self._model_name(options.get("model"))
        async for result in aiterate_results(handle, self.timeout):
            chunk = _chunk(result, name)
            if chunk is not None:
                if run_manager is not None:
                    await run_manager.on_llm_new_token(chunk.text, chunk=chunk)
                yield chunk


def _chunk(result: Result, model_name: str) -> GenerationChunk | None:
    """A result's text as a chunk; the final one carries finish reason and token counts."""
    text = str(result.get("text") or "")
    if not result["eos"]:
        return GenerationChunk(text=text) if text else None
    info = {**response_metadata(result, model_name),
            "usage": {"prompt_tokens": result["prompt_tokens"],
                      "completion_tokens": result["new_tokens"],
                      "cached_tokens": result["cached_tokens"]}}
    return GenerationChunk(text=text, generation_info=info)


def _llm_result(generations: list[Generation], model_name: str) -> LLMResult:
    usage = {"prompt_tokens": 0, "completion_tokens": 0, "cached_tokens": 0}
    for generation in generations:
        for key in usage:
            usage[key] += int((generation.generation_info or {})["usage"][key])
    usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
    return LLMResult(generations=[[g] for g in generations],
                     llm_output={"token_usage": usage, "model_name": model_name})
