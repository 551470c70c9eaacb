"""GGUF tensors to Hugging Face Llama-family tensors, written to one safetensors file as they come.

llama.cpp renames tensors (``blk.0.attn_q.weight``), quantizes them, and, for llama only, permutes
the rows of the q and k projections so that rotary embedding pairs adjacent dimensions instead of
the two halves of each head. Here each tensor is dequantized with `gguf.quants` (every GGML type
it reads, the Q4_K_M mix of Q4_K, Q5_0, Q6_K and Q8_0 included), its q/k permutation undone where
there is one, cast to the output dtype and streamed into the file, so converting never holds more
than one dequantized tensor in memory. numpy only, no torch.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from dyngen_core.cli.convert.architectures import AttentionBiases
from dyngen_core.errors import ConversionError

_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_RE = re.compile(r"blk\.([0-9]{1,9})\.(\w+)\.(weight|bias)", re.ASCII)
_HF_LAYER = re.compile(r"model\.layers\.([0-9]{1,9})\.")

# safetensors dtype name and numpy cast for each output dtype.
OUTPUT_DTYPES = {"float32": "F32", "float16": "F16", "bfloat16": "BF16"}


def hf_tensor_name(gguf_name: str) -> str:
    """The Hugging Face name of a GGUF tensor name (Llama and Qwen2 share them)."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    match = _LAYER_RE.fullmatch(gguf_name)
    if match is None or match.group(2) not in _LAYER_NAMES:
        raise ConversionError(
            f"GGUF tensor {gguf_name!r} has no Hugging Face counterpart; only plain llama and "
            "qwen2 files (no MoE, no rope_freqs) can be converted"
        )
    layer, part, kind = match.groups()
    return f"model.layers.{layer}.{_LAYER_NAMES[part]}.{kind}"


