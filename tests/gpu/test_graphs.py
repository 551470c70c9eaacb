"""Decode and verify steps through CUDA graphs give the logits of the eager forward.

A tiny random Llama runs on CUDA with the Triton backend. Sequences are prefilled eagerly, then
decoded for several steps: each step runs once through `StepGraphs` (bucket padding included,
page boundaries crossed) and once eagerly over the same plan, and the logits must agree. Verify
steps (a token plus 0..4 drafts per row, mixed in one step) are checked the same way, and must
leave the cache as the eager forward leaves it (padding tokens write nothing).
"""

from __future__ import annotations

import pytest
import torch

from dyngen_core import Cache, Model
from dyngen_core.engine.plan import SequenceSlice, StepPlan
from dyngen_core.kv.attention import get_backend
from dyngen_core.kv.attention.base import build_forward_batch
from dyngen_core.runtime.graphs import StepGraphs, default_buckets
from dyngen_core.runtime.runner import ModelRunner
from tests.tiny_models import write_tiny_model

pytestmark = pytest.mark.gpu
PAGE = 16


def test_default_buckets_cover_every_batch_size() -> None:
    buckets = default_buckets(256)
    assert buckets[0] == 1 and buckets[-1] == 256 and buckets == sorted(set(buckets))
    padding = [(b2 - b1 - 1) / b2 for b1, b2 in zip(buckets, buckets[1:], strict=False) if b1 >= 32]
    assert max(padding) < 0.2
    assert default_buckets(5)[-1] == 5


@pytest.fixture(scope="module")
def gpu_model(tmp_path_factory: pytest.TempPathFactory, cuda_device: torch.device) -> Model:
    folder = write_tiny_model(tmp_path_factory.mktemp("graphs"), "llama", seed=7,
                              hidden_size=128, num_attention_heads=4, num_key_value_heads=2)
    return Model.load(folder, device=cuda_device, dtype="float32")


def _eager_logits(runner: ModelRunner, plan: StepPlan) -> torch.Tensor:
    # The jobs' own sequence slots: q4 reads their recent windows in both paths.
    slots = None
    if runner.slots is not None:
        slots, fresh = runner.slots.assign([piece.job_id for piece in plan.slices])
        assert not fresh
    batch = build_forward_batch(plan, runner.cache.page_size, runner.model.device, slots)
    return runner.model.forward(batch, runner.cache.storage, runner.backend)


def _prefilled(runner: ModelRunner, prompt_lens: list[int]
               ) -> tuple[list[list[int]], list[list[int]]]:
    """Prefill one sequence per prompt length (five pages each) eagerly; their page tables and
    tokens, each ending with its first greedy token."""
    tables = [[1 + 5 * i + p for p in range(5)] for i in range(len(prompt_lens))]
    tokens = [[(7 * i + j) % 500 + 1 for j in range(n)] for i, n in enumerate(prompt_lens)]
    prefill = StepPlan([SequenceSlice(i, tokens[i], 0, tables[i], sample=True)
                        for i in range(len(prompt_lens))])
    first = runner.run(prefill)
    assert first is not None
    for i in range(len(prompt_lens)):
        tokens[i].append(int(first[i].argmax()))
    return tables, tokens


@pytest.mark.parametrize(("mode", "compiled"), [("fp16", False), ("q4", False), ("fp16", True)])
def test_graph_decode_equals_eager(gpu_model: Model, mode: str, compiled: bool) -> None:
    cache = Cache(gpu_model, max_tokens=64 * PAGE, mode=mode, page_size=PAGE)
    runner = ModelRunner(gpu_model, cache, get_backend("triton", gpu_model.device),
                         max_batch_size=8, compile_decode=compiled)
    assert isinstance(runner.graphs, StepGraphs)
    prompt_lens = [3, 14, 30]  # 3 sequences: the bucket of 4 pads one row
    tables, tokens = _prefilled(runner, prompt_lens)
    for step in range(6):  # crosses page boundaries (16, 32) for the longer sequences
        plan = StepPlan([SequenceSlice(i, [tokens[i][-1]], len(tokens[i]) - 1, tables[i], True)
                         for i in range(len(prompt_lens))])
        assert runner.graphs.can_run(plan)
        graphed = runner.run(plan)
        assert graphed is not None
        graphed = graphed.clone()
        eager = _eager_logits(runner, plan)
        assert graphed.shape == eager.shape == (3, gpu_model.config.vocab_size)
        assert torch.allclose(graphed, eager, rtol=1e-3, atol=1e-3), (step, mode)
        for i in range(len(prompt_lens)):
            tokens[i].append(int(eager[i].argmax()))


