"""Rotary position embedding: cos/sin from token positions, and applying them to q and k.

Uses the "rotate half" layout of Hugging Face Llama checkpoints (the first and second halves of
each head form the pairs), computing angles in float32 as transformers does.
"""

from __future__ import annotations

import torch

from dyngen_core.config import ModelConfig
from dyngen_core.model.rope_scaling import inverse_frequencies


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
        cos = angles.cos() * self.attention_factor
        sin = angles.sin() * self.attention_factor
        return cos.to(dtype), sin.to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [T, heads, head_dim] by per-token cos/sin [T, head_dim]."""
    cos, sin = cos[:, None, :], sin[:, None, :]
    return x * cos + _rotate_half(x) * sin
