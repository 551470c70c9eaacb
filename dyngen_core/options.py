"""`EngineOptions`: the engine settings every front end shares (CLI, LangChain, LlamaIndex).

Defined once here so that adapters validate the same fields with the same messages, and so that
`shared_generator` can tell when two callers ask for the same engine. Pure Python (pydantic).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from dyngen_core.config import CacheConfig, SchedulerConfig


class EngineOptions(BaseModel):
    """How to build an engine for one model folder.

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

    def cache_config(self) -> CacheConfig:
        return CacheConfig(max_tokens=self.cache_tokens, mode=self.cache_mode)

    def scheduler_config(self) -> SchedulerConfig:
        return SchedulerConfig(
            max_batch_size=self.max_batch_size,
            max_chunk_size=self.max_chunk_size,
            dedup=self.dedup,
            prompt_cache=self.prompt_cache,
        )
