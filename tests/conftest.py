"""Shared fixtures: tiny random Llama-family models written once per test session.

`tiny_model_dir` is parametrized over every tiny architecture (use it to run a test for all of
them); `tiny_llama_dir` is the plain Llama one; `tiny_model_factory` writes a fresh variant.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.tiny_models import TINY_ARCHS, write_tiny_model


@pytest.fixture(scope="session")
def tiny_model_factory(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """``factory(arch="llama", seed=0, **config_overrides) -> Path``: a new tiny model folder."""

    def factory(arch: str = "llama", seed: int = 0, **config_overrides: Any) -> Path:
        folder = tmp_path_factory.mktemp(f"tiny-{arch}")
        return write_tiny_model(folder, arch, seed, **config_overrides)

    return factory


@pytest.fixture(scope="session")
def tiny_model_dirs(tiny_model_factory: Callable[..., Path]) -> Callable[[str], Path]:
    """``dirs(arch) -> Path``: the session's shared tiny model of ``arch`` (written once)."""
    written: dict[str, Path] = {}

    def folder_for(arch: str) -> Path:
        if arch not in written:
            written[arch] = tiny_model_factory(arch)
        return written[arch]

    return folder_for


@pytest.fixture(scope="session", params=TINY_ARCHS)
def tiny_arch(request: pytest.FixtureRequest) -> str:
    """Each tiny architecture in turn: llama, llama3 (rope scaling), mistral, qwen2, qwen3."""
    return str(request.param)


@pytest.fixture(scope="session")
def tiny_model_dir(tiny_arch: str, tiny_model_dirs: Callable[[str], Path]) -> Path:
    """The shared tiny model folder of ``tiny_arch`` (a test using it runs for every arch)."""
    return tiny_model_dirs(tiny_arch)


@pytest.fixture(scope="session")
def tiny_llama_dir(tiny_model_dirs: Callable[[str], Path]) -> Path:
    """The shared tiny Llama model folder."""
    return tiny_model_dirs("llama")


# The real demo model (SmolLM2-135M-Instruct), fetched and converted once per machine.
from tests.conftest_demo import demo_gguf_file, demo_model_dir  # noqa: E402, F401
