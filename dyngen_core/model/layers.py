"""The building blocks of a Llama-family decoder: RMSNorm, gated MLP, attention, decoder layer.

Parameters are allocated empty on their device and filled by the loader; q/k/v live in one fused
projection and gate/up in another, so each block runs one matrix product where the checkpoint has
two or three. Tensors are flat over the batch: [T, ...] for T tokens of all sequences together.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from dyngen_core.config import ModelConfig
from dyngen_core.kv.attention.base import AttentionBackend, ForwardBatch
from dyngen_core.kv.storage import KVStorage
from dyngen_core.model.parallel import SINGLE, TensorParallel, row_parallel_linear
from dyngen_core.ops.fused_ops import add_rms_norm, rms_norm, rotary, silu_mul
from dyngen_core.ops.skinny_matmul import gated_linear, gated_routable, linear


@dataclass(frozen=True)
class Placement:
    """Where a block's parameters live and in which dtype."""

    device: torch.device
    dtype: torch.dtype


def empty_parameter(*shape: int, place: Placement) -> nn.Parameter:
    """An uninitialised, frozen parameter (the loader fills it)."""
    tensor = torch.empty(shape, device=place.device, dtype=place.dtype)
    return nn.Parameter(tensor, requires_grad=False)


class RMSNorm(nn.Module):
    """Root-mean-square norm over the last dimension, computed in float32 like transformers.

    ``fused`` (set by `Model.set_fused_ops`; False: the torch ops) runs bf16/fp16 norms, and
    the residual add in front of them (`add_and_norm`), as one Triton kernel (`fused_ops`)."""

    def __init__(self, dim: int, eps: float, place: Placement) -> None:
        super().__init__()
        self.weight = empty_parameter(dim, place=place)
        self.eps = eps
        self.fused = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps, fused=self.fused)

    def add_and_norm(self, x: torch.Tensor,
                     out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(h), h) for h = x + out: a sublayer's output added to the residual stream x."""
        return add_rms_norm(x, out, self.weight, self.eps, fused=self.fused)


class GatedMLP(nn.Module):
    """down(silu(gate(x)) * up(x)), with gate and up fused into one [2 * I, hidden] weight.

    ``skinny_rows`` (set by `Model.set_skinny_matmul`; 0: off) routes products of that many
    rows or fewer through the Triton skinny matmul (`skinny_matmul.linear`). ``fused`` (set by
    `Model.set_fused_ops`) runs silu(gate) * up as one Triton kernel (`fused_ops.silu_mul`), and
    with both, a one-row step's gate/up product and SiLU as one launch
    (`skinny_matmul.gated_linear`)."""

    def __init__(self, config: ModelConfig, place: Placement,
                 parallel: TensorParallel = SINGLE) -> None:
        super().__init__()
        hidden, inter = config.hidden_size, config.intermediate_size
        self.parallel = parallel
        self.gate_up_weight = empty_parameter(2 * inter, hidden, place=place)
        self.down_weight = empty_parameter(hidden, inter, place=place)
        self.skinny_rows = 0
        self.fused = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = self.skinny_rows
        if self.fused and gated_routable(x, self.gate_up_weight, rows):
            hidden = gated_linear(x, self.gate_up_weight)
        else:
            gate_up = linear(x, self.gate_up_weight, skinny_rows=rows)
            hidden = silu_mul(gate_up, fused=self.fused)
        return row_parallel_linear(hidden, self.down_weight, None, self.parallel,
                                   skinny_rows=rows)


