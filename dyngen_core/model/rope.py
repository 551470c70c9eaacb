"""Rotary position embedding: inverse frequencies (with config.json's ``rope_scaling``),
and per-position cos/sin (`ops.fused_ops.rotary` applies them to q and k).

Uses the "rotate half" layout of Hugging Face Llama checkpoints (the first and second halves of
each head form the pairs). Each scaling type reproduces the transformers computation of the same
name exactly (same float32 arithmetic, same order), because a frequency that differs in the last
bit moves logits at long positions. Supported: default, "linear", "llama3" (Llama 3.1 / 3.2) and
"yarn"; `ModelConfig.from_dict` has checked the fields each one reads.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from dyngen_core.config import ModelConfig
from dyngen_core.errors import UnsupportedArchitectureError

Scaling = dict[str, Any]


class RotaryEmbedding:
    """Per-position cos/sin for one model (scaling from config.json included).

    device: where positions arrive and the tables are produced.
    """

    def __init__(self, config: ModelConfig, device: torch.device) -> None:
        inv_freq, attention_factor = inverse_frequencies(config)
        self.inv_freq = inv_freq.to(device)
        self.attention_factor = attention_factor

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        """cos and sin, each [T, head_dim], for int positions [T], cast to ``dtype``."""
        freqs = positions.to(torch.float32)[:, None] * self.inv_freq[None, :]
        angles = torch.cat((freqs, freqs), dim=-1)
        cos, sin = angles.cos(), angles.sin()
        if self.attention_factor != 1.0:
            cos, sin = cos * self.attention_factor, sin * self.attention_factor
        return cos.to(dtype), sin.to(dtype)


def _rope_type(config: ModelConfig) -> str:
    """The scaling type named in config.json ("default" when there is none)."""
    scaling = config.rope_scaling or {}
    return str(scaling.get("rope_type", scaling.get("type", "default")))


def inverse_frequencies(config: ModelConfig) -> tuple[torch.Tensor, float]:
    """(inv_freq [head_dim // 2] float32 on the CPU, factor applied to cos and sin)."""
    kind = _rope_type(config)
    compute = _BY_TYPE.get(kind)
    if compute is None:
        raise UnsupportedArchitectureError(
            f"rope_scaling type {kind!r} in config.json is not supported; supported: "
            f"{', '.join(sorted(_BY_TYPE))}"
        )
    return compute(config, config.rope_scaling or {})


def _base_inv_freq(config: ModelConfig) -> torch.Tensor:
    dim = config.head_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).to(dtype=torch.float) / dim
    return 1.0 / (config.rope_theta**exponents)


def _default(config: ModelConfig, scaling: Scaling) -> tuple[torch.Tensor, float]:
    return _base_inv_freq(config), 1.0


def _linear(config: ModelConfig, scaling: Scaling) -> tuple[torch.Tensor, float]:
    return _base_inv_freq(config) / float(scaling["factor"]), 1.0


def _llama3(config: ModelConfig, scaling: Scaling) -> tuple[torch.Tensor, float]:
    inv_freq = _base_inv_freq(config)
    factor = scaling["factor"]
    low_freq_factor = scaling["low_freq_factor"]
    high_freq_factor = scaling["high_freq_factor"]
    old_context_len = scaling["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor

    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled), 1.0


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(config: ModelConfig, scaling: Scaling) -> tuple[torch.Tensor, float]:
    base, dim = config.rope_theta, config.head_dim
    original = scaling.get("original_max_position_embeddings") or config.max_position_embeddings
    factor = scaling.get("factor") or config.max_position_embeddings / original
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = _yarn_mscale(factor)
    beta_fast = scaling.get("beta_fast") or 32
    beta_slow = scaling.get("beta_slow") or 1

    def correction_dim(num_rotations: float) -> float:
        return (dim * math.log(original / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # keeps the ramp finite, as transformers does
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    keep = 1 - ramp
    return interpolation * (1 - keep) + extrapolation * keep, float(attention_factor)


_BY_TYPE: dict[str, Callable[[ModelConfig, Scaling], tuple[torch.Tensor, float]]] = {
    "default": _default,
    "linear": _linear,
    "llama3": _llama3,
    "yarn": _yarn,
}
