"""Speculative decoding on CUDA (Triton attention; CUDA graphs for the plain and the draft
model's one-token steps and for verify steps): outputs equal plain decoding's for the n-gram
drafter and a draft model that is the target itself, in fp16 and q8 caches, with a small cache
that forces preemption, greedy and seeded sampled jobs mixed."""

from __future__ import annotations

import random

import pytest
import torch

from dyngen_core import Cache, DynamicGenerator, Job, Model, SamplerSettings, Tokenizer
from dyngen_core.engine.plan import StepPlan
from dyngen_core.runtime.graphs import StepGraphs
from tests.tiny_models import write_tiny_model

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def parts(tmp_path_factory: pytest.TempPathFactory,
          cuda_device: torch.device) -> tuple[Model, Tokenizer]:
    folder = write_tiny_model(tmp_path_factory.mktemp("gpu_spec"), "llama", seed=11,
                              hidden_size=128, num_attention_heads=4, num_key_value_heads=2)
    return Model.load(folder, device=cuda_device, dtype="float32"), Tokenizer.from_model_dir(folder)


def _run(generator: DynamicGenerator, prompts: list[list[int]]) -> list[list[int]]:
    generator.enqueue([Job(input_ids=p, max_new_tokens=24, stop_conditions=[],
                           gen_settings=SamplerSettings.greedy() if i % 2 else
                           SamplerSettings(temperature=0.8, top_k=40), seed=i, identifier=i)
                       for i, p in enumerate(prompts)])
    tokens: dict[int, list[int]] = {i: [] for i in range(len(prompts))}
    for _ in range(2000):
        if not generator.num_remaining_jobs():
            break
        for result in generator.iterate():
            tokens[result["identifier"]].extend(result.get("token_ids", []))
    generator.check_invariant()
    return [tokens[i] for i in range(len(prompts))]


@pytest.mark.parametrize("mode", ["fp16", "q8"])
@pytest.mark.parametrize("drafter", ["ngram", "oracle"])
def test_speculative_output_equals_plain_on_cuda(parts, mode, drafter, monkeypatch):
    model, tokenizer = parts
    verify_replays: list[int] = []
    original_run = StepGraphs.run

    def counting_run(self: StepGraphs, plan: StepPlan, *args):  # type: ignore[no-untyped-def]
        drafts = max(len(s.draft_ids) for s in plan.slices)
        if drafts:
            verify_replays.append(drafts)
        return original_run(self, plan, *args)

    monkeypatch.setattr(StepGraphs, "run", counting_run)
    rng = random.Random(3)
    loop = [rng.randrange(10, 500) for _ in range(12)]
    prompts = [loop * 20 + [rng.randrange(10, 500) for _ in range(rng.randrange(5, 20))]
               for _ in range(6)]

    def build(**options: object) -> DynamicGenerator:
        return DynamicGenerator(model=model, cache=Cache(model, max_tokens=1024, mode=mode),
                                tokenizer=tokenizer, attention_backend="triton",
                                max_batch_size=8, **options)  # type: ignore[arg-type]

    plain = _run(build(), prompts)
    speculative = build(use_ngram_draft=True) if drafter == "ngram" else build(draft_model=model)
    assert speculative.speculator is not None
    if drafter == "oracle":
        speculative.speculator.measure_draft_cost = False
        speculative.speculator.draft_cost_ratio = 0.0
    assert _run(speculative, prompts) == plain
    stats = speculative.stats()
    assert stats.draft_tokens_accepted > 0 and stats.preemptions > 0
    assert verify_replays  # verify steps replayed graphs
