"""Which tensors a Llama-family checkpoint holds, their shapes, and where each one lands.

The checkpoint stores q/k/v and gate/up as separate tensors; the runtime fuses them, so one
checkpoint tensor maps to a band of rows in a fused parameter. Pure bookkeeping: no I/O here.
"""

from __future__ import annotations

from dataclasses import dataclass

from dyngen_core.config import ModelConfig
from dyngen_core.model.layers import has_o_bias, has_qkv_bias

# Tensors some exporters leave in checkpoints that carry no weights (recomputed from config).
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


# The config.json fields behind each dimension of a checkpoint tensor, for error messages.
HIDDEN, VOCAB, INTER, HEAD = "hidden_size", "vocab_size", "intermediate_size", "head_dim"
Q_ROWS = "num_attention_heads x head_dim"
KV_ROWS = "num_key_value_heads x head_dim"


@dataclass(frozen=True)
class TensorSlot:
    """Where one checkpoint tensor goes: rows ``row_start ...`` of the runtime parameter
    ``param`` (a name from ``Model.named_parameters()``), with the checkpoint ``shape``;
    ``sources`` names the config.json field(s) each dimension of ``shape`` comes from."""

    param: str
    shape: tuple[int, ...]
    sources: tuple[str, ...]
    row_start: int = 0


def checkpoint_layout(config: ModelConfig) -> dict[str, TensorSlot]:
    """Every tensor the checkpoint must hold, by its Hugging Face name.

    lm_head.weight is expected only without ``tie_word_embeddings`` (tied models reuse the
    embedding matrix).
    """
    hidden, vocab = config.hidden_size, config.vocab_size
    layout = {
        "model.embed_tokens.weight": TensorSlot("embed_weight", (vocab, hidden), (VOCAB, HIDDEN)),
        "model.norm.weight": TensorSlot("norm.weight", (hidden,), (HIDDEN,)),
    }
    if not config.tie_word_embeddings:
        layout["lm_head.weight"] = TensorSlot("lm_head_weight", (vocab, hidden), (VOCAB, HIDDEN))
    for i in range(config.num_layers):
        layout.update(_layer_layout(config, i))
    return layout


def is_ignored(name: str, config: ModelConfig) -> bool:
    """True for tensors that may be present but are not loaded (a tied model's lm_head copy,
    cached rotary frequencies)."""
    if name == "lm_head.weight" and config.tie_word_embeddings:
        return True
    return name.endswith(IGNORED_SUFFIXES)


def _layer_layout(config: ModelConfig, i: int) -> dict[str, TensorSlot]:
    src, dst = f"model.layers.{i}", f"layers.{i}"
    hidden, inter, head_dim = config.hidden_size, config.intermediate_size, config.head_dim
    q_rows, kv_rows = config.num_heads * head_dim, config.num_kv_heads * head_dim
    qkv_bands = {"q_proj": (0, q_rows, Q_ROWS), "k_proj": (q_rows, kv_rows, KV_ROWS),
                 "v_proj": (q_rows + kv_rows, kv_rows, KV_ROWS)}
    layout = {
        f"{src}.input_layernorm.weight":
            TensorSlot(f"{dst}.input_norm.weight", (hidden,), (HIDDEN,)),
        f"{src}.post_attention_layernorm.weight":
            TensorSlot(f"{dst}.post_attention_norm.weight", (hidden,), (HIDDEN,)),
        f"{src}.self_attn.o_proj.weight":
            TensorSlot(f"{dst}.attn.o_weight", (hidden, q_rows), (HIDDEN, Q_ROWS)),
        f"{src}.mlp.gate_proj.weight":
            TensorSlot(f"{dst}.mlp.gate_up_weight", (inter, hidden), (INTER, HIDDEN)),
        f"{src}.mlp.up_proj.weight": TensorSlot(
            f"{dst}.mlp.gate_up_weight", (inter, hidden), (INTER, HIDDEN), row_start=inter),
        f"{src}.mlp.down_proj.weight":
            TensorSlot(f"{dst}.mlp.down_weight", (hidden, inter), (HIDDEN, INTER)),
    }
    for proj, (start, rows, rows_source) in qkv_bands.items():
        layout[f"{src}.self_attn.{proj}.weight"] = TensorSlot(
            f"{dst}.attn.qkv_weight", (rows, hidden), (rows_source, HIDDEN), row_start=start)
        if has_qkv_bias(config):
            layout[f"{src}.self_attn.{proj}.bias"] = TensorSlot(
                f"{dst}.attn.qkv_bias", (rows,), (rows_source,), row_start=start)
    if has_o_bias(config):
        layout[f"{src}.self_attn.o_proj.bias"] = TensorSlot(
            f"{dst}.attn.o_bias", (hidden,), (HIDDEN,))
    if config.qk_norm:
        for name in ("q_norm", "k_norm"):
            layout[f"{src}.self_attn.{name}.weight"] = TensorSlot(
                f"{dst}.attn.{name}.weight", (head_dim,), (HEAD,))
    return layout
