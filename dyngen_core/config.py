"""Frozen configuration records shared by the control and data planes.

`ModelConfig` is read from a Hugging Face ``config.json``; `CacheConfig`, `SchedulerConfig` and
`SpecConfig` hold the engine's knobs. Pure Python: no torch here (the control plane imports it).
"""

from __future__ import annotations

import json
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
        """Build from a parsed config.json (and optionally generation_config.json)."""
        archs = raw.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise UnsupportedArchitectureError(
                f"architecture {archs or '(none given)'} is not supported; supported: "
                f"{', '.join(SUPPORTED_ARCHITECTURES)}. Check 'architectures' in config.json."
            )
        generation = generation or {}
        num_heads = int(raw["num_attention_heads"])
        hidden = int(raw["hidden_size"])
        rope_theta, rope_scaling = _rope_fields(raw)
        return cls(
            architecture=arch,
            vocab_size=int(raw["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(raw["intermediate_size"]),
            num_layers=int(raw["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or num_heads),
            head_dim=int(raw.get("head_dim") or hidden // num_heads),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=int(raw.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=bool(raw.get("attention_bias", arch == "Qwen2ForCausalLM")),
            qk_norm=arch == "Qwen3ForCausalLM",
            bos_token_id=_first_id(generation.get("bos_token_id", raw.get("bos_token_id"))),
            eos_token_ids=_all_ids(raw.get("eos_token_id"), generation.get("eos_token_id")),
            torch_dtype=str(raw.get("torch_dtype") or raw.get("dtype") or "float32"),
            generation_defaults={
                k: v
                for k, v in generation.items()
                if k in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty",
                         "do_sample")
            },
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
        raw = _read_json(config_path)
        gen_path = folder / "generation_config.json"
        generation = _read_json(gen_path) if gen_path.is_file() else None
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


@dataclass(frozen=True)
class SpecConfig:
    """Speculative decoding: ``kind`` is None (off), "ngram" or "draft"; ``num_draft_tokens``
    is how many tokens are proposed per step."""

    kind: str | None = None
    num_draft_tokens: int = 4


def _read_json(path: Path) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except json.JSONDecodeError as exc:
        raise ModelFolderError(f"{str(path)!r} is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise ModelFolderError(f"{str(path)!r} must hold a JSON object")
    return data


def _rope_fields(raw: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, rope_scaling) from either config.json layout: transformers < 5 writes
    ``rope_theta`` + ``rope_scaling``; transformers 5 writes one ``rope_parameters`` dict."""
    params = dict(raw.get("rope_parameters") or {})
    theta = float(raw.get("rope_theta") or params.pop("rope_theta", 10000.0))
    params.pop("rope_theta", None)
    scaling = raw.get("rope_scaling") or params or None
    if scaling and scaling.get("rope_type", scaling.get("type")) == "default":
        scaling = None
    return theta, scaling


def _first_id(value: Any) -> int | None:
    if isinstance(value, list):
        return int(value[0]) if value else None
    return None if value is None else int(value)


def _all_ids(*values: Any) -> tuple[int, ...]:
    ids: list[int] = []
    for value in values:
        for v in value if isinstance(value, list) else [value]:
            if v is not None and int(v) not in ids:
                ids.append(int(v))
    return tuple(ids)


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
