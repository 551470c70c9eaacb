"""Sampler settings (`SamplerSettings`) and the per-job sampling state (`SamplerState`).

Pure Python (pydantic, no torch): the control plane builds, validates and stores these; the data
plane sampler (`dyngen_core.sampling`) reads them. Field names follow ExLlamaV2's
``ExLlamaV2Sampler.Settings`` wherever it has one. Every field's default is *neutral* (the stage
is off), so ``SamplerSettings()`` samples from the model's plain softmax at temperature 1.

One settings object may serve many jobs: everything that depends on a job's history (penalty
windows, DRY matches, mirostat's running ``mu``) is computed from the job's tokens or kept in the
job's own `SamplerState`.

Stages run in the fixed order of `STAGE_ORDER` (see `dyngen_core.sampling` for the algorithms).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationInfo, field_validator

from dyngen_core.errors import JobError

#: Stage names in the order the sampler applies them (`SamplerSettings.active_stages`).
STAGE_ORDER: tuple[str, ...] = (
    "bias", "penalties", "dry", "temperature", "top_k", "top_p", "min_p", "typical", "tfs",
    "top_a", "xtc", "temperature_last", "mirostat",
)

DEFAULT_DRY_SEQUENCE_BREAKERS: tuple[str, ...] = ("\n", ":", '"', "*")
# The sampling names LangChain, LlamaIndex and OpenAI-style callers use -> SamplerSettings fields.
FRAMEWORK_SAMPLING_FIELDS: dict[str, str] = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "token_repetition_penalty",
}

_INF = math.inf
# field -> (low, high, low inclusive, high inclusive, what the neutral value means)
_RANGES: dict[str, tuple[float, float, bool, bool, str]] = {
    "temperature": (0, _INF, True, False, "0 = greedy, 1 = neutral"),
    "top_k": (0, _INF, True, False, "0 = off"),
    "top_p": (0, 1, True, True, "0 or 1 = off"),
    "min_p": (0, 1, True, True, "0 = off"),
    "typical": (0, 1, True, True, "0 or 1 = off"),
    "top_a": (0, 1, True, True, "0 = off"),
    "tfs": (0, 1, True, True, "0 or 1 = off"),
    "min_temp": (0, _INF, True, False, "dynamic temperature is on when max_temp > min_temp"),
    "max_temp": (0, _INF, True, False, "dynamic temperature is on when max_temp > min_temp"),
    "temp_exponent": (0, _INF, False, False, "1 = linear"),
    "token_repetition_penalty": (0, _INF, False, False, "1 = off"),
    "token_repetition_decay": (0, _INF, True, False, "0 = no decay"),
    "token_frequency_penalty": (-_INF, _INF, False, False, "0 = off"),
    "token_presence_penalty": (-_INF, _INF, False, False, "0 = off"),
    "dry_multiplier": (0, _INF, True, False, "0 = off"),
    "dry_base": (1, _INF, True, False, "1.75 is usual"),
    "dry_allowed_length": (1, _INF, True, False, "2 is usual"),
    "dry_range": (0, _INF, True, False, "0 = whole history"),
    "dry_max_ngram": (1, _INF, True, False, "20 is usual"),
    "xtc_probability": (0, 1, True, True, "0 = off"),
    "xtc_threshold": (0, 1, True, True, "0.1 is usual"),
    "mirostat_tau": (0, _INF, False, False, "target surprise in bits"),
    "mirostat_eta": (0, _INF, False, False, "learning rate"),
}


def _range_text(low: float, high: float, low_incl: bool, high_incl: bool) -> str:
    if high == _INF:
        return f"{'>=' if low_incl else '>'} {low:g}" if low != -_INF else "finite"
    return f"in {'[' if low_incl else '('}{low:g}, {high:g}{']' if high_incl else ')'}"


class SamplerSettings(BaseModel):
    """How to pick the next token. Frozen and validated; every default is neutral (stage off).

    Logit edits (applied first, in order):
        token_bias: ``{token_id: bias}`` added to those logits. Default ``{}``.
        banned_tokens: token ids that are never sampled. Default ``()``.
        token_repetition_penalty: HF-style multiplicative penalty (> 1 discourages repeats) for
            every token in the penalty window: positive logits are divided by it, negative ones
            multiplied. Default 1.0 (off).
        token_repetition_range: the last N history tokens (prompt + generated) get the full
            penalty; -1 (default) = the whole history.
        token_repetition_decay: beyond the range, the penalty fades linearly to neutral over this
            many more tokens (0 = no fade). Only meaningful with a range.
        token_frequency_penalty: subtracted from a token's logit once per occurrence in the
            window (OpenAI semantics). Default 0.0.
        token_presence_penalty: subtracted once from every token present in the window.
            Default 0.0.
        dry_multiplier, dry_base, dry_allowed_length, dry_sequence_breakers, dry_range,
            dry_max_ngram: DRY ("don't repeat yourself"). A token that would extend a repeat of
            the history's last ``n >= dry_allowed_length`` tokens gets
            ``dry_multiplier * dry_base ** (n - dry_allowed_length)`` subtracted. Sequence
            breakers end matches: strings match every token whose text contains them, ints are
            token ids. dry_range limits the search to the last N tokens (0 = all); matches are
            at most dry_max_ngram long. Default multiplier 0.0 (off), base 1.75, allowed length
            2, breakers ``("\\n", ":", '"', "*")``, range 0, max ngram 20.

    Distribution shaping (skipped entirely for greedy settings):
        temperature: logits are divided by it; 0 = greedy (argmax after the logit edits).
            Default 1.0.
        temperature_last: apply temperature after the truncation filters instead of before.
        min_temp, max_temp, temp_exponent: dynamic temperature, on when max_temp > min_temp:
            ``T = min_temp + (max_temp - min_temp) * (H / log n) ** temp_exponent`` where H is
            the entropy of the current distribution over its n candidates; replaces
            ``temperature``. Defaults 0.0, 0.0, 1.0.
        top_k: keep the k most likely tokens (0 = off).
        top_p: keep the smallest set of most likely tokens whose mass reaches top_p (0 or 1 =
            off).
        min_p: drop tokens less likely than ``min_p * p_max`` (0 = off).
        typical: locally typical sampling with this mass (0 or 1 = off).
        tfs: tail-free sampling with this threshold (0 or 1 = off).
        top_a: drop tokens less likely than ``top_a * p_max ** 2`` (0 = off).
        xtc_probability, xtc_threshold: XTC ("exclude top choices"): with probability
            xtc_probability, every token at least xtc_threshold likely except the least likely
            of them is removed (needs two such tokens; newline and EOS tokens are never
            removed). Defaults 0.0 (off) and 0.1.
        mirostat, mirostat_tau, mirostat_eta: Mirostat v2: keep tokens whose surprise
            (``-log2 p``) is at most the job's running ``mu`` (starts at ``2 * tau``), and move
            ``mu`` by ``eta * (tau - surprise)`` after each token. Defaults False, 1.5, 0.1.
    """

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    typical: float = 0.0
    top_a: float = 0.0
    tfs: float = 0.0
    temperature_last: bool = False
    min_temp: float = 0.0
    max_temp: float = 0.0
    temp_exponent: float = 1.0
    token_repetition_penalty: float = 1.0
    token_repetition_range: int = -1
    token_repetition_decay: int = 0
    token_frequency_penalty: float = 0.0
    token_presence_penalty: float = 0.0
    dry_multiplier: float = 0.0
    dry_base: float = 1.75
    dry_allowed_length: int = 2
    dry_sequence_breakers: tuple[str | int, ...] = DEFAULT_DRY_SEQUENCE_BREAKERS
    dry_range: int = 0
    dry_max_ngram: int = 20
    xtc_probability: float = 0.0
    xtc_threshold: float = 0.1
    mirostat: bool = False
    mirostat_tau: float = 1.5
    mirostat_eta: float = 0.1
    token_bias: dict[int, float] = {}
    banned_tokens: tuple[int, ...] = ()

    @field_validator(*_RANGES)
    @classmethod
    def _in_range(cls, value: float, info: ValidationInfo) -> float:
        name = info.field_name or "?"
        low, high, low_incl, high_incl, meaning = _RANGES[name]
        below = value < low or (value == low and not low_incl)
        above = value > high or (value == high and not high_incl)
        if below or above:
            raise ValueError(
                f"{name} must be {_range_text(low, high, low_incl, high_incl)} "
                f"({meaning}); got {value!r}"
            )
        return value

    @field_validator("token_repetition_range")
    @classmethod
    def _valid_range(cls, value: int) -> int:
        if value == 0 or value < -1:
            raise ValueError(
                "token_repetition_range must be -1 (the whole history) or >= 1 (the last N "
                f"tokens); got {value!r}"
            )
        return value

    @field_validator("token_bias")
    @classmethod
    def _valid_bias(cls, value: dict[int, float]) -> dict[int, float]:
        bad = [k for k in value if k < 0]
        if bad:
            raise ValueError(f"token_bias keys must be token ids >= 0; got {bad[:5]}")
        return dict(value)

    @field_validator("banned_tokens")
    @classmethod
    def _valid_banned(cls, value: tuple[int, ...]) -> tuple[int, ...]:
        bad = [t for t in value if t < 0]
        if bad:
            raise ValueError(f"banned_tokens must be token ids >= 0; got {bad[:5]}")
        return tuple(sorted(set(value)))

    @field_validator("dry_sequence_breakers")
    @classmethod
    def _valid_breakers(cls, value: tuple[str | int, ...]) -> tuple[str | int, ...]:
        for b in value:
            if (isinstance(b, str) and not b) or (isinstance(b, int) and b < 0):
                raise ValueError(
                    "dry_sequence_breakers holds non-empty strings and token ids >= 0; "
                    f"got {b!r}"
                )
        return value

    def __hash__(self) -> int:
        # Frozen settings are hashable (usable as dict keys) although token_bias is a dict.
        return hash(tuple(tuple(sorted(v.items())) if isinstance(v, dict) else v
                          for v in self.__dict__.values()))

    # ---- derived facts ----------------------------------------------------------------------

    @property
    def is_greedy(self) -> bool:
        """True when the token is the argmax after the logit edits (temperature 0 or top_k 1)."""
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def uses_dynamic_temperature(self) -> bool:
        return self.max_temp > self.min_temp

    def active_stages(self) -> frozenset[str]:
        """Names (from `STAGE_ORDER`) of the stages these settings switch on. A stage no row of
        a batch uses is skipped by the sampler, so it costs nothing."""
        on = {
            "bias": bool(self.token_bias or self.banned_tokens),
            "penalties": self.token_repetition_penalty != 1.0
            or self.token_frequency_penalty != 0.0 or self.token_presence_penalty != 0.0,
            "dry": self.dry_multiplier > 0.0,
        }
        if not self.is_greedy:
            scaled = self.temperature != 1.0 or self.uses_dynamic_temperature
            on |= {
                "temperature": scaled and not self.temperature_last,
                "temperature_last": scaled and self.temperature_last,
                "top_k": self.top_k > 1,
                "top_p": 0.0 < self.top_p < 1.0,
                "min_p": self.min_p > 0.0,
                "typical": 0.0 < self.typical < 1.0,
                "tfs": 0.0 < self.tfs < 1.0,
                "top_a": self.top_a > 0.0,
                "xtc": self.xtc_probability > 0.0,
                "mirostat": self.mirostat,
            }
        return frozenset(name for name, active in on.items() if active)

    def check_token_ids(self, vocab_size: int) -> None:
        """Raise `JobError` when token_bias, banned_tokens or integer DRY breakers name a token
        id outside ``[0, vocab_size)``. The generator calls this at enqueue."""
        fields: dict[str, list[int]] = {
            "token_bias": list(self.token_bias),
            "banned_tokens": list(self.banned_tokens),
            "dry_sequence_breakers": [b for b in self.dry_sequence_breakers
                                      if isinstance(b, int)],
        }
        for name, ids in fields.items():
            bad = [t for t in ids if t >= vocab_size]
            if bad:
                raise JobError(
                    f"{name} holds token ids {bad[:5]} outside the vocabulary "
                    f"(size {vocab_size}); use ids below {vocab_size}"
                )

    # ---- constructors -----------------------------------------------------------------------

    @classmethod
    def greedy(cls, **overrides: Any) -> SamplerSettings:
        """Greedy decoding (temperature 0); ``overrides`` may add penalties, bias or bans."""
        return cls(**{"temperature": 0.0, **overrides})

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> SamplerSettings:
        """A named preset, with ``overrides`` on top. Names: ``"greedy"``; ``"precise"``
        (temperature 0.3, top_p 0.9); ``"balanced"`` (temperature 0.7, top_p 0.9, min_p 0.05,
        repetition penalty 1.05); ``"creative"`` (temperature 1.0, min_p 0.05, DRY 0.8, XTC
        0.5/0.1)."""
        presets: dict[str, dict[str, Any]] = {
            "greedy": {"temperature": 0.0},
            "precise": {"temperature": 0.3, "top_p": 0.9},
            "balanced": {"temperature": 0.7, "top_p": 0.9, "min_p": 0.05,
                         "token_repetition_penalty": 1.05},
            "creative": {"temperature": 1.0, "min_p": 0.05, "dry_multiplier": 0.8,
                         "xtc_probability": 0.5, "xtc_threshold": 0.1},
        }
        if name not in presets:
            raise ValueError(f"unknown preset {name!r}; choose one of {sorted(presets)}")
        return cls(**{**presets[name], **overrides})

    @classmethod
    def from_generation_config(cls, config: Mapping[str, Any]) -> SamplerSettings:
        """Settings from a Hugging Face ``generation_config.json`` mapping.

        Reads ``temperature``, ``top_k``, ``top_p``, ``min_p``, ``typical_p`` and
        ``repetition_penalty``; other keys are ignored. Only keys present apply (Hugging Face's
        implicit ``top_k=50`` is not assumed). ``do_sample: false`` (explicitly) or
        ``temperature: 0`` gives greedy decoding, keeping the repetition penalty.
        """
        mapping = {"temperature": "temperature", "top_k": "top_k", "top_p": "top_p",
                   "min_p": "min_p", "typical_p": "typical",
                   "repetition_penalty": "token_repetition_penalty"}
        values = {ours: config[theirs] for theirs, ours in mapping.items()
                  if config.get(theirs) is not None}
        if config.get("do_sample") is False or values.get("temperature") == 0:
            keep = {k: v for k, v in values.items() if k == "token_repetition_penalty"}
            return cls.greedy(**keep)
        return cls(**values)

    @classmethod
    def from_framework_fields(
        cls, fields: Mapping[str, Any], model_defaults: Mapping[str, Any]
    ) -> SamplerSettings | None:
        """Settings for the sampling fields frameworks use (`FRAMEWORK_SAMPLING_FIELDS`:
        temperature, top_p, top_k, min_p, repetition_penalty) laid over the model's
        generation_config defaults; None when none is set (the engine then uses the defaults).
        Other keys in ``fields`` are ignored. The merge goes through the constructor, so every
        value is validated with the usual messages."""
        chosen = {ours: fields[theirs] for theirs, ours in FRAMEWORK_SAMPLING_FIELDS.items()
                  if fields.get(theirs) is not None}
        if not chosen:
            return None
        base = cls.from_generation_config(model_defaults)
        return cls(**{**base.model_dump(), **chosen})


@dataclass
class SamplerState:
    """A job's own sampling state: mirostat's running ``mu``, with its history so a rewind
    (banned strings, rejected drafts) can restore it. The job owns one; the sampler updates it.

    mirostat_mu: None until the first mirostat token (then starts at ``2 * mirostat_tau``).
    """

    mirostat_mu: float | None = None
    _mu_history: list[float | None] = field(default_factory=list, repr=False)

    def current_mu(self, settings: SamplerSettings) -> float:
        """The ``mu`` the next mirostat draw uses."""
        return self.mirostat_mu if self.mirostat_mu is not None else 2.0 * settings.mirostat_tau

    def record_token(self, settings: SamplerSettings, chosen_prob: float) -> None:
        """Update after one sampled token whose probability (in the final, truncated
        distribution) was ``chosen_prob``. A no-op without mirostat."""
        if not settings.mirostat:
            return
        self._mu_history.append(self.mirostat_mu)
        surprise = -math.log2(max(chosen_prob, 1e-30))
        mu = self.current_mu(settings)
        self.mirostat_mu = mu - settings.mirostat_eta * (surprise - settings.mirostat_tau)

    def rollback(self, num_tokens: int) -> None:
        """Undo the updates of the last ``num_tokens`` recorded tokens."""
        for _ in range(min(num_tokens, len(self._mu_history))):
            self.mirostat_mu = self._mu_history.pop()
