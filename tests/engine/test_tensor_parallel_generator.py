"""A generator over a model split on two gloo ranks writes the same greedy text as one process.

Rank 0 builds the DynamicGenerator; rank 1 serves its steps (`serve_tensor_parallel_worker`).
The prompts share a long prefix (dedup and prompt-cache hits) and the cache is small enough to
preempt running jobs. Two runs: one whose steps overlap (decode inputs reach rank 1 by a tensor
broadcast), and one with n-gram drafts that rank 0 verifies (rank 1 runs the verify forwards).
The page invariant is checked on rank 0 after each run, as the engine fixtures do.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from dyngen_core import Cache, DynamicGenerator, Model, SamplerSettings, Tokenizer
from dyngen_core.model.parallel import TensorParallel
from dyngen_core.runtime.tensor_parallel import serve_tensor_parallel_worker
from tests.tensor_parallel_ranks import run_ranks
from tests.tiny_models import TRAINING_TEXT

PAGE_SIZE = 16
CACHE_TOKENS = 8 * PAGE_SIZE
SHARED = TRAINING_TEXT[:160]
PROMPTS = [SHARED + tail for tail in (" Elias", " The mayor", " Once", " Time", " Pack")]
RUNS = ({}, {"use_ngram_draft": True})


def make_cache(model: Model) -> Cache:
    return Cache(model, max_tokens=CACHE_TOKENS, page_size=PAGE_SIZE)


def generate(model: Model, folder: Path, **options: Any) -> tuple[list[str], dict[str, int]]:
    """Greedy texts of PROMPTS and the run's page and draft stats (rank 0, or one process)."""
    generator = DynamicGenerator(model, make_cache(model), Tokenizer.from_model_dir(folder),
                                 attention_backend="sdpa", max_batch_size=4, **options)
    try:
        texts = generator.generate(PROMPTS, max_new_tokens=10, add_bos=True,
                                   stop_conditions=[], gen_settings=SamplerSettings.greedy())
        generator.check_invariant()
        stats = generator.stats()
        return texts, {"preemptions": stats.preemptions,
                       "reused": stats.prefill_tokens_reused,
                       "drafts": stats.draft_tokens_accepted + stats.draft_tokens_rejected}
    finally:
        generator.close()


def rank_main(rank: int, world_size: int, job: tuple[Path, Path]) -> None:
    folder, out = job
    model = Model.load(folder, tensor_parallel=world_size)
    if rank == 0:
        runs = [generate(model, folder, **options) for options in RUNS]
        (out / "rank0.json").write_text(json.dumps(runs), encoding="utf-8")
    else:
        steps = [serve_tensor_parallel_worker(model, make_cache(model)) for _ in RUNS]
        (out / "steps.json").write_text(json.dumps(steps), encoding="utf-8")


def test_tensor_parallel_generator_matches_one_process(engine_model_dir: Path,
                                                       tmp_path: Path) -> None:
    run_ranks(rank_main, 2, (engine_model_dir, tmp_path), limit_s=150)
    model = Model.load(engine_model_dir)
    alone = [generate(model, engine_model_dir, **options) for options in RUNS]
    split = json.loads((tmp_path / "rank0.json").read_text(encoding="utf-8"))
    (plain_texts, plain_stats), (draft_texts, draft_stats) = alone
    assert plain_stats["preemptions"] > 0 and plain_stats["reused"] > 0, plain_stats
    assert split[0] == [plain_texts, plain_stats]
    # Draft lengths follow measured step times, so the drafted run's page history may vary:
    # its text must not, and it must have drafted.
    assert split[1][0] == draft_texts == plain_texts
    assert split[1][1]["drafts"] > 0 and draft_stats["drafts"] > 0
    assert all(steps > 0 for steps in json.loads((tmp_path / "steps.json").read_text()))


def test_tensor_parallel_needs_a_group(engine_model_dir: Path,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(RuntimeError, match="torchrun"):
        Model.load(engine_model_dir, tensor_parallel=2)


def test_tensor_parallel_misuse_is_refused(engine_model_dir: Path) -> None:
    """A split draft model, and a worker loop over a model in one process, fail at once."""
    model = Model.load(engine_model_dir)
    draft = Model.load(engine_model_dir)
    draft.parallel = TensorParallel(rank=0, size=2)
    tokenizer = Tokenizer.from_model_dir(engine_model_dir)
    with pytest.raises(ValueError, match="draft model runs whole on rank 0"):
        DynamicGenerator(model, make_cache(model), tokenizer, draft_model=draft)
    with pytest.raises(ValueError, match="ranks 1 and up"):
        serve_tensor_parallel_worker(model, make_cache(model))
