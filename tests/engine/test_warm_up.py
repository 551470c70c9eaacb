"""The start-up prefills a generator runs on CUDA (`plan.warm_up_plans`): they write only free
pages, so jobs after it (greedy, sampled, constrained, a cancel and a failing row) produce what
they produce without it, whatever the cache and drafter; and their short lengths, which the
data plane names (`ModelRunner.short_prefill_lengths`: the Triton backend's short prefill
tiles), reach every launch shape a short prefill can take. (The generator runs it on CUDA only;
these tests call it on the CPU.)"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from dyngen_core import Cache, DynamicGenerator, Model, Tokenizer
from dyngen_core.engine.plan import WARM_UP_JOB_ID, warm_up_plans
from dyngen_core.kv.attention.sdpa import SdpaBackend
from dyngen_core.kv.attention.triton import prefill
from dyngen_core.kv.attention.triton.paged import TritonPagedBackend
from dyngen_core.runtime.runner import ModelRunner
from tests.engine.step_helpers import run_mixed_jobs
from tests.tiny_models import load_quantizable_model

SHORTS = (2, 4, 8, 16)


@pytest.fixture(scope="module")
def quantizable(tmp_path_factory: pytest.TempPathFactory) -> Model:
    """A tiny model whose head_dim (32) quantized caches accept."""
    model, _ = load_quantizable_model(tmp_path_factory.mktemp("warm_up"))
    return model


def test_the_warm_up_prefills_the_largest_chunk_that_fits_then_short_ones() -> None:
    big, *short = warm_up_plans(1000, page_size=256, num_pages=8, short_lengths=(16, 2, 8, 4))
    (piece,) = big.slices
    assert piece.job_id == WARM_UP_JOB_ID and piece.start_pos == 0 and piece.sample
    assert len(piece.token_ids) == 1000 and piece.page_table == [0, 1, 2, 3]
    assert [len(p.slices[0].token_ids) for p in short] == list(SHORTS)
    for plan in short:
        (piece,) = plan.slices
        assert piece.start_pos == 0 and piece.page_table == [0] and piece.sample
    capped = warm_up_plans(5000, page_size=256, num_pages=3)[0].slices[0]
    assert len(capped.token_ids) == 768 and capped.page_table == [0, 1, 2]
    assert len(warm_up_plans(5000, page_size=256, num_pages=3)) == 1  # no short lengths named
    # 5 tokens: shorts of 2 and 4; 8 and 16 are capped to 5, the long prefill itself.
    tiny = warm_up_plans(5, page_size=4, num_pages=2, short_lengths=SHORTS)
    assert [len(p.slices[0].token_ids) for p in tiny] == [5, 2, 4]
    assert tiny[0].slices[0].page_table == [0, 1]
    # A short length past a page spans the pages it needs.
    (_, long_short) = warm_up_plans(100, page_size=16, num_pages=8, short_lengths=(40,))
    assert long_short.slices[0].page_table == [0, 1, 2]
    with pytest.raises(ValueError, match="max_tokens=0"):
        warm_up_plans(0, page_size=256, num_pages=3)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("group", [1, 2, 3, 4, 6, 8, 16])
def test_the_short_lengths_reach_every_short_prefill_shape(dtype: torch.dtype,
                                                           group: int) -> None:
    """Every prompt length takes a tile that the warm-up compiles: the long prefill's (the full
    tile) or one of the short lengths', each of those a shape of its own."""
    tiled = prefill.TiledPrefill()
    lengths = tiled.short_query_lengths(dtype, group)
    assert list(lengths) == sorted(set(lengths)) and min(lengths, default=2) >= prefill.MIN_QUERY
    tiles = [tiled.tile(n, dtype, group) for n in lengths]
    assert len(set(tiles)) == len(tiles)
    warmed = {*tiles, tiled.tile(1 << 20, dtype, group)}
    for n in range(prefill.MIN_QUERY, 4 * prefill.ROWS):
        assert tiled.tile(n, dtype, group) in warmed, n


def test_one_head_a_group_warms_chunks_past_16_tokens() -> None:
    """With one query head per KV head a tile's rows are all tokens, so chunks of 17-64
    tokens (a question, a chunk beside running decodes) take tiles of their own: the warm-up
    reaches them (a fixed 2, 4, 8, 16 did not)."""
    tiled = prefill.TiledPrefill()
    lengths = tiled.short_query_lengths(torch.bfloat16, 1)
    assert max(lengths) > 16
    assert tiled.tile(30, torch.bfloat16, 1) in {tiled.tile(n, torch.bfloat16, 1)
                                                 for n in lengths}


def test_the_runner_names_the_triton_backends_short_lengths_over_float_pages(
        engine_parts: tuple[Model, Tokenizer], quantizable: Model) -> None:
    """The generator's warm-up asks its runner: the Triton backend names its tiled prefill's
    short lengths over float pages whose page size its key step divides, and none over
    quantized pages (one paged-kernel shape serves every prefill there), the sdpa backend
    none."""
    model, _ = engine_parts
    group = model.config.num_heads // model.config.num_kv_heads
    fp16 = ModelRunner(model, Cache(model, max_tokens=1024), TritonPagedBackend(),
                       cuda_graphs=False)
    assert fp16.short_prefill_lengths() == \
        prefill.TiledPrefill().short_query_lengths(model.dtype, group)
    assert fp16.short_prefill_lengths()
    q4 = ModelRunner(quantizable, Cache(quantizable, max_tokens=1024, mode="q4"),
                     TritonPagedBackend(), cuda_graphs=False)
    assert q4.short_prefill_lengths() == ()
    sdpa = ModelRunner(model, Cache(model, max_tokens=1024), SdpaBackend(), cuda_graphs=False)
    assert sdpa.short_prefill_lengths() == ()
    odd_pages = Cache(model, max_tokens=1024)
    odd_pages.storage.page_size = 48  # not a multiple of the fp32 key step (32)
    assert TritonPagedBackend().short_prefill_lengths(odd_pages.storage, model.dtype,
                                                      group) == ()


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
    expected = run_mixed_jobs(plain)
    warmed = build()
    # What the constructor does on CUDA, with the short lengths of a Triton backend there.
    warmed._runner.short_prefill_lengths = lambda: SHORTS  # type: ignore[method-assign]
    warmed._warm_up(1500)
    assert run_mixed_jobs(warmed) == expected
    for generator in (plain, warmed):
        generator.check_invariant()
        assert generator.stats().prefill_tokens_computed == \
            plain.stats().prefill_tokens_computed
