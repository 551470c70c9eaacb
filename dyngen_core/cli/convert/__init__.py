"""Model conversion: GGUF files to Hugging Face folders, and the cached demo model."""

from __future__ import annotations

from dyngen_core.cli.convert.demo import default_demo_dir, fetch_demo_model
from dyngen_core.cli.convert.gguf import convert_gguf

__all__ = ["convert_gguf", "default_demo_dir", "fetch_demo_model"]
