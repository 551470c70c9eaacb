"""Frozen configuration records shared by the control and data planes.

`ModelConfig` is read from a Hugging Face ``config.json``, which comes from an untrusted folder:
every field is checked for type and range on the way in, and a bad one raises a
`ModelFolderError` naming the field and the fix. `CacheConfig` and `SchedulerConfig` hold the
engine's knobs; `cache_root` says where dyngen keeps its files. Pure Python: no torch here
(the control plane imports it).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from dyngen_core.errors import ModelFolderError, UnsupportedArchitectureError

PAGE_SIZE = 256
SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
)
CACHE_MODES = ("fp16", "q8", "q6", "q4")
# config.json and generation_config.json are kilobytes; a larger file is refused unread.
MAX_CONFIG_BYTES = 1 << 24
# rope_scaling types the rotary embedding implements, each with the fields it requires (checked
# to be positive numbers) and the numeric fields it may take.
ROPE_SCALING_FIELDS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "linear": (("factor",), ()),
    "llama3": (("factor", "low_freq_factor", "high_freq_factor",
                "original_max_position_embeddings"), ()),
    "yarn": ((), ("factor", "original_max_position_embeddings", "attention_factor", "mscale",
                  "mscale_all_dim", "beta_fast", "beta_slow")),
}
# generation_config.json fields the adapters read as sampling defaults, with their types.
_GENERATION_DEFAULTS: dict[str, tuple[type, ...]] = {
    "temperature": (int, float), "top_p": (int, float), "top_k": (int,), "min_p": (int, float),
    "repetition_penalty": (int, float), "do_sample": (bool,),
}
_REQUIRED: Any = object()


@dataclass(frozen=True)
class ModelConfig:
    """The shape of a Llama-family model, as read from its ``config.json``.

    ``attention_bias`` means q/k/v projections carry a bias (Qwen2); ``qk_norm`` means q and k get
    a per-head RMSNorm before rotary embedding (Qwen3). ``eos_token_ids`` holds every id that ends
    generation (config.json and generation_config.json together).
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    qk_norm: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    torch_dtype: str = "float32"
    generation_defaults: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_dict(
        cls, raw: dict[str, Any], generation: dict[str, Any] | None = None
    ) -> ModelConfig:
        """Build from a parsed config.json (and optionally generation_config.json).

        Raises UnsupportedArchitectureError for an architecture or rope_scaling type dyngen does
        not implement, and ModelFolderError for a missing field, a value of the wrong type or
        out of range, or sizes that contradict each other (each names the field and the fix).
        """
        if not isinstance(raw, dict):
            raise ModelFolderError(_CONFIG_FIX.format(f"must hold a JSON object, not "
                                                      f"{type(raw).__name__}"))
        gen = _Fields(generation if generation is not None else {}, "generation_config.json")
        if not isinstance(gen.raw, dict):
            raise ModelFolderError("generation_config.json must hold a JSON object; fix or "
                                   "delete it")
        fields = _Fields(raw, "config.json")
        arch = _architecture(raw)
        shape = _shape(fields)
        rope_theta, rope_scaling = _rope_fields(fields)
        vocab = shape["vocab_size"]
        bos = fields.token_ids("bos_token_id", vocab)
        if "bos_token_id" in gen.raw:  # generation_config.json takes precedence
            bos = gen.token_ids("bos_token_id", vocab)
        return cls(
            architecture=arch,
            **shape,
            rms_norm_eps=fields.number("rms_norm_eps", 1e-6, minimum=0.0),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=fields.positive_int("max_position_embeddings", 4096),
            tie_word_embeddings=fields.boolean("tie_word_embeddings", False),
            attention_bias=fields.boolean("attention_bias", arch == "Qwen2ForCausalLM"),
            qk_norm=arch == "Qwen3ForCausalLM",
            bos_token_id=bos[0] if bos else None,
            eos_token_ids=tuple(dict.fromkeys([*fields.token_ids("eos_token_id", vocab),
                                               *gen.token_ids("eos_token_id", vocab)])),
            torch_dtype=_dtype_name(fields),
            generation_defaults=_generation_defaults(gen),
        )

    @classmethod
    def from_model_dir(cls, model_dir: str | Path) -> ModelConfig:
        """Read ``config.json`` (and ``generation_config.json`` if present) from a folder."""
        folder = Path(model_dir)
        if not folder.is_dir():
            raise ModelFolderError(
                f"model folder {str(folder)!r} does not exist; pass the folder holding "
                "config.json and the .safetensors files"
            )
        config_path = folder / "config.json"
        if not config_path.is_file():
            raise ModelFolderError(
                f"{str(config_path)!r} is missing; a Hugging Face model folder needs config.json "
                "(convert a GGUF file with `dyngen convert-gguf MODEL.gguf OUT_DIR`)"
            )
        raw = read_json_object(config_path)
        gen_path = folder / "generation_config.json"
        generation = read_json_object(gen_path) if gen_path.is_file() else None
        return cls.from_dict(raw, generation)

    @property
    def kv_bytes_per_token_fp16(self) -> int:
        """Bytes one token's keys and values take over all layers at 16 bits."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * 2


@dataclass(frozen=True)
class CacheConfig:
    """Size and storage mode of the paged KV cache (``max_tokens`` rounds up to whole pages)."""

    max_tokens: int
    mode: str = "fp16"
    page_size: int = PAGE_SIZE

    def __post_init__(self) -> None:
        if self.mode not in CACHE_MODES:
            raise ValueError(f"cache mode {self.mode!r} is unknown; use one of {CACHE_MODES}")
        if self.max_tokens < self.page_size:
            raise ValueError(
                f"max_tokens={self.max_tokens} is below one page ({self.page_size} tokens)"
            )

    @property
    def num_pages(self) -> int:
        return -(-self.max_tokens // self.page_size)


@dataclass(frozen=True)
class SchedulerConfig:
    """Scheduling knobs.

    max_batch_size: most jobs running (prefilling or decoding) at once.
    max_chunk_size: most prompt tokens prefilled per step, over all jobs (decodes come on top).
    max_skips: how many times a waiting job may be passed over by later, smaller jobs before
        admission stops until it fits (fairness for large jobs).
    dedup: share identical full prompt pages among running jobs, and fold generated pages.
    prompt_cache: keep unreferenced pages with their hashes for later jobs to reuse.
    defrag: compact pages when the queue is empty.
    """

    max_batch_size: int = 256
    max_chunk_size: int = 2048
    max_skips: int = 8
    dedup: bool = True
    prompt_cache: bool = True
    defrag: bool = True


def read_json_object(path: Path) -> dict[str, Any]:
    """The JSON object in ``path``; ModelFolderError when it is unreadable, larger than any
    config file (`MAX_CONFIG_BYTES`), not UTF-8 JSON, or not an object."""
    size = path.stat().st_size if path.is_file() else 0
    if size > MAX_CONFIG_BYTES:
        raise ModelFolderError(f"{str(path)!r} holds {size:,} bytes, far more than a model "
                               "config; it is not a config file: re-download it")
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelFolderError(f"{str(path)!r} is not readable JSON ({exc}); re-download it"
                               ) from exc
    except RecursionError as exc:
        raise ModelFolderError(f"{str(path)!r} nests too deeply to be a model config") from exc
    if not isinstance(data, dict):
        raise ModelFolderError(f"{str(path)!r} must hold a JSON object")
    return data


_CONFIG_FIX = "config.json {}; fix it, or re-download the model's config.json"


class _Fields:
    """Typed reads of one JSON object: ``where`` names it in errors, ``file`` is its file."""

    def __init__(self, raw: Any, where: str, file: str | None = None) -> None:
        self.raw = raw
        self.where = where
        self.file = file or where

    def fail(self, key: str, value: Any, wanted: str) -> ModelFolderError:
        return ModelFolderError(f"{self.where} has {key}={_shown(value)}, but it must be "
                                f"{wanted}; fix {key} in {self.where}")

    def get(self, key: str, default: Any) -> Any:
        value = self.raw.get(key)
        if value is None:
            if default is _REQUIRED:
                raise ModelFolderError(f"{self.where} lacks {key!r}; add it, or re-download "
                                       f"the model's {self.file}")
            return default
        return value

    def positive_int(self, key: str, default: Any = _REQUIRED) -> int:
        value = self.get(key, default)
        if not _is_int(value) or value < 1:
            raise self.fail(key, value, "a positive integer")
        return int(value)

    def number(self, key: str, default: Any = _REQUIRED, *, minimum: float = 0.0,
               above: bool = False) -> float:
        """A finite number >= ``minimum`` (> ``minimum`` with ``above``)."""
        value = self.get(key, default)
        ok = _is_number(value) and (value > minimum if above else value >= minimum)
        if not ok:
            relation = "above" if above else "at least"
            raise self.fail(key, value, f"a finite number {relation} {minimum:g}")
        return float(value)

    def boolean(self, key: str, default: bool) -> bool:
        value = self.get(key, default)
        if not isinstance(value, bool):
            raise self.fail(key, value, "true or false")
        return value

    def token_ids(self, key: str, vocab_size: int) -> list[int]:
        """One id or a list of ids, each inside the vocabulary (absent: none)."""
        value = self.raw.get(key)
        values = value if isinstance(value, list) else [value]
        ids = []
        for v in values:
            if v is None:
                continue
            if not _is_int(v) or not 0 <= v < vocab_size:
                raise self.fail(key, value, f"a token id (or a list of them) from 0 to "
                                            f"{vocab_size - 1}, inside vocab_size")
            ids.append(int(v))
        return ids


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool)
            and math.isfinite(value))


def _shown(value: Any) -> str:
    """A value as config.json writes it, cut short."""
    try:
        text = json.dumps(value)
    except (TypeError, ValueError, RecursionError):
        text = f"<{type(value).__name__}>"
    return text if len(text) <= 60 else text[:57] + "..."


def _architecture(raw: dict[str, Any]) -> str:
    archs = raw.get("architectures")
    if not isinstance(archs, list) or not all(isinstance(a, str) for a in archs):
        shown = "(none given)" if archs is None else repr(archs)[:80]
        raise UnsupportedArchitectureError(
            f"config.json's 'architectures' is {shown}; it must be a list such as "
            f"[\"LlamaForCausalLM\"]. Supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
    if arch is None:
        raise UnsupportedArchitectureError(
            f"architecture {archs or '(none given)'} is not supported; supported: "
            f"{', '.join(SUPPORTED_ARCHITECTURES)}. Check 'architectures' in config.json."
        )
    return arch


def _shape(fields: _Fields) -> dict[str, int]:
    """The size fields, each a positive integer, and consistent with each other."""
    hidden = fields.positive_int("hidden_size")
    num_heads = fields.positive_int("num_attention_heads")
    num_kv_heads = fields.positive_int("num_key_value_heads", num_heads)
    if num_heads % num_kv_heads:
        raise ModelFolderError(_CONFIG_FIX.format(
            f"has num_attention_heads={num_heads}, which is not a multiple of "
            f"num_key_value_heads={num_kv_heads} (each key/value head serves a whole group of "
            "query heads)"))
    if fields.raw.get("head_dim") is None and hidden < num_heads:
        raise ModelFolderError(_CONFIG_FIX.format(
            f"gives no head_dim and hidden_size={hidden} / num_attention_heads={num_heads} "
            "is below 1"))
    head_dim = fields.positive_int("head_dim", hidden // num_heads)
    if head_dim % 2:
        raise ModelFolderError(_CONFIG_FIX.format(
            f"gives head_dim={head_dim}; rotary embedding needs an even head_dim (it rotates "
            "the two halves of each head)"))
    return {
        "vocab_size": fields.positive_int("vocab_size"),
        "hidden_size": hidden,
        "intermediate_size": fields.positive_int("intermediate_size"),
        "num_layers": fields.positive_int("num_hidden_layers"),
        "num_heads": num_heads,
        "num_kv_heads": num_kv_heads,
        "head_dim": head_dim,
    }


def _rope_fields(fields: _Fields) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, rope_scaling) from either config.json layout: transformers < 5 writes
    ``rope_theta`` + ``rope_scaling``; transformers 5 writes one ``rope_parameters`` dict."""
    params = fields.raw.get("rope_parameters")
    if params is not None and not isinstance(params, dict):
        raise fields.fail("rope_parameters", params, "an object such as "
                          "{\"rope_type\": \"default\", \"rope_theta\": 10000.0}")
    params = dict(params or {})
    in_params = _Fields(params, "config.json's rope_parameters", "config.json")
    theta = in_params.number("rope_theta", 10000.0, minimum=1.0, above=True)
    if fields.raw.get("rope_theta") is not None:  # the older layout's field wins
        theta = fields.number("rope_theta", minimum=1.0, above=True)
    params.pop("rope_theta", None)
    scaling = fields.raw.get("rope_scaling") or params or None
    if scaling is None:
        return theta, None
    if not isinstance(scaling, dict):
        raise fields.fail("rope_scaling", scaling, "an object such as "
                          "{\"rope_type\": \"linear\", \"factor\": 2.0}, or null")
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return theta, None
    if kind not in ROPE_SCALING_FIELDS:
        raise UnsupportedArchitectureError(
            f"rope_scaling type {str(kind)!r} in config.json is not supported; supported: "
            f"{', '.join(['default', *ROPE_SCALING_FIELDS])}"
        )
    _check_rope_scaling(_Fields(scaling, "config.json's rope_scaling", "config.json"), kind)
    return theta, scaling


