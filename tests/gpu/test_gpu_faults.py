"""Faults on the GPU path (issue 21 §9): an exception or out-of-memory inside a CUDA-graph
replay step, inside the quantized write, inside a shared-prefix (cascade) step, and NaN rows
under the fused draw.

A fault inside a step fails the jobs of that step and nothing else; a NaN row fails only its
own job. Every other job, running beside the failed step or enqueued after it, gives exactly
what the same run without the fault gives, and the page invariant holds after every step.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import pytest
import torch

from dyngen_core import Cache, DynamicGenerator, Job, Model, SamplerSettings, Tokenizer
from dyngen_core.kv.attention.triton.cascade_path import CascadePath
from dyngen_core.kv.attention.triton.paged import TritonPagedBackend
from dyngen_core.kv.quant.storage import QuantStorage
from dyngen_core.runtime.graphs import StepGraphs
from tests.engine.step_helpers import kill_row
from tests.tiny_models import write_tiny_model

pytestmark = pytest.mark.gpu
GREEDY = SamplerSettings.greedy()
TOP_P = SamplerSettings(temperature=0.8, top_k=40, top_p=0.9)


@pytest.fixture(scope="module")
def gpu_parts(tmp_path_factory: pytest.TempPathFactory,
              cuda_device: torch.device) -> tuple[Model, Tokenizer]:
    folder = write_tiny_model(tmp_path_factory.mktemp("gpu_faults"), "llama", seed=5,
                              hidden_size=128, num_attention_heads=4, num_key_value_heads=2)
    return (Model.load(folder, device=cuda_device, dtype="float32"),
            Tokenizer.from_model_dir(folder))


def _prompts(n: int, seed: int, length: int, shared: list[int] | None = None) -> list[list[int]]:
    rng = random.Random(seed)
    return [(shared or []) + [rng.randrange(10, 500) for _ in range(length)] for _ in range(n)]


def _jobs(prompts: list[list[int]], tag: str, settings: SamplerSettings = GREEDY,
          budget: int = 12) -> list[Job]:
    return [Job(input_ids=p, max_new_tokens=budget, stop_conditions=[], gen_settings=settings,
                seed=i, identifier=f"{tag}{i}") for i, p in enumerate(prompts)]


def _generator(parts: tuple[Model, Tokenizer], mode: str = "fp16",
               backend: Any = "triton", **options: Any) -> DynamicGenerator:
    model, tokenizer = parts
    return DynamicGenerator(model=model, cache=Cache(model, max_tokens=8192, mode=mode),
                            tokenizer=tokenizer, attention_backend=backend, **options)


def _drain(generator: DynamicGenerator, finals: dict[str, Any]) -> None:
    while generator.num_remaining_jobs():
        for r in generator.iterate():
            if r["eos"]:
                finals[r["identifier"]] = r
        generator.check_invariant()


def _waves(make: Callable[[], DynamicGenerator], first: list[Job], later: list[Job],
           arm: Callable[[], None] | None = None) -> dict[str, Any]:
    """Run ``first`` (during which a fault may fire), then ``later`` on the same generator;
    ``arm`` installs the fault once the generator is built (graph capture runs its own
    forwards)."""
    generator, finals = make(), {}
    if arm is not None:
        arm()
    generator.enqueue(first)
    _drain(generator, finals)
    generator.enqueue(later)
    _drain(generator, finals)
    assert generator.stats().pages_referenced == 0
    return finals


def _once(exc: BaseException, after: int = 0) -> Callable[..., None]:
    """A hook that raises ``exc`` on its ``after + 1``-th call and never again."""
    calls = [0]

    def hook(*args: Any, **kwargs: Any) -> None:
        calls[0] += 1
        if calls[0] == after + 1:
            raise exc
    hook.calls = calls  # type: ignore[attr-defined]
    return hook


def _patch(monkeypatch: pytest.MonkeyPatch, owner: type, name: str,
           hook: Callable[..., None]) -> None:
    original = getattr(owner, name)

    def patched(self: Any, *args: Any, **kwargs: Any) -> Any:
        hook()
        return original(self, *args, **kwargs)

    monkeypatch.setattr(owner, name, patched)


def _check(finals: dict[str, Any], reference: dict[str, Any]) -> list[str]:
    """The jobs that failed (at least one, each with an error); every other job equals the run
    without the fault."""
    failed = sorted(k for k, r in finals.items() if r["eos_reason"] == "error")
    assert failed, "the fault failed no job"
    assert finals.keys() == reference.keys()
    for key, ref in reference.items():
        if key not in failed:
            assert finals[key]["eos_reason"] == ref["eos_reason"], key
            assert finals[key]["full_completion"] == ref["full_completion"], key
    return failed


@pytest.mark.parametrize("fault", [RuntimeError("a kernel failed"),
                                   torch.cuda.OutOfMemoryError("CUDA out of memory")])
def test_a_fault_in_a_graph_replay_fails_only_its_step(gpu_parts, monkeypatch, fault) -> None:
    first = _prompts(3, seed=1, length=40)
    later = _prompts(4, seed=2, length=50)
    reference = _waves(lambda: _generator(gpu_parts), _jobs(first, "first"),
                       _jobs(later, "later"))
    hook = _once(fault, after=4)
    finals = _waves(lambda: _generator(gpu_parts), _jobs(first, "first"),
                    _jobs(later, "later"),
                    arm=lambda: _patch(monkeypatch, StepGraphs, "run", hook))
    assert hook.calls[0] > 5  # type: ignore[attr-defined]  # replays went on after the fault
    assert _check(finals, reference) == ["first0", "first1", "first2"]


@pytest.mark.parametrize("mode", ["q8", "q4"])
def test_a_fault_in_the_quantized_write_fails_only_its_step(gpu_parts, monkeypatch,
                                                            mode) -> None:
    first = _prompts(3, seed=3, length=300)  # prefill chunks: eager steps that write pages
    later = _prompts(3, seed=4, length=280)
    def make() -> DynamicGenerator:
        return _generator(gpu_parts, mode, max_chunk_size=128)

    reference = _waves(make, _jobs(first, "first"), _jobs(later, "later"))
    hook = _once(torch.cuda.OutOfMemoryError("CUDA out of memory in the write"), after=1)
    finals = _waves(make, _jobs(first, "first"), _jobs(later, "later"),
                    arm=lambda: _patch(monkeypatch, QuantStorage, "write", hook))
    assert hook.calls[0] > 2  # type: ignore[attr-defined]
    assert _check(finals, reference) == ["first0"]  # the first chunk's step held only it


def test_a_fault_in_a_cascade_step_fails_only_its_step(gpu_parts, monkeypatch) -> None:
    shared = _prompts(1, seed=5, length=600)[0]  # two full shared pages
    first = _prompts(4, seed=6, length=20, shared=shared)
    later = _prompts(4, seed=7, length=24, shared=shared)

    def make() -> DynamicGenerator:
        backend = TritonPagedBackend(cascade_min_saved_keys=1, cascade_min_members=2,
                                     cascade_min_prefix_pages=1)
        return _generator(gpu_parts, backend=backend, cuda_graphs=False)

    reference = _waves(make, _jobs(first, "first"), _jobs(later, "later"))
    hook = _once(RuntimeError("a fault in the cascade"), after=2)
    finals = _waves(make, _jobs(first, "first"), _jobs(later, "later"),
                    arm=lambda: _patch(monkeypatch, CascadePath, "attend", hook))
    assert hook.calls[0] > 3  # type: ignore[attr-defined]  # cascade steps ran after the fault
    assert [k for k in _check(finals, reference) if k.startswith("later")] == []


@pytest.mark.parametrize("overlap", [True, False])
def test_a_nan_row_under_the_fused_draw_fails_only_its_job(gpu_parts, overlap) -> None:
    prompts = _prompts(4, seed=8, length=30)

    def make() -> DynamicGenerator:
        return _generator(gpu_parts, overlap_steps=overlap)

    reference = _waves(make, _jobs(prompts, "job", TOP_P), [])
    generator = kill_row(make(), step=5, row=2, value=float("nan"))
    assert generator._sampler.sampler.fused_draw  # the draw under test
    finals: dict[str, Any] = {}
    generator.enqueue(_jobs(prompts, "job", TOP_P))
    _drain(generator, finals)
    assert _check(finals, reference) == ["job2"]
