"""Generation parameters: the LLM's fields plus per-call overrides, turned into a dyngen `Job`.

LlamaIndex callers pass overrides as keyword arguments (``llm.complete(p, max_tokens=8)``);
the names follow LlamaIndex / OpenAI usage and map onto `SamplerSettings` here, once.
Unset sampling fields keep the model's own defaults (its generation_config.json).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from dyngen_core import FRAMEWORK_SAMPLING_FIELDS, Job, SamplerSettings

GENERATION_FIELDS: tuple[str, ...] = ("max_tokens", *FRAMEWORK_SAMPLING_FIELDS, "seed", "stop")
# Job options a caller may pass per call, besides the generation fields.
JOB_OPTIONS: tuple[str, ...] = ("constraint", "banned_strings", "min_tokens")


def take_call_options(kwargs: dict[str, Any], method: str) -> dict[str, Any]:
    """Pop the generation fields and job options out of ``kwargs``; refuse anything else.

    Unknown keywords are errors rather than silently ignored: a misspelt ``temprature`` would
    otherwise change nothing and go unnoticed.
    """
    options = {k: kwargs.pop(k) for k in (*GENERATION_FIELDS, *JOB_OPTIONS) if k in kwargs}
    if kwargs:
        accepted = ", ".join((*GENERATION_FIELDS, *JOB_OPTIONS))
        raise TypeError(
            f"DynGenLLM.{method} got unexpected keyword argument(s) {sorted(kwargs)}; "
            f"accepted: {accepted}"
        )
    return options


def sampler_settings(
    fields: Mapping[str, Any], model_defaults: Mapping[str, Any]
) -> SamplerSettings | None:
    """`SamplerSettings` for the set sampling fields over the model's defaults, or None when
    nothing is set (the engine then uses the model's defaults itself)."""
    return SamplerSettings.from_framework_fields(fields, model_defaults)


def build_job(
    input_ids: Sequence[int],
    fields: Mapping[str, Any],
    *,
    stop_token_ids: Sequence[int],
    model_defaults: Mapping[str, Any],
    constraint: Any = None,
    decode_special_tokens: bool = False,
) -> Job:
    """A `Job` for ``input_ids`` with generation ``fields`` (the LLM's, overridden per call).

    ``constraint`` (from tool calling or structured output) wins over a per-call one.
    """
    stop = fields.get("stop") or []
    if isinstance(stop, str):
        stop = [stop]
    return Job(
        input_ids=list(input_ids),
        max_new_tokens=int(fields["max_tokens"]),
        min_new_tokens=int(fields.get("min_tokens") or 0),
        stop_conditions=[*stop_token_ids, *stop],
        gen_settings=sampler_settings(fields, model_defaults),
        seed=fields.get("seed"),
        banned_strings=fields.get("banned_strings"),
        constraint=constraint if constraint is not None else fields.get("constraint"),
        decode_special_tokens=decode_special_tokens,
    )