class Attention(nn.Module):
    """Fused q/k/v projection (optional bias), optional per-head q/k RMSNorm (Qwen3), rotary
    embedding, then the attention backend over the paged cache, then the output projection.
    ``skinny_rows``: as in `GatedMLP`, for the q/k/v and output projections. ``fused`` (set by
    `Model.set_fused_ops`) rotates q and k in one Triton kernel (`fused_ops.rotary`)."""

    def __init__(self, config: ModelConfig, layer_idx: int, place: Placement,
                 parallel: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.parallel = parallel
        self.num_heads, self.num_kv_heads = config.num_heads, config.num_kv_heads
        self.head_dim = config.head_dim
        self.scale = config.head_dim**-0.5
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.split_sizes = [q_size, kv_size, kv_size]
        qkv_rows, hidden = q_size + 2 * kv_size, config.hidden_size
        self.qkv_weight = empty_parameter(qkv_rows, hidden, place=place)
        self.qkv_bias = empty_parameter(qkv_rows, place=place) if has_qkv_bias(config) else None
        self.o_weight = empty_parameter(hidden, q_size, place=place)
        self.o_bias = empty_parameter(hidden, place=place) if has_o_bias(config) else None
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps, place) if config.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps, place) if config.qk_norm else None
        self.skinny_rows = 0
        self.fused = False

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                batch: ForwardBatch, storage: KVStorage,
                backend: AttentionBackend) -> torch.Tensor:
        tokens = x.shape[0]
        qkv = linear(x, self.qkv_weight, self.qkv_bias, skinny_rows=self.skinny_rows)
        q, k = self._rotated_q_k(qkv, cos, sin)
        v = qkv[:, self.split_sizes[0] + self.split_sizes[1]:]
        v = v.view(tokens, self.num_kv_heads, self.head_dim)
        out = backend.attend(self.layer_idx, q, k, v, storage, batch, self.scale)
        return row_parallel_linear(out.reshape(tokens, -1), self.o_weight, self.o_bias,
                                   self.parallel, skinny_rows=self.skinny_rows)

    def _rotated_q_k(self, qkv: torch.Tensor, cos: torch.Tensor,
                     sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q [T, H, D] and k [T, Hkv, D] of the fused projection, normed (Qwen3) and rotated."""
        tokens, heads = qkv.shape[0], self.num_heads
        if self.q_norm is None or self.k_norm is None:
            # q and k are adjacent in the fused output: rotate both heads' sets in one pass
            # (the same arithmetic, half the small per-layer ops).
            q_k = qkv[:, :self.split_sizes[0] + self.split_sizes[1]]
            rotated = rotary(q_k.view(tokens, heads + self.num_kv_heads, self.head_dim),
                             cos, sin, fused=self.fused)
            return rotated[:, :heads], rotated[:, heads:]
        q, k, _ = qkv.split(self.split_sizes, dim=-1)
        q = self.q_norm(q.view(tokens, heads, self.head_dim))
        k = self.k_norm(k.view(tokens, self.num_kv_heads, self.head_dim))
        return (rotary(q, cos, sin, fused=self.fused),
                rotary(k, cos, sin, fused=self.fused))


class DecoderLayer(nn.Module):
    """Pre-norm residual block: h = x + attn(norm(x)), then h + mlp(norm(h)).

    The last add is left to the caller (`forward` returns its two terms), so that the next
    layer's input norm adds it in the same kernel (`RMSNorm.add_and_norm`)."""

    def __init__(self, config: ModelConfig, layer_idx: int, place: Placement,
                 parallel: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.input_norm = RMSNorm(config.hidden_size, config.rms_norm_eps, place)
        self.attn = Attention(config, layer_idx, place, parallel)
        self.post_attention_norm = RMSNorm(config.hidden_size, config.rms_norm_eps, place)
        self.mlp = GatedMLP(config, place, parallel)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                batch: ForwardBatch, storage: KVStorage, backend: AttentionBackend,
                pending: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(mlp output, h): this layer's output is h + mlp output.

        x: the residual stream [T, hidden] entering the layer, or with ``pending``, the stream
            before the previous layer's MLP output ``pending`` is added to it (the sum is this
            layer's input; it is added here, inside the input norm)."""
        if pending is None:
            normed = self.input_norm(x)
        else:
            normed, x = self.input_norm.add_and_norm(x, pending)
        attended = self.attn(normed, cos, sin, batch, storage, backend)
        normed, h = self.post_attention_norm.add_and_norm(x, attended)
        return self.mlp(normed), h


def has_qkv_bias(config: ModelConfig) -> bool:
    """q/k/v projections carry a bias (Qwen2 always; Llama and Qwen3 when attention_bias)."""
    return config.attention_bias and config.architecture != "MistralForCausalLM"


def has_o_bias(config: ModelConfig) -> bool:
    """The output projection carries a bias: Llama and Qwen3 tie it to attention_bias; Qwen2
    biases only q/k/v; Mistral has no biases."""
    return config.attention_bias and config.architecture in ("LlamaForCausalLM", "Qwen3ForCausalLM")
