"""The plain-greedy fast path gives exactly what the general path gives.

When every sampling job is greedy with no sampler stage, constraint, banned string,
min_new_tokens or extra output, the generator samples with `Sampler.greedy_ids` (one argmax, no
requests), advances the scheduler with `Scheduler.apply_tokens` and emits through its inlined
stream loop. Each test runs the same jobs twice, once with the fast path switched off, and
compares every result (all keys but timings) in order.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from dyngen_core import DynamicGenerator, Job, SamplerSettings
from dyngen_core.engine.record import SampleRequest
from dyngen_core.sampling.sampler import Sampler, SamplingError
from dyngen_core.sampling.step import StepSampler
from tests.engine.step_helpers import kill_row, mixed_prompts

GREEDY = SamplerSettings.greedy()
TIMINGS = {"time_enqueued", "time_prefill", "time_generate"}


def _results(generator: DynamicGenerator, jobs: list[Job], *, cancel: dict[int, int] | None = None,
           ) -> list[dict[str, Any]]:
    """Every result of running ``jobs`` (cancel: job index -> step at which it is cancelled)."""
    generator.enqueue(jobs)
    out: list[dict[str, Any]] = []
    step = 0
    while generator.num_remaining_jobs():
        step += 1
        for index, when in (cancel or {}).items():
            if when == step:
                generator.cancel(jobs[index])
        for r in generator.iterate():
            row = {k: v for k, v in r.items() if k not in TIMINGS and k != "job"}
            if "error" in row:
                row["error"] = type(row["error"]).__name__
            out.append(row)
    generator.check_invariant()
    return out


class _Calls:
    """Counts calls of the sampler's fast and general entry points."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.greedy = self.general = 0
        greedy_ids, sample_tokens = Sampler.greedy_ids, Sampler.sample_tokens

        def counted_greedy(sampler: Sampler, logits: torch.Tensor) -> list[int]:
            self.greedy += 1
            return greedy_ids(sampler, logits)

        def counted_general(sampler: Sampler, *args: Any, **kwargs: Any) -> Any:
            self.general += 1
            return sample_tokens(sampler, *args, **kwargs)

        monkeypatch.setattr(Sampler, "greedy_ids", counted_greedy)
        monkeypatch.setattr(Sampler, "sample_tokens", counted_general)


def _both(make_generator: Callable[..., DynamicGenerator], monkeypatch: pytest.MonkeyPatch,
          jobs: Callable[[], list[Job]], **options: Any) -> tuple[list[Any], list[Any], _Calls]:
    """(fast-path results, general-path results, the fast run's sampler calls). Both run
    without step overlap (tests/engine/test_overlap_steps.py covers it), so the fast run's
    tokens come from `Sampler.greedy_ids`."""
    cancel = options.pop("cancel", None)
    options.setdefault("overlap_steps", False)
    with monkeypatch.context() as patch:
        calls = _Calls(patch)
        fast = _results(make_generator(**options), jobs(), cancel=cancel)
    with monkeypatch.context() as patch:
        patch.setattr(StepSampler, "_all_plain", lambda self, records: False)
        general = _results(make_generator(**options), jobs(), cancel=cancel)
    return fast, general, calls


def _reference_text(make_generator: Callable[..., DynamicGenerator], prompt: list[int]) -> str:
    """The full greedy completion of ``prompt`` (16 tokens, no stop condition)."""
    generator = make_generator()
    job = Job(input_ids=prompt, max_new_tokens=16, stop_conditions=[], gen_settings=GREEDY)
    generator.enqueue(job)
    text = ""
    while generator.num_remaining_jobs():
        for r in generator.iterate():
            if r["eos"]:
                text = r["full_completion"]
    return text


