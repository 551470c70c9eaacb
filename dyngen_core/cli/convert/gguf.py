"""`convert_gguf`: a llama- or qwen2-architecture GGUF file to a Hugging Face model folder.

The folder gets ``config.json`` (LlamaForCausalLM or Qwen2ForCausalLM, from the GGUF metadata),
``model.safetensors`` (dequantized, HF names, llama's q/k permutation undone; see
`architectures`), ``tokenizer.json`` and ``tokenizer_config.json`` (with the chat template) and
``generation_config.json``. Reading and dequantizing use the `gguf` package and numpy; no torch,
so converting stays light.

A GGUF file is untrusted input. Every metadata value is read with its expected type and range,
the config it gives is checked as `ModelConfig` checks a config.json, and the tensor table is
checked against it (layer count first) before anything is written. Every failure is a
`ConversionError` naming the GGUF key or tensor, and a failed conversion removes what it wrote.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from dyngen_core.cli.convert.architectures import AttentionBiases, GgufArchitecture, architecture
from dyngen_core.cli.convert.gguf_tokenizer import (
    GgufVocab,
    build_tokenizer,
    write_tokenizer_files,
)
from dyngen_core.cli.convert.weights import (
    OUTPUT_DTYPES,
    TensorSource,
    check_tensors,
    hf_tensor_name,
    unpermute_rotary,
    write_safetensors,
)
from dyngen_core.config import ModelConfig
from dyngen_core.errors import ConversionError, DynGenError

_ABSENT: Any = object()


@dataclass(frozen=True)
class Kind:
    """What a metadata value must be: a test, and its description for error messages."""

    test: Callable[[Any], bool]
    description: str


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool)
            and bool(np.isfinite(value)))


POSITIVE_INT = Kind(lambda v: _is_int(v) and v > 0, "a positive integer")
TOKEN_ID = Kind(lambda v: _is_int(v) and v >= 0, "a token id")
NUMBER = Kind(lambda v: _is_number(v) and v >= 0, "a finite number >= 0")
TEXT = Kind(lambda v: isinstance(v, str), "a string")
FLAG = Kind(lambda v: isinstance(v, bool), "true or false")
TEXTS = Kind(lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v),
             "an array of strings")
INTS = Kind(lambda v: isinstance(v, list) and all(_is_int(x) for x in v),
            "an array of integers")


class GgufModel:
    """A GGUF file opened for conversion (memory-mapped: tensors are read on demand)."""

    def __init__(self, path: str | Path) -> None:
        import gguf

        self.path = Path(path)
        if not self.path.is_file():
            raise ConversionError(f"GGUF file {str(self.path)!r} does not exist")
        try:
            self.reader = gguf.GGUFReader(str(self.path))
        except Exception as exc:  # the reader raises bare ValueErrors, IndexErrors, ...
            raise ConversionError(
                f"{str(self.path)!r} is not a readable GGUF file ({type(exc).__name__}: {exc}); "
                "it is truncated, damaged or not GGUF: download it again"
            ) from exc
        self.arch = self.value("general.architecture", TEXT)
        self.architecture: GgufArchitecture = architecture(self.arch)
        self.tensors = {t.name: t for t in self.reader.tensors}

    def biases(self) -> AttentionBiases:
        """The attention bias tensors the converted checkpoint holds."""
        return self.architecture.biases("blk.0.attn_q.bias" in self.tensors)

    def value(self, key: str, kind: Kind, default: Any = _ABSENT) -> Any:
        """The metadata value ``key``, which must be of ``kind``; ``default`` when the file
        lacks it (without a default, a missing key is an error)."""
        field = self.reader.fields.get(key)
        if field is None:
            if default is _ABSENT:
                raise ConversionError(
                    f"{str(self.path)!r} lacks the metadata key {key}; it was not written by "
                    "llama.cpp's converter or is damaged: use the model's original GGUF or "
                    "Hugging Face folder"
                )
            return default
        try:
            value = field.contents()
        except Exception as exc:  # undecodable strings, inconsistent arrays
            raise ConversionError(
                f"metadata key {key} in {str(self.path)!r} is unreadable ({exc}); the file is "
                "damaged: download it again"
            ) from exc
        if not kind.test(value):
            shown = repr(value) if not isinstance(value, list) else f"an array of {len(value)}"
            raise ConversionError(
                f"metadata key {key} in {str(self.path)!r} is {shown[:60]}, but it must be "
                f"{kind.description}; the file is damaged or not a llama.cpp GGUF"
            )
        return value

    def arch_value(self, key: str, kind: Kind, default: Any = _ABSENT) -> Any:
        return self.value(f"{self.arch}.{key}", kind, default)

    def vocab(self) -> GgufVocab:
        """The tokenizer metadata, each id inside the vocabulary."""
        tokens = self.value("tokenizer.ggml.tokens", TEXTS)
        if not tokens:
            raise ConversionError(f"{str(self.path)!r} has an empty tokenizer.ggml.tokens")
        types = self.value("tokenizer.ggml.token_type", INTS, None) or [1] * len(tokens)
        if len(types) != len(tokens):
            raise ConversionError(
                f"{str(self.path)!r} has {len(types)} tokenizer.ggml.token_type entries for "
                f"{len(tokens)} tokens; the file is damaged"
            )
        ids = {name: self._token_id(f"tokenizer.ggml.{name}", len(tokens))
               for name in ("bos_token_id", "eos_token_id", "unknown_token_id",
                            "padding_token_id")}
        return GgufVocab(
            model=self.value("tokenizer.ggml.model", TEXT, ""),
            pre=self.value("tokenizer.ggml.pre", TEXT, "default"),
            tokens=tokens,
            token_types=types,
            merges=self.value("tokenizer.ggml.merges", TEXTS, None) or [],
            bos_id=ids["bos_token_id"],
            eos_id=ids["eos_token_id"],
            unk_id=ids["unknown_token_id"],
            pad_id=ids["padding_token_id"],
            add_bos=self.value("tokenizer.ggml.add_bos_token", FLAG, False),
            chat_template=self.value("tokenizer.chat_template", TEXT, None),
        )

    def _token_id(self, key: str, vocab_size: int) -> int | None:
        token_id = self.value(key, TOKEN_ID, None)
        if token_id is not None and token_id >= vocab_size:
            raise ConversionError(
                f"metadata key {key} in {str(self.path)!r} is {token_id}, outside the "
                f"{vocab_size}-token vocabulary; the file is damaged"
            )
        return token_id


def _float32_value(value: Any) -> float:
    # GGUF stores float32; its shortest repr gives back the number the model was saved with
    # (1e-05, not 9.999999747378752e-06).
    return float(str(np.float32(value)))


def _rope_scaling(model: GgufModel) -> dict[str, Any] | None:
    kind = model.arch_value("rope.scaling.type", TEXT, None)
    factor = model.arch_value("rope.scaling.factor", NUMBER, None)
    if kind in (None, "none") or factor in (None, 0, 1):
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": _float32_value(factor)}
    if kind == "yarn":
        scaling = {"rope_type": "yarn", "factor": _float32_value(factor)}
        original = model.arch_value("rope.scaling.original_context_length", POSITIVE_INT, None)
        if original is not None:
            scaling["original_max_position_embeddings"] = original
        return scaling
    raise ConversionError(f"rope scaling type {kind!r} in the GGUF file is not supported")


def _head_dim(model: GgufModel, hidden: int, heads: int) -> int:
    if model.arch_value("attention.key_length", POSITIVE_INT, None) is None and hidden < heads:
        raise ConversionError(
            f"{model.arch}.embedding_length={hidden} is smaller than "
            f"{model.arch}.attention.head_count={heads}; the file's metadata is damaged"
        )
    head_dim = model.arch_value("attention.key_length", POSITIVE_INT, hidden // heads)
    if head_dim % 2:
        raise ConversionError(
            f"the GGUF metadata gives a head size of {head_dim} ({model.arch}.embedding_length / "
            f"{model.arch}.attention.head_count, or attention.key_length); rotary embedding "
            "needs an even one: the file's metadata is damaged"
        )
    value_dim = model.arch_value("attention.value_length", POSITIVE_INT, head_dim)
    if value_dim != head_dim:
        raise ConversionError(
            f"{model.arch}.attention.value_length={value_dim} differs from the key length "
            f"{head_dim}; dyngen needs equal key and value head sizes"
        )
    return int(head_dim)


def model_config(model: GgufModel, vocab: GgufVocab, dtype: str) -> dict[str, Any]:
    """config.json for the GGUF's model, checked as `ModelConfig` checks a config.json."""
    if "rope_freqs.weight" in model.tensors:
        raise ConversionError(
            "this GGUF stores Llama-3 rope scaling as a rope_freqs tensor, which does not convert "
            "back to config.json; use the model's original Hugging Face folder"
        )
    embed = model.tensors.get("token_embd.weight")
    if embed is None or len(embed.shape) != 2:
        raise ConversionError(
            f"{str(model.path)!r} has no 2-D token_embd.weight tensor (the token embeddings); "
            "the file is damaged or not a llama or qwen2 model"
        )
    hidden = model.arch_value("embedding_length", POSITIVE_INT)
    heads = model.arch_value("attention.head_count", POSITIVE_INT)
    kv_heads = model.arch_value("attention.head_count_kv", POSITIVE_INT, heads)
    if heads % kv_heads:
        raise ConversionError(
            f"{model.arch}.attention.head_count={heads} is not a multiple of "
            f"{model.arch}.attention.head_count_kv={kv_heads}; the file's metadata is damaged"
        )
    arch = model.architecture
    layers = model.arch_value("block_count", POSITIVE_INT)
    config: dict[str, Any] = {
        "architectures": [arch.hf_architecture],
        "model_type": arch.model_type,
        "hidden_act": "silu",
        "vocab_size": int(embed.shape[-1]),
        "hidden_size": hidden,
        "intermediate_size": model.arch_value("feed_forward_length", POSITIVE_INT),
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": _head_dim(model, hidden, heads),
        "max_position_embeddings": model.arch_value("context_length", POSITIVE_INT, 4096),
        "rms_norm_eps": _float32_value(
            model.arch_value("attention.layer_norm_rms_epsilon", NUMBER, 1e-5)),
        "rope_theta": _float32_value(model.arch_value("rope.freq_base", NUMBER, 10000.0)),
        "rope_scaling": _rope_scaling(model),
        **arch.config_fields(model.biases(), layers),
        "tie_word_embeddings": "output.weight" not in model.tensors,
        "torch_dtype": dtype,
        "use_cache": True,
    }
    for key, value in (("bos_token_id", vocab.bos_id), ("eos_token_id", vocab.eos_id),
                       ("pad_token_id", vocab.pad_id)):
        if value is not None:
            config[key] = value
    try:
        ModelConfig.from_dict(config)
    except DynGenError as exc:
        raise ConversionError(f"the GGUF metadata does not describe a model dyngen can run: "
                              f"{exc}") from exc
    return config


