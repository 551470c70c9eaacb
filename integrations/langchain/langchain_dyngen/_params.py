"""Generation parameters: a model object's fields plus per-call overrides, turned into a `Job`.

Callers override fields per call as keyword arguments (``llm.invoke(p, max_tokens=8)`` or
``llm.bind(temperature=0)``). Sampling fields map onto `SamplerSettings` here, once: the fields
that are set go over the model's own defaults (its generation_config.json); when none is set
the engine uses those defaults itself.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from dyngen_core import FRAMEWORK_SAMPLING_FIELDS, Job, SamplerSettings

if TYPE_CHECKING:
    from dyngen_core import BackgroundGenerator

GENERATION_FIELDS: tuple[str, ...] = ("max_tokens", *FRAMEWORK_SAMPLING_FIELDS, "seed")
# Per-call options besides the generation fields: a model folder, a dyngen constraint, and
# `stream`, which LangChain itself may pass along.
COMMON_CALL_OPTIONS: tuple[str, ...] = (*GENERATION_FIELDS, "model", "constraint", "stream")


def take_call_options(
    kwargs: Mapping[str, Any], accepted: Sequence[str], method: str
) -> dict[str, Any]:
    """The per-call options in ``kwargs``; unknown keywords raise TypeError rather than being
    silently ignored."""
    unknown = sorted(k for k in kwargs if k not in accepted)
    if unknown:
        raise TypeError(
            f"{method} got unexpected keyword argument(s) {unknown}; accepted: "
            f"{', '.join(accepted)}"
        )
    return {k: v for k, v in kwargs.items() if v is not None or k == "constraint"}


@dataclass(frozen=True)
class Generation:
    """One call's generation request (fields after per-call overrides)."""

    max_tokens: int
    sampling: Mapping[str, Any]
    seed: int | None
    stop: tuple[str, ...]

    @classmethod
    def from_fields(
        cls, fields: Mapping[str, Any], overrides: Mapping[str, Any], stop: Sequence[str] | None
    ) -> Generation:
        """``fields``: the model object's generation fields; ``overrides``: per-call options;
        ``stop``: the call's stop sequences (None keeps the object's ``stop``)."""
        merged = {**fields, **{k: v for k, v in overrides.items() if k in GENERATION_FIELDS}}
        stops = fields.get("stop") if stop is None else stop
        if isinstance(stops, str):
            stops = [stops]
        max_tokens = merged["max_tokens"]
        if not isinstance(max_tokens, int) or max_tokens < 1:
            raise ValueError(f"max_tokens must be a positive int; got {max_tokens!r}")
        return cls(
            max_tokens=max_tokens,
            sampling={k: merged[k] for k in FRAMEWORK_SAMPLING_FIELDS
                      if merged.get(k) is not None},
            seed=merged.get("seed"),
            stop=tuple(s for s in (stops or ()) if s),
        )

    def sampler_settings(self, model_defaults: Mapping[str, Any]) -> SamplerSettings | None:
        """Settings for the set sampling fields over ``model_defaults`` (a generation_config
        mapping), or None when nothing is set."""
        return SamplerSettings.from_framework_fields(self.sampling, model_defaults)

    def job(self, engine: BackgroundGenerator, input_ids: Sequence[int],
            constraint: Any = None, decode_special_tokens: bool = False) -> Job:
        """A `Job` for ``input_ids`` on ``engine``: ends at the model's end-of-sequence tokens,
        at any stop sequence (cut from the text) or after max_tokens; it writes special tokens
        into its text when ``decode_special_tokens`` (tool call markers that are special)."""
        tokenizer = engine.tokenizer
        return Job(
            input_ids=list(input_ids),
            max_new_tokens=self.max_tokens,
            stop_conditions=[*tokenizer.eos_token_ids, *self.stop],
            gen_settings=self.sampler_settings(engine.generation_defaults),
            seed=self.seed,
            constraint=constraint,
            decode_special_tokens=decode_special_tokens,
        )
