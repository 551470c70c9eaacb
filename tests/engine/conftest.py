"""Fixtures for engine tests: a tiny random Llama and generators whose page invariant is checked
when each test ends (DESIGN.md §4)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from dyngen_core import Cache, DynamicGenerator, Model, Tokenizer
from tests.tiny_models import write_tiny_model


@pytest.fixture(scope="session")
def engine_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("engine_llama"), arch="llama", seed=3)


@pytest.fixture(scope="session")
def engine_parts(engine_model_dir: Path) -> tuple[Model, Tokenizer]:
    model = Model.load(engine_model_dir, device="cpu", dtype="float32")
    return model, Tokenizer.from_model_dir(engine_model_dir)


@pytest.fixture
def make_generator(
    engine_parts: tuple[Model, Tokenizer],
) -> Iterator[Callable[..., DynamicGenerator]]:
    """Build generators over the shared tiny model; every one is invariant-checked at teardown."""
    made: list[DynamicGenerator] = []

    def make(cache_tokens: int = 8192, **options: Any) -> DynamicGenerator:
        model, tokenizer = engine_parts
        cache = Cache(model, max_tokens=cache_tokens)
        generator = DynamicGenerator(model=model, cache=cache, tokenizer=tokenizer, **options)
        made.append(generator)
        return generator

    yield make
    for generator in made:
        generator.check_invariant()