def _check_rope_scaling(scaling: _Fields, kind: str) -> None:
    required, optional = ROPE_SCALING_FIELDS[kind]
    for key in required:
        scaling.number(key, minimum=0.0, above=True)
    for key in optional:
        if scaling.raw.get(key) is not None:
            scaling.number(key, minimum=0.0, above=not key.startswith("mscale"))
    if kind == "llama3" and scaling.raw["high_freq_factor"] <= scaling.raw["low_freq_factor"]:
        raise scaling.fail("high_freq_factor", scaling.raw["high_freq_factor"],
                           f"above low_freq_factor={scaling.raw['low_freq_factor']}")
    truncate = scaling.raw.get("truncate")
    if truncate is not None and not isinstance(truncate, bool):
        raise scaling.fail("truncate", truncate, "true or false")


def _dtype_name(fields: _Fields) -> str:
    value = fields.raw.get("torch_dtype") or fields.raw.get("dtype") or "float32"
    if not isinstance(value, str):
        raise fields.fail("torch_dtype", value, 'a dtype name such as "bfloat16"')
    return value


def _generation_defaults(gen: _Fields) -> dict[str, Any]:
    defaults = {}
    for key, types in _GENERATION_DEFAULTS.items():
        value = gen.raw.get(key)
        if value is None:
            continue
        if types == (bool,):
            ok = isinstance(value, bool)
        else:
            ok = _is_number(value) and value >= 0 and isinstance(value, types)
        if not ok:
            raise gen.fail(key, value, "true or false" if types == (bool,) else
                           "a non-negative " + ("integer" if types == (int,) else "number"))
        defaults[key] = value
    return defaults


