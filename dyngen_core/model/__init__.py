"""The Llama-family model runtime: `Model` (load a Hugging Face folder, run paged forwards)."""

from dyngen_core.model.model import Model

__all__ = ["Model"]
