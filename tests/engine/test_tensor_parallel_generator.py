"""A generator over a model split on two gloo ranks writes the same greedy text as one process.

Rank 0 builds the DynamicGenerator; rank 1 serves its steps (`serve_tensor_parallel_worker`).
The prompts share a long prefix (dedup and prompt-cache hits) and the cache is small enough to
preempt running jobs. Two runs: one whose steps overlap (decode inputs reach rank 1 by a tensor
broadcast), and one with n-gram drafts that rank 0 verifies (rank 1 runs the verify forwards).
The page invariant is checked on rank 0 after each run, as the engine fixtures do. Before
the generator runs, the ranks pass plans and fed ids over the step channel alone (one longer
than a single broadcast holds).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from dyngen_core import Cache, DynamicGenerator, Model, SamplerSettings, Tokenizer
from dyngen_core.engine.plan import PENDING_TOKEN, PageCopy, SequenceSlice, StepPlan
from dyngen_core.model.parallel import TensorParallel
from dyngen_core.runtime.overlap import TokenFeed
from dyngen_core.runtime.tensor_parallel import StepChannel, serve_tensor_parallel_worker
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
    """The step channel's own exchange first (`channel_main`), then the generator runs."""
    folder, out = job
    channel_main(rank, world_size, out / "channel.json")
    model = Model.load(folder, tensor_parallel=world_size)
    if rank == 0:
        runs = [generate(model, folder, **options) for options in RUNS]
        (out / "rank0.json").write_text(json.dumps(runs), encoding="utf-8")
    else:
        steps = [serve_tensor_parallel_worker(model, make_cache(model)) for _ in RUNS]
        (out / "steps.json").write_text(json.dumps(steps), encoding="utf-8")


@pytest.fixture(scope="module")
def ranks_out(engine_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The folder the two ranks of `rank_main` wrote to (they run once for the module's
    tests: spawning them is the slow part)."""
    out = tmp_path_factory.mktemp("tensor_parallel_ranks")
    run_ranks(rank_main, 2, (engine_model_dir, out), limit_s=150)
    return out


def test_tensor_parallel_generator_matches_one_process(engine_model_dir: Path,
                                                       ranks_out: Path) -> None:
    model = Model.load(engine_model_dir)
    alone = [generate(model, engine_model_dir, **options) for options in RUNS]
    split = json.loads((ranks_out / "rank0.json").read_text(encoding="utf-8"))
    (plain_texts, plain_stats), (draft_texts, draft_stats) = alone
    assert plain_stats["preemptions"] > 0 and plain_stats["reused"] > 0, plain_stats
    assert split[0] == [plain_texts, plain_stats]
    # Draft lengths follow measured step times, so the drafted run's page history may vary:
    # its text must not, and it must have drafted.
    assert split[1][0] == draft_texts == plain_texts
    assert split[1][1]["drafts"] > 0 and draft_stats["drafts"] > 0
    assert all(steps > 0 for steps in json.loads((ranks_out / "steps.json").read_text()))


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


CHANNEL_PLANS = [
    StepPlan([SequenceSlice(1, [PENDING_TOKEN], 40, [0], True),
              SequenceSlice(2, [PENDING_TOKEN], 41, [1], True)]),
    StepPlan([SequenceSlice(3, list(range(3000)), 0, list(range(12)), True)],
             [PageCopy(4, 5, 7)]),  # more words than one broadcast holds
    StepPlan([SequenceSlice(6, [9], 50, [2], True, draft_ids=[1, 2]),
              SequenceSlice(7, [PENDING_TOKEN], 60, [3], True)]),
]


def channel_main(rank: int, world_size: int, out: Path) -> None:
    """Rank 0 sends CHANNEL_PLANS (the first fed in order, the third out of order) and a stop;
    rank 1 writes what it received."""
    channel = StepChannel(TensorParallel(rank, world_size, dist.group.WORLD, dist.group.WORLD))
    ids = torch.tensor([21, 22, 23], dtype=torch.int64)
    feeds = [TokenFeed(ids, [0, 1], [0, 1], in_order=True), None,
             TokenFeed(ids, [3], [2])]
    if rank == 0:
        for plan, feed in zip(CHANNEL_PLANS, feeds, strict=True):
            channel.send_step(plan, feed)
        channel.send_stop()
        return
    received = []
    while (message := channel.receive()) is not None:
        received.append([message.plan == plan for plan in CHANNEL_PLANS]
                        + [message.feed_targets, message.feed_values])
    out.write_text(json.dumps(received), encoding="utf-8")


def test_tensor_parallel_channel_carries_plans_and_fed_ids(ranks_out: Path) -> None:
    assert json.loads((ranks_out / "channel.json").read_text(encoding="utf-8")) == [
        [True, False, False, [0, 1], [21, 22]],
        [False, True, False, None, None],
        [False, False, True, [3], [23]],
    ]
