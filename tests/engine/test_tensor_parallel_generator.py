"""A generator over a model split on two gloo ranks writes the same greedy text as one process.

Rank 0 builds the DynamicGenerator; rank 1 serves its steps (`serve_tensor_parallel_worker`).
The prompts share a long prefix (dedup and prompt-cache hits) and the cache is small enough to
preempt running jobs; steps overlap (decode inputs reach rank 1 by a tensor broadcast). The page
invariant is checked on rank 0 after the run, as the engine fixtures do.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dyngen_core import Cache, DynamicGenerator, Model, SamplerSettings, Tokenizer
from dyngen_core.runtime.tensor_parallel import serve_tensor_parallel_worker
from tests.tensor_parallel_ranks import run_ranks
from tests.tiny_models import TRAINING_TEXT

PAGE_SIZE = 16
CACHE_TOKENS = 8 * PAGE_SIZE
SHARED = TRAINING_TEXT[:160]
PROMPTS = [SHARED + tail for tail in (" Elias", " The mayor", " Once", " Time", " Pack")]


def make_cache(model: Model) -> Cache:
    return Cache(model, max_tokens=CACHE_TOKENS, page_size=PAGE_SIZE)


def generate(model: Model, folder: Path) -> tuple[list[str], dict[str, int]]:
    """Greedy texts of PROMPTS and the run's page stats (rank 0, or one process)."""
    generator = DynamicGenerator(model, make_cache(model), Tokenizer.from_model_dir(folder),
                                 attention_backend="sdpa", max_batch_size=4)
    try:
        texts = generator.generate(PROMPTS, max_new_tokens=10, add_bos=True,
                                   stop_conditions=[], gen_settings=SamplerSettings.greedy())
        generator.check_invariant()
        stats = generator.stats()
        return texts, {"preemptions": stats.preemptions,
                       "reused": stats.prefill_tokens_reused}
    finally:
        generator.close()


def rank_main(rank: int, world_size: int, job: tuple[Path, Path]) -> None:
    folder, out = job
    model = Model.load(folder, tensor_parallel=world_size)
    if rank == 0:
        texts, stats = generate(model, folder)
        (out / "rank0.json").write_text(json.dumps([texts, stats]), encoding="utf-8")
    else:
        steps = serve_tensor_parallel_worker(model, make_cache(model))
        (out / "steps.txt").write_text(str(steps), encoding="utf-8")


def test_tensor_parallel_generator_matches_one_process(engine_model_dir: Path,
                                                       tmp_path: Path) -> None:
    run_ranks(rank_main, 2, (engine_model_dir, tmp_path), limit_s=150)
    alone, stats = generate(Model.load(engine_model_dir), engine_model_dir)
    assert stats["preemptions"] > 0 and stats["reused"] > 0, stats
    split, split_stats = json.loads((tmp_path / "rank0.json").read_text(encoding="utf-8"))
    assert split == alone
    assert split_stats == stats
    assert int((tmp_path / "steps.txt").read_text(encoding="utf-8")) > 0


def test_tensor_parallel_needs_a_group(engine_model_dir: Path,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(RuntimeError, match="torchrun"):
        Model.load(engine_model_dir, tensor_parallel=2)
