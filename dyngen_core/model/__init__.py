"""The Llama-family model runtime: `Model` (load a Hugging Face folder, run paged forwards)."""

from dyngen_core.models.model import Model

__all__ = ["Model"]
