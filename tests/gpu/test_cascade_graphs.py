"""Shared-prefix ("cascade") attention replayed from the decode CUDA graphs.

A tiny random Llama on CUDA: sequences are prefilled the way prefix dedup leaves them (members
of a group hold the same leading page ids, the shared pages computed once), then decoded step
by step through `ModelRunner` (CUDA graphs, cascade graphs captured on first use), and every
step's logits must equal an eager forward without the cascade over the same plan. Cases:
groups of different prefix lengths, members next to sequences in no group, a bucket larger than
the batch, a step where a group disappears, a step with no group (plain graph); and the
generator end to end (default policy) against sdpa, with the page invariant. The eager runner's
cascade also runs on the CPU under the Triton interpreter.
"""

from __future__ import annotations

import random
from typing import TYPE_CHECKING

import pytest
import torch

from dyngen_core import Cache, DynamicGenerator, Job, Model, SamplerSettings, Tokenizer
from dyngen_core.engine.plan import SequenceSlice, StepPlan
from dyngen_core.kv.attention.base import build_forward_batch
from dyngen_core.runtime.graphs import StepGraphs
from dyngen_core.runtime.runner import ModelRunner
from tests.tiny_models import write_tiny_model

if TYPE_CHECKING:
    from dyngen_core.engine.cascade import CascadePlan
    from dyngen_core.kv.attention.triton.paged import TritonPagedBackend

pytestmark = pytest.mark.gpu
PAGE = 16


def _parts(folder_factory: pytest.TempPathFactory,
           device: torch.device) -> tuple[Model, Tokenizer]:
    folder = write_tiny_model(folder_factory.mktemp("cascade_graphs"), "llama", seed=5,
                              hidden_size=128, num_attention_heads=4, num_key_value_heads=2)
    return Model.load(folder, device=device, dtype="float32"), Tokenizer.from_model_dir(folder)


@pytest.fixture(scope="module")
def gpu_parts(tmp_path_factory: pytest.TempPathFactory,
              cuda_device: torch.device) -> tuple[Model, Tokenizer]:
    return _parts(tmp_path_factory, cuda_device)


@pytest.fixture(scope="module")
def kernel_parts(tmp_path_factory: pytest.TempPathFactory,
                 device: torch.device) -> tuple[Model, Tokenizer]:
    """On CUDA, or on the CPU under the Triton interpreter (no CUDA graphs there)."""
    return _parts(tmp_path_factory, device)


def _triton(cascade: bool) -> TritonPagedBackend:
    """The Triton backend, cascading every shared prefix or never."""
    pytest.importorskip("triton")
    from dyngen_core.kv.attention.triton.paged import TritonPagedBackend

    return TritonPagedBackend(cascade_min_saved_keys=0 if cascade else None)


def _spy_graph_plans(monkeypatch: pytest.MonkeyPatch) -> list[CascadePlan | None]:
    """Every shared-prefix plan the decode graphs stage, in order."""
    from dyngen_core.kv.attention.triton.cascade_path import GraphCascade

    plans: list[CascadePlan | None] = []
    original = GraphCascade.plan

    def spy(self: GraphCascade, plan: StepPlan) -> CascadePlan | None:
        plans.append(original(self, plan))
        return plans[-1]

    monkeypatch.setattr(GraphCascade, "plan", spy)
    return plans


