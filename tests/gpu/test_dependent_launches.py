"""Programmatic dependent launches (`triton_support.dependent_launches`): a one-row skinny
product launched while the kernel in front of it still runs reads that kernel's output, never
what its buffer held before, eagerly and replayed from a CUDA graph; a decode step's logits
are the same bits with and without them; and a generator's mixture (greedy, seeded sampled,
constrained, cancelled, a failing row) ends with the same tokens with and without them.

On CUDA devices before sm_90 and under the interpreter the launches are plain, and only the
switch is checked.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from dyngen_core import Cache, DynamicGenerator, Job, Model, SamplerSettings, Tokenizer
from dyngen_core.engine.plan import SequenceSlice, StepPlan
from dyngen_core.kv.attention import get_backend
from dyngen_core.ops import fused_ops, skinny_matmul, triton_support
from dyngen_core.runtime.graphs import StepGraphs
from tests.engine.step_helpers import run_mixed_jobs, run_to_finals

pytestmark = pytest.mark.gpu


@pytest.fixture
def launches_on() -> Iterator[None]:
    saved = triton_support.DEPENDENT_LAUNCHES
    yield
    triton_support.DEPENDENT_LAUNCHES = saved


def _sm90(device: torch.device) -> torch.device:
    if torch.cuda.get_device_capability(device)[0] < 9:
        pytest.skip("programmatic dependent launches need sm_90 or later")
    return device


def test_the_switch_names_cuda_devices_only(launches_on: None) -> None:
    assert not triton_support.dependent_launches(torch.device("cpu"))
    triton_support.DEPENDENT_LAUNCHES = False
    if torch.cuda.is_available():
        assert not triton_support.dependent_launches(torch.device("cuda"))


def _chain(x: torch.Tensor, weights: list[torch.Tensor], norm: torch.Tensor) -> torch.Tensor:
    """x through norm -> one-row product, once per weight: each product's input is written by
    the norm kernel launched just before it (which lets it launch at once)."""
    for weight in weights:
        x = skinny_matmul.skinny_linear(fused_ops.rms_norm(x, norm, 1e-5, fused=True), weight)
    return x


def test_products_read_what_the_kernel_in_front_wrote(cuda_device: torch.device,
                                                       launches_on: None) -> None:
    device = _sm90(cuda_device)
    generator = torch.Generator(device=device).manual_seed(0)
    hidden = 4096  # the "narrow" class: many programs, all launched early
    weights = [torch.randn(hidden, hidden, device=device, dtype=torch.bfloat16,
                           generator=generator) * 0.02 for _ in range(6)]
    norm = torch.rand(hidden, device=device, dtype=torch.bfloat16, generator=generator) + 0.5
    x = torch.randn(1, hidden, device=device, dtype=torch.bfloat16, generator=generator)
    results = {}
    for on in (False, True):
        triton_support.DEPENDENT_LAUNCHES = on
        eager = _chain(x, weights, norm)
        static = x.clone()
        _chain(static, weights, norm)  # compile before capturing
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = _chain(static, weights, norm)
        replays = []
        for scale in (1.0, -2.0, 0.5):  # new inputs each replay: stale reads would show
            static.copy_(x * scale)
            graph.replay()
            replays.append(out.clone())
        results[on] = (eager, replays)
    reference = x
    for weight in weights:
        normed = fused_ops.rms_norm(reference, norm, 1e-5, fused=False)
        reference = torch.nn.functional.linear(normed, weight)
    assert torch.allclose(results[True][0].float(), reference.float(), rtol=0.05, atol=0.05)
    assert torch.equal(results[True][0], results[False][0])
    for with_them, without in zip(results[True][1], results[False][1], strict=True):
        assert torch.equal(with_them, without)
    assert not torch.equal(results[True][1][0], results[True][1][1])


def test_decode_graph_logits_are_the_same_bits(bf16_fused_model: Model,
                                               launches_on: None) -> None:
    model = bf16_fused_model
    _sm90(model.device)
    plan = StepPlan([SequenceSlice(0, [17], 40, [1, 2, 3], sample=True)])
    logits = {}
    for on in (False, True):
        triton_support.DEPENDENT_LAUNCHES = on
        cache = Cache(model, max_tokens=8 * 16, page_size=16)
        graphs = StepGraphs(model, cache.storage, get_backend("triton", model.device),
                            page_size=16, max_context=64, buckets=[1], compile_model=False)
        logits[on] = [graphs.run(plan).clone() for _ in range(3)]
    for with_them, without in zip(logits[True], logits[False], strict=True):
        assert torch.equal(with_them, without)


def test_a_generators_mixture_ends_the_same(bf16_fused_model: Model, bf16_fused_folder: Path,
                                            launches_on: None) -> None:
    model = bf16_fused_model
    _sm90(model.device)
    tokenizer = Tokenizer.from_model_dir(bf16_fused_folder)
    finals = {}
    for on in (False, True):
        triton_support.DEPENDENT_LAUNCHES = on
        generator = DynamicGenerator(model=model, cache=Cache(model, max_tokens=4096),
                                     tokenizer=tokenizer)
        mixture = run_mixed_jobs(generator)
        # Then a job alone: every decode step one row, all its products the one-row kernel.
        alone = Job(input_ids=list(range(20, 80)), max_new_tokens=12, stop_conditions=[],
                    identifier="alone", gen_settings=SamplerSettings.greedy())
        final = run_to_finals(generator, [alone])["alone"]
        assert final["eos_reason"] == "max_new_tokens" and len(alone.new_token_ids) == 12
        finals[on] = (mixture, list(alone.new_token_ids), final["full_completion"])
        generator.check_invariant()
    assert finals[True] == finals[False]
