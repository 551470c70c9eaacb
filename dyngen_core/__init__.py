"""dyngen: a dynamic-batching LLM inference engine with a paged KV cache.

Public names are imported lazily so that control-plane modules (pages, scheduler, job, ...) can be
used without importing torch.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_PUBLIC = {
    "Model": "dyngen_core.model",
    "Cache": "dyngen_core.kv.cache",
    "Tokenizer": "dyngen_core.text.tokenizer",
    "DynamicGenerator": "dyngen_core.runtime.generator",
    "Job": "dyngen_core.engine.job",
    "Result": "dyngen_core.engine.results",
    "GeneratorStats": "dyngen_core.engine.results",
    "EosReason": "dyngen_core.engine.results",
    "SamplerSettings": "dyngen_core.engine.settings",
    "BackgroundGenerator": "dyngen_core.runtime.background",
    "JobHandle": "dyngen_core.runtime.background",
    "shared_generator": "dyngen_core.runtime.background",
    "EngineOptions": "dyngen_core.config",
    "errors": "dyngen_core.errors",
}

__all__ = sorted(_PUBLIC)


def __getattr__(name: str) -> Any:
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module 'dyngen_core' has no attribute {name!r}")
    if name == "errors":
        return importlib.import_module(module)
    return getattr(importlib.import_module(module), name)


def __dir__() -> list[str]:
    return __all__