def unpermute_rotary(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation (its convert script's ``permute``) for a projection
    with ``num_heads`` heads: rows go back from interleaved pairs to per-head halves."""
    rows = weight.shape[0]
    if rows % (2 * num_heads):
        raise ConversionError(
            f"a q/k projection with {rows} rows cannot hold {num_heads} rotary heads"
        )
    half = rows // num_heads // 2
    per_head = weight.reshape(num_heads, half, 2, *weight.shape[1:])
    return np.ascontiguousarray(per_head.swapaxes(1, 2).reshape(weight.shape))


def cast(array: np.ndarray, dtype: str) -> np.ndarray:
    """``array`` (float32) as the bytes of ``dtype``: float32, float16 or bfloat16 (round to
    nearest even, returned as uint16 since numpy has no bfloat16)."""
    array = np.ascontiguousarray(array, dtype=np.float32)
    if dtype == "float32":
        return array
    if dtype == "float16":
        return array.astype(np.float16)
    if dtype == "bfloat16":
        bits = array.view(np.uint32).astype(np.uint64)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        return rounded.astype(np.uint16)
    raise ConversionError(f"output dtype {dtype!r} is unknown; use one of {list(OUTPUT_DTYPES)}")


@dataclass(frozen=True)
class TensorSource:
    """One output tensor: its HF name, shape, a function producing its float32 values, and
    the name of the GGUF tensor it comes from."""

    name: str
    shape: tuple[int, ...]
    load: Callable[[], np.ndarray]
    origin: str = ""


def check_tensors(sources: list[TensorSource], config: dict[str, Any],
                  biases: AttentionBiases) -> None:
    """Raise ConversionError unless ``sources`` are exactly the tensors, with the shapes, that
    ``config`` (a config.json dict) and ``biases`` describe. Layers are counted first, so a
    block_count of a million fails before a million layers are listed."""
    _check_layer_count(sources, config["num_hidden_layers"])
    expected = _expected_shapes(config, biases)
    held = {source.name: source for source in sources}
    missing = [name for name in expected if name not in held]
    if missing:
        raise ConversionError(
            f"the GGUF file lacks {len(missing)} tensor(s) its metadata implies, e.g. "
            f"{_gguf_name(missing[0])}; the file is damaged or not a plain "
            f"{config['model_type']} model"
        )
    extra = [held[name].origin for name in held if name not in expected]
    if extra:
        raise ConversionError(
            f"the GGUF file holds tensor(s) its metadata does not describe: "
            f"{', '.join(extra[:5])}; the file is damaged or not a plain "
            f"{config['model_type']} model"
        )
    for name, shape in expected.items():
        if held[name].shape != shape:
            raise ConversionError(
                f"GGUF tensor {held[name].origin} has shape {list(held[name].shape)} (rows "
                f"first) but the metadata (embedding_length, feed_forward_length, head counts, "
                f"key_length) implies {list(shape)}; the file's metadata and tensors disagree"
            )


def _check_layer_count(sources: list[TensorSource], block_count: int) -> None:
    layers = {int(m.group(1)) for s in sources if (m := _HF_LAYER.match(s.name))}
    if len(layers) != block_count or (layers and max(layers) != block_count - 1):
        raise ConversionError(
            f"the GGUF metadata says block_count={block_count}, but the file holds tensors of "
            f"{len(layers)} layer(s) numbered up to {max(layers, default=-1)}; the file is "
            "damaged"
        )


def _expected_shapes(config: dict[str, Any],
                    biases: AttentionBiases) -> dict[str, tuple[int, ...]]:
    """Every tensor of a checkpoint of ``config``, with its shape (rows first)."""
    hidden, vocab, inter = config["hidden_size"], config["vocab_size"], config["intermediate_size"]
    q_rows = config["num_attention_heads"] * config["head_dim"]
    kv_rows = config["num_key_value_heads"] * config["head_dim"]
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, hidden),
                                          "model.norm.weight": (hidden,)}
    if not config["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (vocab, hidden)
    per_layer: dict[str, tuple[int, ...]] = {
        "input_layernorm.weight": (hidden,), "post_attention_layernorm.weight": (hidden,),
        "self_attn.q_proj.weight": (q_rows, hidden), "self_attn.k_proj.weight": (kv_rows, hidden),
        "self_attn.v_proj.weight": (kv_rows, hidden), "self_attn.o_proj.weight": (hidden, q_rows),
        "mlp.gate_proj.weight": (inter, hidden), "mlp.up_proj.weight": (inter, hidden),
        "mlp.down_proj.weight": (hidden, inter),
    }
    if biases.qkv:
        per_layer.update({"self_attn.q_proj.bias": (q_rows,), "self_attn.k_proj.bias": (kv_rows,),
                          "self_attn.v_proj.bias": (kv_rows,)})
    if biases.output:
        per_layer["self_attn.o_proj.bias"] = (hidden,)
    for i in range(config["num_hidden_layers"]):
        shapes.update({f"model.layers.{i}.{name}": shape for name, shape in per_layer.items()})
    return shapes


def _gguf_name(hf_name: str) -> str:
    """The GGUF name of a Hugging Face tensor name (the inverse of `hf_tensor_name`)."""
    for gguf_name, hf in _GLOBAL_NAMES.items():
        if hf == hf_name:
            return gguf_name
    _, _, layer, *rest = hf_name.split(".")
    part = ".".join(rest[:-1])
    gguf_part = next(g for g, h in _LAYER_NAMES.items() if h == part)
    return f"blk.{layer}.{gguf_part}.{rest[-1]}"


def write_safetensors(
    path: Path,
    sources: list[TensorSource],
    dtype: str,
    progress: Callable[[Iterable[TensorSource]], Iterable[TensorSource]] = iter,
) -> None:
    """Write ``sources`` to a safetensors file at ``path``, one tensor in memory at a time."""
    width = 4 if dtype == "float32" else 2
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for source in sources:
        size = width * int(np.prod(source.shape, dtype=np.int64))
        header[source.name] = {
            "dtype": OUTPUT_DTYPES[dtype], "shape": list(source.shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    encoded = json.dumps(header, separators=(",", ":")).encode("utf-8")
    encoded += b" " * (-len(encoded) % 8)  # tensor data starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(len(encoded).to_bytes(8, "little"))
        f.write(encoded)
        for source in progress(sources):
            values = source.load()
            if tuple(values.shape) != source.shape:
                raise ConversionError(
                    f"tensor {source.name} dequantized to shape {values.shape}, "
                    f"expected {source.shape}"
                )
            f.write(cast(values, dtype).tobytes())
