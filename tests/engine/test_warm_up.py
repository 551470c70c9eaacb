"""The start-up prefill a generator runs on CUDA (`plan.warm_up_plan`): it writes only free
pages, so jobs after it produce what they produce without it, whatever the cache and drafter.
(The generator runs it on CUDA only; these tests call it on the CPU.)"""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

import pytest

from dyngen_core import Cache, DynamicGenerator, Job, Model, SamplerSettings, Tokenizer
from dyngen_core.engine.plan import WARM_UP_JOB_ID, warm_up_plan
from tests.tiny_models import write_tiny_model


@pytest.fixture(scope="module")
def quantizable(tmp_path_factory: pytest.TempPathFactory) -> Model:
    """A tiny model whose head_dim (32) quantized caches accept."""
    folder: Path = write_tiny_model(tmp_path_factory.mktemp("warm_up"), arch="llama", seed=5,
                                    hidden_size=128, intermediate_size=256,
                                    num_attention_heads=4, num_key_value_heads=2)
    return Model.load(folder, device="cpu", dtype="float32")


def test_the_warm_up_plan_prefills_the_largest_chunk_that_fits_from_page_zero() -> None:
    plan = warm_up_plan(1000, page_size=256, num_pages=8)
    (piece,) = plan.slices
    assert piece.job_id == WARM_UP_JOB_ID and piece.start_pos == 0 and piece.sample
    assert len(piece.token_ids) == 1000 and piece.page_table == [0, 1, 2, 3]
    capped = warm_up_plan(5000, page_size=256, num_pages=3).slices[0]
    assert len(capped.token_ids) == 768 and capped.page_table == [0, 1, 2]
    with pytest.raises(ValueError, match="max_tokens=0"):
        warm_up_plan(0, page_size=256, num_pages=3)


def _jobs() -> list[Job]:
    rng = random.Random(5)
    shared = [rng.randrange(10, 500) for _ in range(300)]
    return [Job(input_ids=shared + [rng.randrange(10, 500) for _ in range(9 + i)],
                max_new_tokens=6, stop_conditions=[], gen_settings=SamplerSettings.greedy(),
                identifier=i) for i in range(5)]


def _tokens(generator: DynamicGenerator) -> dict[int, list[int]]:
    generator.enqueue(_jobs())
    finals: dict[int, list[int]] = {}
    while generator.num_remaining_jobs():
        for result in generator.iterate():
            if result["eos"]:
                finals[result["identifier"]] = result["token_ids"]
    return finals


@pytest.mark.parametrize("case", ["fp16", "q4", "ngram", "draft_model"])
def test_jobs_after_the_warm_up_produce_the_same_tokens(
        case: str, engine_parts: tuple[Model, Tokenizer], quantizable: Model,
        make_generator: Callable[..., DynamicGenerator]) -> None:
    model, tokenizer = engine_parts

    def build() -> DynamicGenerator:
        if case == "q4":
            # q4 keeps a recent window per sequence slot: the warm-up's slot is taken too.
            return DynamicGenerator(model=quantizable, tokenizer=tokenizer,
                                    cache=Cache(quantizable, max_tokens=4096, mode="q4"))
        options = {"ngram": {"use_ngram_draft": True},
                   "draft_model": {"draft_model": model}}.get(case, {})
        return make_generator(cache_tokens=4096, **options)

    plain = build()
    expected = _tokens(plain)
    warmed = build()
    warmed._warm_up(1500)  # what the constructor does on CUDA
    assert _tokens(warmed) == expected
    for generator in (plain, warmed):
        generator.check_invariant()
        assert generator.stats().prefill_tokens_computed == \
            plain.stats().prefill_tokens_computed