def test_stop_strings_tokens_and_budgets_match_the_general_path(make_generator, monkeypatch):
    prompts = mixed_prompts(8, seed=1)
    # Stop strings taken from the jobs' own greedy text, so they do match mid-run.
    texts = [_reference_text(make_generator, p) for p in prompts[:3]]
    stop_a = texts[0][len(texts[0]) // 2:len(texts[0]) // 2 + 3]
    stop_b = texts[1][-4:]
    assert stop_a.strip() and stop_b.strip()

    def jobs() -> list[Job]:
        out = []
        for i, p in enumerate(prompts):
            stops: list[int | str] = [stop_a, stop_b] if i < 4 else []
            if i == 5:
                stops = [p[-1], 7]  # stop tokens that may or may not come
            budget = 20 if i < 3 else 4 + 3 * i  # the first three reach their stop strings
            out.append(Job(input_ids=p, max_new_tokens=budget, stop_conditions=stops,
                           gen_settings=GREEDY, identifier=i))
        return out

    fast, general, calls = _both(make_generator, monkeypatch, jobs, max_chunk_size=64)
    assert fast == general
    assert calls.greedy > 0 and calls.general == 0
    reasons = [r["eos_reason"] for r in fast if r["eos"]]
    assert "stop_string" in reasons and "max_new_tokens" in reasons


def test_a_job_off_the_fast_path_switches_the_batch_to_the_general_path(make_generator,
                                                                         monkeypatch):
    prompts = mixed_prompts(6, seed=2)

    def jobs() -> list[Job]:
        out = [Job(input_ids=p, max_new_tokens=10, stop_conditions=[], gen_settings=GREEDY,
                   identifier=i) for i, p in enumerate(prompts)]
        # min_new_tokens with a stop token makes the job non-plain (its stop token is banned
        # for a while); it ends early, after which the others run on the fast path again.
        out.append(Job(input_ids=prompts[0], max_new_tokens=3, min_new_tokens=2,
                       stop_conditions=[7], gen_settings=GREEDY, identifier=99))
        out.append(Job(input_ids=prompts[1], max_new_tokens=5, stop_conditions=[],
                       gen_settings=GREEDY, identifier=98, return_probs=True))
        return out

    fast, general, calls = _both(make_generator, monkeypatch, jobs)
    assert fast == general
    assert calls.greedy > 0 and calls.general > 0


def test_min_new_tokens_without_stop_tokens_stays_on_the_fast_path(make_generator, monkeypatch):
    # Lengths forced (min = max, no stop condition), as the benchmarks run: min_new_tokens has
    # no stop token to ban, so the jobs are plain greedy.
    prompts = mixed_prompts(4, seed=5)

    def jobs() -> list[Job]:
        return [Job(input_ids=p, max_new_tokens=6, min_new_tokens=6, stop_conditions=[],
                    gen_settings=GREEDY, identifier=i) for i, p in enumerate(prompts)]

    fast, general, calls = _both(make_generator, monkeypatch, jobs)
    assert fast == general
    assert calls.greedy > 0 and calls.general == 0


def test_cancel_mid_run_matches_the_general_path(make_generator, monkeypatch):
    prompts = mixed_prompts(5, seed=3)

    def jobs() -> list[Job]:
        return [Job(input_ids=p, max_new_tokens=12, stop_conditions=[], gen_settings=GREEDY,
                    identifier=i) for i, p in enumerate(prompts)]

    fast, general, _ = _both(make_generator, monkeypatch, jobs, cancel={1: 4, 3: 9})
    assert fast == general
    assert [r["eos_reason"] for r in fast if r["eos"]].count("cancelled") == 2


def test_a_row_with_no_finite_logit_fails_only_its_job(make_generator, monkeypatch):
    prompts = mixed_prompts(4, seed=4)

    def make(**options: Any) -> DynamicGenerator:
        return kill_row(make_generator(**options), step=6, row=1, value=float("-inf"))

    def jobs() -> list[Job]:
        return [Job(input_ids=p, max_new_tokens=9, stop_conditions=[], gen_settings=GREEDY,
                    identifier=i) for i, p in enumerate(prompts)]

    fast, general, calls = _both(make, monkeypatch, jobs)
    assert fast == general
    assert [r.get("error") for r in fast if r["eos"]].count("SamplingError") == 1
    # The failed step fell back: one general call finds the dead row, one samples the rest.
    assert calls.greedy > 0 and calls.general == 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_greedy_ids_equals_sample_for_plain_requests(dtype):
    vocab = 50
    sampler = Sampler(vocab)
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(6, vocab + 14, generator=gen).to(dtype)
    logits[:, vocab:] = 100.0  # padding columns past the vocabulary are never chosen
    logits[2, 10] = logits[2, 30] = logits[2, :vocab].max() + 1  # a tie: the first one wins
    logits[3, :vocab] = torch.round(logits[3, :vocab])  # many ties after rounding
    requests = [SampleRequest(settings=GREEDY) for _ in range(6)]
    expected = [r.token_ids[0] for r in sampler.sample(logits, requests)]
    assert sampler.greedy_ids(logits) == expected
    assert expected[2] == 10


@pytest.mark.parametrize("bad", [float("-inf"), float("nan"), float("inf")])
def test_greedy_ids_rejects_the_rows_sample_rejects(bad):
    sampler = Sampler(20)
    logits = torch.randn(5, 20)
    logits[1] = bad
    logits[3, :] = float("-inf")
    logits[3, 0] = bad
    requests = [SampleRequest(settings=GREEDY) for _ in range(5)]
    with pytest.raises(SamplingError) as general:
        sampler.sample(logits, requests)
    with pytest.raises(SamplingError) as fast:
        sampler.greedy_ids(logits)
    assert fast.value.request_indices == general.value.request_indices
    assert 1 in fast.value.request_indices
    assert str(fast.value) == str(general.value)
    # Left on the device (overlapped steps): the rejected rows read -1, the fed ids stay valid.
    fed, checked = sampler.greedy_on_device(logits)
    rejected = [i for i, token in enumerate(checked.tolist()) if token < 0]
    assert rejected == fast.value.request_indices
    assert all(0 <= token < 20 for token in fed.tolist())