def test_plans_a_graph_cannot_serve_run_eagerly(gpu_model: Model) -> None:
    cache = Cache(gpu_model, max_tokens=16 * PAGE, page_size=PAGE)
    runner = ModelRunner(gpu_model, cache, get_backend("triton", gpu_model.device),
                         max_batch_size=2)
    assert runner.graphs is not None
    three = StepPlan([SequenceSlice(i, [5], 0, [i + 1], True) for i in range(3)])
    prefill = StepPlan([SequenceSlice(0, [5, 6], 0, [1], True)])
    drafts = StepPlan([SequenceSlice(0, [5], 2, [1], True, draft_ids=[6])])
    assert not runner.graphs.can_run(three)
    assert not runner.graphs.can_run(prefill)
    assert runner.graphs.can_run(drafts)
    logits = runner.run(three)
    assert logits is not None and logits.shape[0] == 3
    # A storage with per-sequence state (q4's recent windows) keeps verify steps eager.
    windowed = ModelRunner(gpu_model, Cache(gpu_model, max_tokens=16 * PAGE, page_size=PAGE,
                                            mode="q4"),
                           get_backend("triton", gpu_model.device), max_batch_size=2)
    assert windowed.graphs is not None and windowed.slots is not None
    assert not windowed.graphs.can_run(drafts)


def _cache_tensors(cache: Cache) -> list[torch.Tensor]:
    storage = cache.storage
    if hasattr(storage, "keys"):
        return [*storage.keys, *storage.values]  # type: ignore[attr-defined]
    return [t for layer in storage.layers for t in layer.tensors()]  # type: ignore[attr-defined]


@pytest.mark.parametrize("mode", ["fp16", "q8"])
def test_graph_verify_equals_eager(gpu_model: Model, mode: str) -> None:
    cache = Cache(gpu_model, max_tokens=64 * PAGE, mode=mode, page_size=PAGE)
    runner = ModelRunner(gpu_model, cache, get_backend("triton", gpu_model.device),
                         max_batch_size=8)
    assert isinstance(runner.graphs, StepGraphs) and runner.slots is None
    prompt_lens = [3, 13, 29]  # 3 sequences: the bucket of 4 has an empty row
    tables, tokens = _prefilled(runner, prompt_lens)
    drafts_per_step = [(4, 0, 2), (0, 3, 4), (1, 1, 0), (2, 4, 3)]  # drafts cross pages 16, 32
    for step, lengths in enumerate(drafts_per_step):
        plan = StepPlan([SequenceSlice(i, [tokens[i][-1]], len(tokens[i]) - 1, tables[i], True,
                                       draft_ids=[(31 * step + 5 * i + j) % 500 + 1
                                                  for j in range(lengths[i])])
                         for i in range(len(prompt_lens))])
        assert runner.graphs.can_run(plan)
        before = [t.clone() for t in _cache_tensors(cache)]
        graphed = runner.run(plan)
        assert graphed is not None
        graphed = graphed.clone()
        # The graph wrote the step's slots and nothing else (its padding tokens write nothing).
        step_slots = {piece.page_table[p // PAGE] * PAGE + p % PAGE
                      for piece in plan.slices for p in range(piece.start_pos, piece.end_pos)}
        for tensor, saved in zip(_cache_tensors(cache), before, strict=True):
            changed = (tensor != saved).flatten(2).any(-1).flatten().nonzero().flatten()
            assert set(changed.tolist()) <= step_slots, (step, mode)
        eager = _eager_logits(runner, plan)
        rows = sum(1 + n for n in lengths)
        assert graphed.shape == eager.shape == (rows, gpu_model.config.vocab_size)
        assert torch.allclose(graphed, eager, rtol=1e-3, atol=1e-3), (step, mode)
        # Accept the first draft (or the sampled token) of each row, as a verify would.
        row = 0
        for i, n in enumerate(lengths):
            tokens[i].append(int(eager[row].argmax()))
            row += 1 + n
    verify_keys = [key for key in runner.graphs._graphs if key[1] > 1]
    assert {key[0] for key in verify_keys} == {4}
