"""A model split over two gloo ranks computes the logits of the same model in one process.

Tiny models cover both KV-head layouts: a Llama with biases on every projection, 2 KV heads
(sharded: one per rank) and a vocabulary of 511 (the last vocabulary shard padded); a Qwen2
with tied embeddings, q/k/v biases and 1 KV head (replicated on both ranks); a Qwen3 (per-head
q/k norms, head_dim 32 apart from hidden_size / heads), also over a q4 cache. Each runs the same
steps through the real paged path (ForwardBatch, an fp16 storage of small shuffled pages, the
sdpa backend): two prompts, one prefilled whole and one in two chunks beside the other's
decodes, then decode steps of both.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from dyngen_core.engine.plan import SequenceSlice, StepPlan
from dyngen_core.kv.attention import SdpaBackend
from dyngen_core.kv.attention.base import build_forward_batch
from dyngen_core.kv.cache import Cache
from dyngen_core.model import Model
from dyngen_core.model.parallel import shard_heads
from tests.tensor_parallel_ranks import run_ranks

PAGE_SIZE = 16
TOLERANCE = 1e-4
# A quantized cache may round a key one code step apart where the two computations differ in
# the last bit; a wrong head layout would be off by the logits' own size (about 3).
QUANTIZED_TOLERANCE = 5e-3
# name: (architecture, config overrides, cache mode)
CASES = {
    "kv_heads_sharded": ("llama", {"num_key_value_heads": 2, "attention_bias": True,
                                   "vocab_size": 511}, "fp16"),
    "kv_heads_replicated": ("qwen2", {"num_key_value_heads": 1}, "fp16"),
    "qk_norm": ("qwen3", {"num_key_value_heads": 2}, "fp16"),
    "q4_cache": ("qwen3", {"num_key_value_heads": 2}, "q4"),
}


def steps(vocab: int) -> list[list[SequenceSlice]]:
    """The fixed steps: prompt A (9 tokens) whole and prompt B (37 tokens) in chunks of 20 and
    17 beside A's decode, then three decode steps of both (page tables shuffled)."""
    rng = random.Random(1)
    a = [rng.randrange(vocab) for _ in range(9 + 4)]
    b = [rng.randrange(vocab) for _ in range(37 + 3)]
    pages = list(range(12))
    rng.shuffle(pages)
    table_a, table_b = pages[:2], pages[2:6]

    def piece(job: int, ids: list[int], start: int, end: int) -> SequenceSlice:
        table = table_a if job == 0 else table_b
        return SequenceSlice(job_id=job, token_ids=ids[start:end], start_pos=start,
                             page_table=table, sample=True)

    plan = [[piece(0, a, 0, 9), piece(1, b, 0, 20)], [piece(0, a, 9, 10), piece(1, b, 20, 37)]]
    plan += [[piece(0, a, 10 + i, 11 + i), piece(1, b, 37 + i, 38 + i)] for i in range(3)]
    return plan


def run_steps(model: Model, mode: str) -> list[torch.Tensor]:
    """The logits of every step of `steps` over a cache of ``mode`` (rank 0's, or the empty
    ones of other ranks). Quantized modes calibrate their key offsets on every rank."""
    cache = Cache(model, max_tokens=12 * PAGE_SIZE, page_size=PAGE_SIZE, mode=mode)
    logits = []
    for slices in steps(model.config.vocab_size):
        batch = build_forward_batch(StepPlan(slices=slices), PAGE_SIZE, model.device)
        logits.append(model.forward(batch, cache.storage, SdpaBackend()))
    return logits


def rank_main(rank: int, world_size: int, job: tuple[list[Path], Path]) -> None:
    """One rank: load each model split over the group, run the steps, and (rank 0) save the
    logits beside the model; checks the cache holds only this rank's KV heads."""
    folders, out = job
    for i, (folder, (_, _, mode)) in enumerate(zip(folders, CASES.values(), strict=True)):
        model = Model.load(folder, tensor_parallel=world_size)
        assert model.parallel.rank == rank and dist.get_backend() == "gloo"
        logits = run_steps(model, mode)
        expected_heads = shard_heads(model.config, model.parallel).num_kv_heads
        assert model.local_config.num_kv_heads == expected_heads
        if rank == 0:
            torch.save(logits, out / f"{i}.pt")
        else:
            assert all(step.shape[1] == 0 for step in logits)


@pytest.fixture(scope="module")
def case_dirs(tiny_model_factory: Callable[..., Path]) -> list[Path]:
    return [tiny_model_factory(arch, **overrides) for arch, overrides, _ in CASES.values()]


def test_tensor_parallel_logits_equal_single_process(case_dirs: list[Path],
                                                     tmp_path: Path) -> None:
    # The ranks join the group as under torchrun: from its variables, inside Model.load.
    run_ranks(rank_main, 2, (case_dirs, tmp_path), limit_s=150, torchrun_env=True)
    for i, (folder, (name, (_, _, mode))) in enumerate(zip(case_dirs, CASES.items(),
                                                            strict=True)):
        alone = run_steps(Model.load(folder), mode)
        tolerance = TOLERANCE if mode == "fp16" else QUANTIZED_TOLERANCE
        split = torch.load(tmp_path / f"{i}.pt")
        assert len(split) == len(alone)
        for step, (ours, ref) in enumerate(zip(split, alone, strict=True)):
            assert ours.shape == ref.shape, (name, step)
            diff = (ours - ref).abs().max().item()
            assert diff <= tolerance, f"{name} step {step}: max abs diff {diff:.2e}"


def test_tensor_parallel_heads_shard_or_replicate(case_dirs: list[Path]) -> None:
    """The head layout of each rank: sharded KV heads are disjoint, a replicated KV head is the
    one its query heads read; heads that cannot be laid out fail with the field named."""
    from dataclasses import replace

    from dyngen_core.config import ModelConfig
    from dyngen_core.model.parallel import TensorParallel

    config = ModelConfig.from_model_dir(case_dirs[0])  # 4 heads, 2 KV heads
    shards = [shard_heads(config, TensorParallel(rank, 2)) for rank in range(2)]
    assert [(s.q_start, s.num_heads, s.kv_start, s.num_kv_heads) for s in shards] == [
        (0, 2, 0, 1), (2, 2, 1, 1)]
    four = [shard_heads(config, TensorParallel(rank, 4)) for rank in range(4)]
    assert [s.kv_start for s in four] == [0, 0, 1, 1]  # query heads 0-1 read KV head 0
    with pytest.raises(ValueError, match="num_attention_heads=4"):
        shard_heads(config, TensorParallel(0, 3))
    odd = replace(config, num_heads=6, num_kv_heads=3)
    with pytest.raises(ValueError, match="num_key_value_heads=3"):
        shard_heads(odd, TensorParallel(0, 2))