def _generation_config(vocab: GgufVocab) -> dict[str, Any]:
    config: dict[str, Any] = {}
    for key, value in (("bos_token_id", vocab.bos_id), ("eos_token_id", vocab.eos_id),
                       ("pad_token_id", vocab.pad_id)):
        if value is not None:
            config[key] = value
    return config


def tensor_sources(model: GgufModel, config: dict[str, Any]) -> list[TensorSource]:
    """Every output tensor in HF order, each dequantized (and, for llama, its q/k rows
    un-permuted) when written."""
    from gguf.quants import dequantize

    heads = ({"self_attn.q_proj": config["num_attention_heads"],
              "self_attn.k_proj": config["num_key_value_heads"]}
             if model.architecture.rotary_rows_permuted else {})

    def loader(tensor: Any, rotary_heads: int | None) -> Callable[[], np.ndarray]:
        def load() -> np.ndarray:
            try:
                values = dequantize(tensor.data, tensor.tensor_type)
            except Exception as exc:  # an unsupported quantization, damaged blocks
                raise ConversionError(
                    f"GGUF tensor {tensor.name} ({tensor.tensor_type.name}) cannot be "
                    f"dequantized: {type(exc).__name__}: {exc}"
                ) from exc
            values = values.astype(np.float32, copy=False)
            return values if rotary_heads is None else unpermute_rotary(values, rotary_heads)
        return load

    sources = []
    for name, tensor in model.tensors.items():
        hf_name = hf_tensor_name(name)
        rotary = next((n for key, n in heads.items() if f".{key}." in hf_name), None)
        shape = tuple(int(d) for d in reversed(tensor.shape))  # GGUF lists dims fastest first
        sources.append(TensorSource(hf_name, shape, loader(tensor, rotary), origin=name))
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
    """Convert a llama- or qwen2-architecture GGUF file into a Hugging Face folder at
    ``out_dir``.

    dtype: weights dtype in model.safetensors: "float32" (default; dequantized 4- and 8-bit
        values are exact in float32), "bfloat16" or "float16" (half the size, rounded).
    progress: show a tqdm bar over tensors.
    Returns the folder. ``out_dir`` may exist but must not hold a model already. Raises
    ConversionError for anything wrong with the file or the output folder; a failed conversion
    leaves no files behind.
    """
    if dtype not in OUTPUT_DTYPES:
        raise ConversionError(f"dtype {dtype!r} is unknown; use one of {list(OUTPUT_DTYPES)}")
    out = Path(out_dir)
    if (out / "config.json").exists() or (out / "model.safetensors").exists():
        raise ConversionError(
            f"{str(out)!r} already holds a model; choose an empty or new folder"
        )
    model = GgufModel(gguf_path)
    vocab = model.vocab()
    config = model_config(model, vocab, dtype)
    tokenizer = build_tokenizer(vocab)
    sources = tensor_sources(model, config)
    check_tensors(sources, config, model.biases())
    with _output_folder(out) as written:
        write_safetensors(written(out / "model.safetensors"), sources, dtype,
                          _progress_bar(progress))
        write_tokenizer_files(tokenizer, vocab, config["max_position_embeddings"],
                              written(out / "tokenizer.json"),
                              written(out / "tokenizer_config.json"))
        _write_json(written(out / "generation_config.json"), _generation_config(vocab))
        # last: a folder with config.json is complete
        _write_json(written(out / "config.json"), config)
    return out


@contextmanager
def _output_folder(out: Path) -> Iterator[Callable[[Path], Path]]:
    """Creates ``out`` if needed and yields ``written(path) -> path``, which records each file
    about to be written. On any failure the recorded files (and ``out``, when created here and
    left empty) are removed; an OSError becomes a ConversionError naming the path."""
    created = not out.exists()
    paths: list[Path] = []

    def written(path: Path) -> Path:
        paths.append(path)
        return path

    try:
        out.mkdir(parents=True, exist_ok=True)
        yield written
    except BaseException as exc:
        for path in paths:
            path.unlink(missing_ok=True)
        if created and out.is_dir() and not any(out.iterdir()):
            out.rmdir()
        if isinstance(exc, OSError):
            where = paths[-1] if paths else out
            raise ConversionError(
                f"cannot write {str(where)!r} ({exc}); check that the output folder is "
                "writable and the disk has room"
            ) from exc
        raise


def _progress_bar(enabled: bool) -> Any:
    if not enabled:
        return iter

    def bar(items: Iterable[TensorSource]) -> Iterable[TensorSource]:
        from tqdm import tqdm

        return tqdm(list(items), desc="converting", unit="tensor")
    return bar
