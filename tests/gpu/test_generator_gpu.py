"""The generator on CUDA (Triton attention, decode CUDA graphs) against the sdpa reference.

Greedy outputs must not depend on the backend, on graphs, or on how jobs are batched,
deduplicated and preempted: a small cache forces waiting and preemption, shared prompt prefixes
force dedup, and every job must produce the tokens it produces alone through sdpa.
"""

from __future__ import annotations

import random

import pytest
import torch

from dyngen_core import Cache, DynamicGenerator, Job, Model, SamplerSettings, Tokenizer
from dyngen_core.runtime.graphs import StepGraphs
from tests.engine.test_cache_modes import check_mixture
from tests.tiny_models import write_tiny_model

pytestmark = pytest.mark.gpu
GREEDY = SamplerSettings.greedy()


@pytest.fixture(scope="module")
def gpu_parts(tmp_path_factory: pytest.TempPathFactory,
              cuda_device: torch.device) -> tuple[Model, Tokenizer]:
    folder = write_tiny_model(tmp_path_factory.mktemp("gpu_gen"), "llama", seed=11,
                              hidden_size=128, num_attention_heads=4, num_key_value_heads=2)
    return Model.load(folder, device=cuda_device, dtype="float32"), Tokenizer.from_model_dir(folder)


def _prompts(n: int, seed: int, lo: int, hi: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, 500) for _ in range(rng.randrange(lo, hi))] for _ in range(n)]


def _run(generator: DynamicGenerator, prompts: list[list[int]],
         max_new_tokens: int) -> list[list[int]]:
    generator.enqueue([Job(input_ids=p, max_new_tokens=max_new_tokens, stop_conditions=[],
                           gen_settings=GREEDY, identifier=i) for i, p in enumerate(prompts)])
    tokens: dict[int, list[int]] = {i: [] for i in range(len(prompts))}
    while generator.num_remaining_jobs():
        for result in generator.iterate():
            if result["stage"] == "streaming":
                tokens[result["identifier"]].extend(result.get("token_ids", []))
    return [tokens[i] for i in range(len(prompts))]


def _generator(parts: tuple[Model, Tokenizer], cache_tokens: int, backend: str,
               mode: str = "fp16", **options: object) -> DynamicGenerator:
    model, tokenizer = parts
    cache = Cache(model, max_tokens=cache_tokens, mode=mode)
    return DynamicGenerator(model=model, cache=cache, tokenizer=tokenizer,
                            attention_backend=backend, **options)  # type: ignore[arg-type]


@pytest.mark.parametrize("mode", ["fp16", "q8"])
def test_gpu_generator_with_dedup_and_preemption_matches_sdpa_alone(
        gpu_parts: tuple[Model, Tokenizer], mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    replays = []
    original_run = StepGraphs.run

    def counting_run(self: StepGraphs, plan, *args):  # type: ignore[no-untyped-def]
        replays.append(len(plan.slices))
        return original_run(self, plan, *args)

    monkeypatch.setattr(StepGraphs, "run", counting_run)
    shared = _prompts(1, seed=2, lo=300, hi=301)[0]
    prompts = [shared + tail for tail in _prompts(3, seed=3, lo=3, hi=20)]
    prompts += _prompts(3, seed=1, lo=240, hi=252)  # cross a page while decoding
    reference = _generator(gpu_parts, 8192, "sdpa", mode, prompt_cache=False)
    alone = [_run(reference, [p], 16)[0] for p in prompts]

    small = _generator(gpu_parts, 1024, "triton", mode)  # 4 pages: waits and preemption
    together = _run(small, prompts, 16)
    assert together == alone
    assert replays, "decode steps never replayed a CUDA graph"
    assert max(replays) > 1
    stats = small.stats()
    assert stats.prefill_tokens_reused > 0
    small.check_invariant()


@pytest.mark.parametrize("capped", [False, True])
@pytest.mark.parametrize("mode", ["q8", "q4"])
def test_mixed_jobs_while_the_decode_kernel_writes(gpu_parts: tuple[Model, Tokenizer],
                                                   mode: str, capped: bool,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """The CPU mixture (`check_mixture`: constrained, plain and sampled jobs over a shared
    document, a fault in one job's text pipeline, a cancel) on CUDA with the Triton backend and
    decode graphs, where the q8/q4 decode kernel does each decode step's write itself;
    ``capped``: every one-launch decode compiled under the register cap that production gives
    large batches only (`decode.register_cap`: this test's batches are small)."""
    from dyngen_core.kv.attention.triton import paged, quant_decode

    if capped:
        monkeypatch.setattr(quant_decode, "register_cap", lambda programs, warps, on: 128)

    left: list[bool] = []
    original = paged.deferred_word_write

    def counted(*args: object) -> object:
        write = original(*args)  # type: ignore[arg-type]
        left.append(write is not None)
        return write

    monkeypatch.setattr(paged, "deferred_word_write", counted)
    check_mixture(gpu_parts, mode, attention_backend="triton")
    assert any(left), "no decode step left its write to the kernel"
