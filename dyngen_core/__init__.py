"""dyngen: a dynamic-batching LLM inference engine with a paged KV cache.

The public API is the names below and the public modules `dyngen_core.errors`,
`dyngen_core.tools` and `dyngen_core.constraints`; everything else is internal. Public names are
imported lazily so that control-plane modules (pages, scheduler, job, ...) can be used without
importing torch.
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
    "FRAMEWORK_SAMPLING_FIELDS": "dyngen_core.engine.settings",
    "BackgroundGenerator": "dyngen_core.runtime.background",
    "JobHandle": "dyngen_core.runtime.handle",
    "SubmissionCoalescer": "dyngen_core.runtime.handle",
    "shared_generator": "dyngen_core.runtime.background",
    "EngineOptions": "dyngen_core.config",
    "PAGE_SIZE": "dyngen_core.config",
    "prefix_hashes": "dyngen_core.engine.pages",
    "TemplateLimits": "dyngen_core.text.template_sandbox",
    "errors": "dyngen_core.errors",
    "tools": "dyngen_core.tools",
    "constraints": "dyngen_core.constraints",
}
_MODULES = {"errors", "tools", "constraints"}

__all__ = sorted(_PUBLIC)


def __getattr__(name: str) -> Any:
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module 'dyngen_core' has no attribute {name!r}")
    if name in _MODULES:
        return importlib.import_module(module)
    return getattr(importlib.import_module(module), name)


def __dir__() -> list[str]:
    return __all__