class _Sequences:
    """Token lists and dedup-shaped page tables: (shared pages, tails) per group, then loners."""

    def __init__(self, groups: list[tuple[int, list[int]]], loners: list[int], seed: int) -> None:
        rng = random.Random(seed)
        self.tokens: list[list[int]] = []
        self.tables: list[list[int]] = []
        self.shared_len: list[int] = []
        next_page = 1  # page 0 stays unused
        for shared_pages, tails in groups:
            shared = [rng.randrange(10, 500) for _ in range(shared_pages * PAGE)]
            pages = list(range(next_page, next_page + shared_pages))
            next_page += shared_pages
            for tail in tails:
                self.tokens.append(shared + [rng.randrange(10, 500) for _ in range(tail)])
                self.tables.append(pages + list(range(next_page, next_page + 4)))
                next_page += 4
                self.shared_len.append(shared_pages * PAGE)
        for length in loners:
            self.tokens.append([rng.randrange(10, 500) for _ in range(length)])
            self.tables.append(list(range(next_page, next_page + 4 + length // PAGE)))
            next_page += 4 + length // PAGE
            self.shared_len.append(0)
        self.pages = next_page

    def prefill(self) -> StepPlan:
        """Each group's first member computes the shared pages; the others only their tails."""
        slices, seen = [], set()
        for i, (tokens, table) in enumerate(zip(self.tokens, self.tables, strict=True)):
            start = self.shared_len[i] if table[0] in seen else 0
            seen.add(table[0])
            slices.append(SequenceSlice(i, tokens[start:], start, table, sample=True))
        return StepPlan(slices)

    def decode(self, which: list[int]) -> StepPlan:
        return StepPlan([SequenceSlice(i, [self.tokens[i][-1]], len(self.tokens[i]) - 1,
                                       self.tables[i], True) for i in which])


def _eager_plain(runner: ModelRunner, plan: StepPlan) -> torch.Tensor:
    batch = build_forward_batch(plan, PAGE, runner.model.device)
    return runner.model.forward(batch, runner.cache.storage, _triton(cascade=False))


# The own-keys pass merges, split many ways at these small buckets, with its split counters.
def test_cascade_graphs_equal_eager_plain_forward(gpu_parts: tuple[Model, Tokenizer],
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    model = gpu_parts[0]
    captures: list[tuple[int, bool]] = []
    original = StepGraphs._capture

    def spy(self: StepGraphs, size: int, query_len: int, *, with_tables: bool) -> None:
        assert query_len == 1  # decode steps only here
        captures.append((size, with_tables))
        original(self, size, query_len, with_tables=with_tables)

    monkeypatch.setattr(StepGraphs, "_capture", spy)
    staged = _spy_graph_plans(monkeypatch)
    # Group A: 3 shared pages, 3 members; group B: 1 shared page, 2 members; 2 loners.
    seqs = _Sequences([(3, [2, 9, 17]), (1, [5, 20])], loners=[7, 40], seed=1)
    cache = Cache(model, max_tokens=seqs.pages * PAGE, page_size=PAGE)
    runner = ModelRunner(model, cache, _triton(cascade=True), max_batch_size=12)
    graphs = runner.graphs
    assert isinstance(graphs, StepGraphs) and graphs.buckets == [1, 2, 4, 8, 12]
    assert all(not cascade for _, cascade in captures)  # construction: plain graphs only
    first = runner.run(seqs.prefill())
    assert first is not None
    for i, row in enumerate(first):
        seqs.tokens[i].append(int(row.argmax()))
    everyone = list(range(7))
    steps = [everyone] * 3 + [[0, 1, 2, 5, 6]] * 2 + [[0, 3, 5, 6]] + [everyone]
    # 7 in a bucket of 8 (one padding row); then group B leaves (5: same bucket, one group);
    # then one member per group (no group: the plain graph); then everyone again.
    expect_groups = [2, 2, 2, 1, 1, 0, 2]
    for step, (which, groups) in enumerate(zip(steps, expect_groups, strict=True)):
        plan = seqs.decode(which)
        graphed = runner.run(plan)
        cascade_plan = staged[-1]
        assert len(staged) == step + 1
        assert len(cascade_plan.groups if cascade_plan else ()) == groups, step
        assert graphed is not None
        graphed = graphed.clone()
        eager = _eager_plain(runner, plan)
        assert graphed.shape == eager.shape == (len(which), model.config.vocab_size)
        assert torch.allclose(graphed, eager, rtol=1e-3, atol=1e-3), step
        for row, i in enumerate(which):
            seqs.tokens[i].append(int(eager[row].argmax()))
    assert [c for c in captures if c[1]] == [(8, True)]  # captured once, on first use


def test_runner_without_graphs_cascades_eagerly(kernel_parts: tuple[Model, Tokenizer]) -> None:
    """The eager path keeps the cascade (host page tables): same logits as the plain one."""
    model = kernel_parts[0]
    seqs = _Sequences([(2, [3, 11, 6])], loners=[9], seed=2)
    cache = Cache(model, max_tokens=seqs.pages * PAGE, page_size=PAGE)
    runner = ModelRunner(model, cache, _triton(cascade=True), cuda_graphs=False)
    first = runner.run(seqs.prefill())
    assert first is not None
    for i, row in enumerate(first):
        seqs.tokens[i].append(int(row.argmax()))
    plan = seqs.decode([0, 1, 2, 3])
    batch = build_forward_batch(plan, PAGE, model.device)
    backend = runner.backend
    assert isinstance(backend, type(_triton(cascade=True)))
    assert backend.cascade.plan(batch, cache.storage) is not None
    cascaded = runner.run(plan)
    assert cascaded is not None
    assert torch.allclose(cascaded, _eager_plain(runner, plan), rtol=1e-3, atol=1e-3)


def test_generator_shared_document_default_policy(gpu_parts: tuple[Model, Tokenizer],
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """34 questions on a 4-page document (33 x 1,024 = 33,792 keys saved: the default policy
    cascades) through the generator's graphs: greedy tokens equal sdpa's; pages stay sound."""
    staged = _spy_graph_plans(monkeypatch)
    model, tokenizer = gpu_parts
    rng = random.Random(3)
    document = [rng.randrange(10, 500) for _ in range(4 * 256)]
    prompts = [document + [rng.randrange(10, 500) for _ in range(rng.randrange(3, 12))]
               for _ in range(34)]

    def run(backend: str) -> tuple[list[list[int]], DynamicGenerator]:
        generator = DynamicGenerator(model=model, cache=Cache(model, max_tokens=64 * 256),
                                     tokenizer=tokenizer, attention_backend=backend,
                                     max_batch_size=40)
        jobs = [Job(input_ids=p, max_new_tokens=12, stop_conditions=[],
                    gen_settings=SamplerSettings.greedy(), identifier=i)
                for i, p in enumerate(prompts)]
        generator.enqueue(jobs)
        tokens: dict[int, list[int]] = {i: [] for i in range(len(prompts))}
        while generator.num_remaining_jobs():
            for result in generator.iterate():
                if result["stage"] == "streaming":
                    tokens[result["identifier"]].extend(result.get("token_ids", []))
        return [tokens[i] for i in range(len(prompts))], generator

    reference, _ = run("sdpa")
    staged.clear()
    together, generator = run("triton")
    cascaded_steps = [plan is not None for plan in staged]
    assert sum(cascaded_steps) >= 8, "the decode steps must replay cascade graphs"
    assert together == reference
    generator.check_invariant()
