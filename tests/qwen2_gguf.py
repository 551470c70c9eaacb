"""A tiny Qwen2 model written as llama.cpp writes a qwen2 GGUF, for testing conversion.

`write_qwen2_gguf` trains a small byte-level BPE vocabulary (with Qwen's split regex and special
tokens), draws every weight matrix as random blocks of the GGML type ``quant`` assigns it (see
`tests.ggml_blocks`) and norms and q/k/v biases as float32, and writes them under llama.cpp's
qwen2 names, q/k rows as they are (llama.cpp permutes them for llama only). It returns the
Hugging Face weights the file stands for, so a converter is checked against the values the blocks
were made from.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import gguf
import numpy as np
import tokenizers
from gguf import GGMLQuantizationType as Q
from tokenizers import Regex, decoders, models, pre_tokenizers, trainers

from tests.ggml_blocks import random_blocks

QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
CONTROL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
USER_DEFINED = ["<tool_call>", "</tool_call>"]
PADDING = 3  # "[PAD<id>]" tokens at the end, as llama.cpp fills a vocabulary up to the model's
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CORPUS = [
    "def add(a, b):\n    return a + b\n\nprint(add(12, 345))\n",
    "for (let i = 0; i < 10; i++) { console.log(`i=${i}`); }",
    "The quick brown fox doesn't jump; it's lazy. I'll see, they'd go.",
    "Grüße aus Köln! Ça va? 日本語 😀 3.14159",
]

# Matrix -> its GGML type in the mixed file: one of each type Q4_K_M files use, K-quants on
# matrices whose rows hold whole 256-element blocks.
MIXED = {
    "token_embd": Q.Q8_0, "output": Q.Q6_K, "attn_q": Q.Q5_0, "attn_k": Q.Q4_K,
    "attn_v": Q.Q6_K, "attn_output": Q.Q8_0, "ffn_gate": Q.Q4_K, "ffn_up": Q.Q5_0,
    "ffn_down": Q.Q6_K,
}


@dataclass(frozen=True)
class TinyQwen2:
    """The tiny model's shape (head_dim = hidden / heads)."""

    hidden: int = 256
    heads: int = 4
    kv_heads: int = 2
    ffn: int = 512
    layers: int = 2
    context: int = 4096
    rope_theta: float = 1000000.0
    rms_eps: float = 1e-6
    tied: bool = False
    quant: dict[str, Q] = field(default_factory=lambda: dict(MIXED))

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


_HF_PARTS = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_HF_GLOBALS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm",
               "output": "lm_head"}


def hf_name(gguf_name: str) -> str:
    """The Hugging Face name of a llama.cpp tensor name."""
    base, kind = gguf_name.rsplit(".", 1)
    if base in _HF_GLOBALS:
        return f"{_HF_GLOBALS[base]}.{kind}"
    _, layer, part = base.split(".")
    return f"model.layers.{layer}.{_HF_PARTS[part]}.{kind}"


def train_qwen2_vocab() -> tokenizers.Tokenizer:
    """A small byte-level BPE vocabulary split with Qwen2's regex, specials first."""
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=CONTROL + USER_DEFINED,
                                  show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS * 20, trainer)
    return tok


def vocab_tokens(vocab: tokenizers.Tokenizer) -> tuple[list[str], list[int], list[str]]:
    """(tokens by id, llama.cpp token types, merges) as a GGUF stores them."""
    data = json.loads(vocab.to_str())["model"]
    tokens = sorted(data["vocab"], key=data["vocab"].get)
    tokens += [f"[PAD{len(tokens) + i}]" for i in range(PADDING)]
    types = [3 if t in CONTROL else 4 if t in USER_DEFINED else
             5 if t.startswith("[PAD") else 1 for t in tokens]
    merges = [m if isinstance(m, str) else " ".join(m) for m in data["merges"]]
    return tokens, types, merges


def write_qwen2_gguf(path: Path, shape: TinyQwen2 = TinyQwen2(), seed: int = 0,
                     arch: str = "qwen2", drop: tuple[str, ...] = (),
                     extra: tuple[str, ...] = ()) -> dict[str, np.ndarray]:
    """Write the tiny model to ``path``; returns the HF weights (float32) it stands for.

    drop: GGUF tensor names to leave out; extra: float32 bias tensors to add (e.g.
    ``blk.0.attn_output.bias``), for testing what a converter refuses.
    """
    rng = np.random.default_rng(seed)
    tokens, types, merges = vocab_tokens(train_qwen2_vocab())
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(shape.layers)
    writer.add_context_length(shape.context)
    writer.add_embedding_length(shape.hidden)
    writer.add_feed_forward_length(shape.ffn)
    writer.add_head_count(shape.heads)
    writer.add_head_count_kv(shape.kv_heads)
    writer.add_rope_freq_base(shape.rope_theta)
    writer.add_layer_norm_rms_eps(shape.rms_eps)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_eos_token_id(tokens.index("<|im_end|>"))
    writer.add_pad_token_id(tokens.index("<|endoftext|>"))
    writer.add_bos_token_id(tokens.index("<|endoftext|>"))
    writer.add_add_bos_token(False)
    writer.add_chat_template(TEMPLATE)
    weights: dict[str, np.ndarray] = {}
    for name, rows_cols in _tensor_shapes(shape, len(tokens)).items():
        if name in drop:
            continue
        base = name.rsplit(".", 1)[0].split(".")[-1]
        if len(rows_cols) == 1:  # norms and biases stay float32, as llama.cpp keeps them
            values = (1.0 + 0.1 * rng.standard_normal(rows_cols) if "norm" in name
                      else 0.5 * rng.standard_normal(rows_cols)).astype(np.float32)
            writer.add_tensor(name, values)
        else:
            kind = shape.quant[base]
            packed, values = random_blocks(kind, *rows_cols, rng)
            writer.add_tensor(name, packed, raw_dtype=kind)  # shape given in bytes
        weights[hf_name(name)] = values
    for name in extra:
        values = rng.standard_normal(shape.hidden).astype(np.float32)
        writer.add_tensor(name, values)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return weights


def _tensor_shapes(shape: TinyQwen2, vocab: int) -> dict[str, tuple[int, ...]]:
    """Every tensor llama.cpp writes for a qwen2 model, rows first, in its order."""
    q_rows, kv_rows = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    shapes: dict[str, tuple[int, ...]] = {"token_embd.weight": (vocab, shape.hidden)}
    if not shape.tied:
        shapes["output.weight"] = (vocab, shape.hidden)
    shapes["output_norm.weight"] = (shape.hidden,)
    for i in range(shape.layers):
        shapes.update({
            f"blk.{i}.attn_norm.weight": (shape.hidden,),
            f"blk.{i}.attn_q.weight": (q_rows, shape.hidden),
            f"blk.{i}.attn_q.bias": (q_rows,),
            f"blk.{i}.attn_k.weight": (kv_rows, shape.hidden),
            f"blk.{i}.attn_k.bias": (kv_rows,),
            f"blk.{i}.attn_v.weight": (kv_rows, shape.hidden),
            f"blk.{i}.attn_v.bias": (kv_rows,),
            f"blk.{i}.attn_output.weight": (shape.hidden, q_rows),
            f"blk.{i}.ffn_norm.weight": (shape.hidden,),
            f"blk.{i}.ffn_gate.weight": (shape.ffn, shape.hidden),
            f"blk.{i}.ffn_up.weight": (shape.ffn, shape.hidden),
            f"blk.{i}.ffn_down.weight": (shape.hidden, shape.ffn),
        })
    return shapes
