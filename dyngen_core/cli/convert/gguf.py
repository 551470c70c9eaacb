"""`convert_gguf`: a llama-architecture GGUF file to a Hugging Face model folder.

The folder gets ``config.json`` (LlamaForCausalLM, from the GGUF metadata), ``model.safetensors``
(dequantized, HF names, q/k permutation undone), ``tokenizer.json`` and ``tokenizer_config.json``
(with the chat template) and ``generation_config.json``. Reading and dequantizing use the `gguf`
package and numpy; no torch, so converting stays light.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np

from dyngen_core.cli.convert.gguf_tokenizer import GgufVocab, write_tokenizer
from dyngen_core.cli.convert.weights import (
    OUTPUT_DTYPES,
    TensorSource,
    hf_tensor_name,
    unpermute_rotary,
    write_safetensors,
)
from dyngen_core.errors import ConversionError

SUPPORTED_GGUF_ARCHITECTURES = ("llama",)


class GgufModel:
    """A GGUF file opened for conversion (memory-mapped: tensors are read on demand)."""

    def __init__(self, path: str | Path) -> None:
        import gguf

        self.path = Path(path)
        if not self.path.is_file():
            raise ConversionError(f"GGUF file {str(self.path)!r} does not exist")
        try:
            self.reader = gguf.GGUFReader(str(self.path))
        except Exception as exc:  # the reader raises bare ValueErrors on bad headers
            raise ConversionError(f"{str(self.path)!r} is not a readable GGUF file: {exc}") from exc
        self.arch = str(self.get("general.architecture"))
        if self.arch not in SUPPORTED_GGUF_ARCHITECTURES:
            raise ConversionError(
                f"GGUF architecture {self.arch!r} is not supported; dyngen converts "
                f"{', '.join(SUPPORTED_GGUF_ARCHITECTURES)} files"
            )
        self.tensors = {t.name: t for t in self.reader.tensors}

    def get(self, key: str, default: Any = None) -> Any:
        """A metadata value, or ``default`` when the file lacks ``key``."""
        field = self.reader.fields.get(key)
        return default if field is None else field.contents()

    def arch_get(self, key: str, default: Any = None) -> Any:
        return self.get(f"{self.arch}.{key}", default)

    def vocab(self) -> GgufVocab:
        """The tokenizer metadata."""
        def opt_int(key: str) -> int | None:
            value = self.get(key)
            return None if value is None else int(value)

        tokens = self.get("tokenizer.ggml.tokens")
        if not tokens:
            raise ConversionError(f"{str(self.path)!r} has no tokenizer.ggml.tokens vocabulary")
        return GgufVocab(
            model=str(self.get("tokenizer.ggml.model", "")),
            pre=str(self.get("tokenizer.ggml.pre", "default")),
            tokens=tokens,
            token_types=self.get("tokenizer.ggml.token_type") or [1] * len(tokens),
            merges=self.get("tokenizer.ggml.merges") or [],
            bos_id=opt_int("tokenizer.ggml.bos_token_id"),
            eos_id=opt_int("tokenizer.ggml.eos_token_id"),
            unk_id=opt_int("tokenizer.ggml.unknown_token_id"),
            pad_id=opt_int("tokenizer.ggml.padding_token_id"),
            add_bos=bool(self.get("tokenizer.ggml.add_bos_token", False)),
            chat_template=self.get("tokenizer.chat_template"),
        )


def _float32_value(value: Any) -> float:
    # GGUF stores float32; its shortest repr gives back the number the model was saved with
    # (1e-05, not 9.999999747378752e-06).
    return float(str(np.float32(value)))


def _rope_scaling(model: GgufModel) -> dict[str, Any] | None:
    kind = model.arch_get("rope.scaling.type")
    factor = model.arch_get("rope.scaling.factor")
    if kind in (None, "none") or factor in (None, 0, 1):
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": _float32_value(factor)}
    if kind == "yarn":
        original = model.arch_get("rope.scaling.original_context_length")
        return {"rope_type": "yarn", "factor": _float32_value(factor),
                "original_max_position_embeddings": int(original)}
    raise ConversionError(f"rope scaling type {kind!r} in the GGUF file is not supported")


def model_config(model: GgufModel, dtype: str) -> dict[str, Any]:
    """config.json for the GGUF's model."""
    if "rope_freqs.weight" in model.tensors:
        raise ConversionError(
            "this GGUF stores Llama-3 rope scaling as a rope_freqs tensor, which does not convert "
            "back to config.json; use the model's original Hugging Face folder"
        )
    hidden = int(model.arch_get("embedding_length"))
    heads = int(model.arch_get("attention.head_count"))
    embed = model.tensors["token_embd.weight"]
    vocab = model.vocab()
    config: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_act": "silu",
        "vocab_size": int(embed.shape[-1]),
        "hidden_size": hidden,
        "intermediate_size": int(model.arch_get("feed_forward_length")),
        "num_hidden_layers": int(model.arch_get("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(model.arch_get("attention.head_count_kv", heads)),
        "head_dim": int(model.arch_get("attention.key_length", hidden // heads)),
        "max_position_embeddings": int(model.arch_get("context_length", 4096)),
        "rms_norm_eps": _float32_value(model.arch_get("attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": _float32_value(model.arch_get("rope.freq_base", 10000.0)),
        "rope_scaling": _rope_scaling(model),
        "attention_bias": "blk.0.attn_q.bias" in model.tensors,
        "mlp_bias": False,
        "tie_word_embeddings": "output.weight" not in model.tensors,
        "torch_dtype": dtype,
        "use_cache": True,
    }
    for key, value in (("bos_token_id", vocab.bos_id), ("eos_token_id", vocab.eos_id),
                       ("pad_token_id", vocab.pad_id)):
        if value is not None:
            config[key] = value
    return config


def _generation_config(vocab: GgufVocab) -> dict[str, Any]:
    config: dict[str, Any] = {}
    for key, value in (("bos_token_id", vocab.bos_id), ("eos_token_id", vocab.eos_id),
                       ("pad_token_id", vocab.pad_id)):
        if value is not None:
            config[key] = value
    return config


def tensor_sources(model: GgufModel, config: dict[str, Any]) -> list[TensorSource]:
    """Every output tensor in HF order, each dequantized (and un-permuted) when written."""
    from gguf.quants import dequantize

    heads = {"self_attn.q_proj": config["num_attention_heads"],
             "self_attn.k_proj": config["num_key_value_heads"]}

    def loader(tensor: Any, rotary_heads: int | None) -> Any:
        def load() -> np.ndarray:
            values = dequantize(tensor.data, tensor.tensor_type).astype(np.float32, copy=False)
            return values if rotary_heads is None else unpermute_rotary(values, rotary_heads)
        return load

    sources = []
    for name, tensor in model.tensors.items():
        hf_name = hf_tensor_name(name)
        rotary = next((n for key, n in heads.items() if f".{key}." in hf_name), None)
        shape = tuple(int(d) for d in reversed(tensor.shape))  # GGUF lists dims fastest first
        sources.append(TensorSource(hf_name, shape, loader(tensor, rotary)))
    return sorted(sources, key=lambda s: _natural_key(s.name))


def _natural_key(name: str) -> list[Any]:
    return [int(part) if part.isdigit() else part for part in name.split(".")]


def _write_json(path: Path, data: dict[str, Any]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=2, ensure_ascii=False)
        f.write("\n")


def convert_gguf(
    gguf_path: str | Path, out_dir: str | Path, *, dtype: str = "float32", progress: bool = False
) -> Path:
    """Convert a llama-architecture GGUF file into a Hugging Face folder at ``out_dir``.

    dtype: weights dtype in model.safetensors: "float32" (default; dequantized 4- and 8-bit
        values are exact in float32), "bfloat16" or "float16" (half the size, rounded).
    progress: show a tqdm bar over tensors.
    Returns the folder. ``out_dir`` may exist but must not hold a model already.
    """
    if dtype not in OUTPUT_DTYPES:
        raise ConversionError(f"dtype {dtype!r} is unknown; use one of {list(OUTPUT_DTYPES)}")
    out = Path(out_dir)
    if (out / "config.json").exists() or (out / "model.safetensors").exists():
        raise ConversionError(
            f"{str(out)!r} already holds a model; choose an empty or new folder"
        )
    model = GgufModel(gguf_path)
    config = model_config(model, dtype)
    sources = tensor_sources(model, config)
    out.mkdir(parents=True, exist_ok=True)
    write_safetensors(out / "model.safetensors", sources, dtype, _progress_bar(progress))
    vocab = model.vocab()
    write_tokenizer(vocab, out, config["max_position_embeddings"])
    _write_json(out / "generation_config.json", _generation_config(vocab))
    _write_json(out / "config.json", config)  # last: a folder with config.json is complete
    return out


def _progress_bar(enabled: bool) -> Any:
    if not enabled:
        return iter

    def bar(items: Iterable[TensorSource]) -> Iterable[TensorSource]:
        from tqdm import tqdm

        return tqdm(list(items), desc="converting", unit="tensor")
    return bar