class EngineOptions(BaseModel):
    """How to build an engine for one model folder. Frozen and validated at construction;
    `shared_generator` keeps one engine per folder and equal options.

    Attributes:
        device: "auto" (CUDA when present, else CPU), or a torch device string such as "cuda:1".
        dtype: "auto" (the checkpoint's dtype on CUDA, float32 on CPU), "bfloat16", "float16"
            or "float32".
        cache_tokens: KV cache size in tokens (rounded up to 256-token pages). It bounds how many
            tokens all running jobs together can hold, and how much prompt cache survives.
        cache_mode: "fp16" (the model's dtype), or quantized "q8", "q6", "q4".
        max_batch_size: most jobs running at once.
        max_chunk_size: most prompt tokens prefilled per step across all jobs.
        attention_backend: "auto", "sdpa", "triton" or "flash".
        dedup: share identical prompt pages among running jobs.
        prompt_cache: keep finished jobs' pages for reuse by later prompts.
        cuda_graphs: replay CUDA graphs for decode steps (CUDA only).
        compile_decode: torch.compile the captured decode step (CUDA only; slower start).
        draft_model_dir: a smaller model folder with the same tokenizer that drafts tokens
            for speculative decoding (loaded with the same device and dtype; its cache has the
            main cache's pages, in fp16). None: no draft model.
        use_ngram_draft: draft by prompt lookup instead (no second model).
        num_draft_tokens: the most drafts a job offers per step.
        tensor_parallel: split the model over that many processes of this host, one per GPU
            (`DynamicGenerator.from_model_dir`): the engine's process is rank 0 and starts
            the others; closing the engine ends them. 1 (default): one process. Must be at
            least 1, and the model must split over it (checked when the engine is built).
            A process runs one engine with tensor_parallel > 1 at a time.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    device: str = "auto"
    dtype: str = "auto"
    cache_tokens: int = Field(default=32768, ge=256)
    cache_mode: Literal["fp16", "q8", "q6", "q4"] = "fp16"
    max_batch_size: int = Field(default=256, ge=1)
    max_chunk_size: int = Field(default=2048, ge=16)
    attention_backend: Literal["auto", "sdpa", "triton", "flash"] = "auto"
    dedup: bool = True
    prompt_cache: bool = True
    cuda_graphs: bool = True
    compile_decode: bool = False
    draft_model_dir: str | None = None
    use_ngram_draft: bool = False
    num_draft_tokens: int = Field(default=4, ge=1, le=16)
    tensor_parallel: int = Field(default=1, ge=1)


def cache_root() -> Path:
    """Where dyngen keeps its files (downloaded and converted models, compiled helpers):
    ``$DYNGEN_CACHE_DIR``, else ``$XDG_CACHE_HOME/dyngen``, else ``~/.cache/dyngen``."""
    explicit = os.environ.get("DYNGEN_CACHE_DIR")
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "dyngen"
