"""The per-job state the sampler reads stays exact on the host's fast paths.

- RNG counters: a seeded job's tokens depend only on its seed and its counter, so every draw of
  a job must carry the next counter (0, 1, 2, ...), whatever else is in the batch: jobs
  starting and ending, cancelled, sampled on the host (banned strings, extra outputs) or on the
  device, with overlapped steps or without. `StepSampler.start` reuses the last launch's
  requests for the same jobs; a host step in between (which may set constraint masks) must not
  leak into it.
- History: only jobs whose stages read it (penalties, DRY) keep one; theirs is always the
  prompt plus the accepted tokens, banned-string rewinds included.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

from dyngen_core import DynamicGenerator, Job, SamplerSettings
from dyngen_core.engine.record import JobRecord
from dyngen_core.sampling.sampler import Sampler
from dyngen_core.sampling.step import StepSampler
from dyngen_core.text.constraints import mask_words
from tests.engine.step_helpers import mixed_prompts

TOP_P = SamplerSettings(temperature=0.9, top_p=0.8, top_k=40)
PENALIZED = SamplerSettings(temperature=0.9, top_p=0.9, token_repetition_penalty=1.3)
TIMINGS = {"time_enqueued", "time_prefill", "time_generate"}


class _Draws:
    """Records the (seed, counter) of every request of every sampler call that drew tokens."""

    def __init__(self, patch: pytest.MonkeyPatch) -> None:
        self.by_seed: dict[int, list[int]] = {}
        self.masked_launches = 0
        launch, sample = Sampler.launch_tokens, Sampler.sample_tokens

        def launch_tokens(sampler: Sampler, logits: torch.Tensor, requests: Any,
                          **kw: Any) -> Any:
            out = launch(sampler, logits, requests, **kw)
            if out is not None:
                self.masked_launches += sum(r.allowed_tokens is not None for r in requests)
                self._record(requests)
            return out

        def sample_tokens(sampler: Sampler, logits: torch.Tensor, requests: Any,
                          **kw: Any) -> Any:
            out = sample(sampler, logits, requests, **kw)  # raises before recording
            self._record(requests)
            return out

        patch.setattr(Sampler, "launch_tokens", launch_tokens)
        patch.setattr(Sampler, "sample_tokens", sample_tokens)

    def _record(self, requests: Any) -> None:
        for r in requests:
            self.by_seed.setdefault(r.seed, []).append(r.counter)


def _job(prompt: list[int], seed: int, budget: int, **extra: Any) -> Job:
    extra.setdefault("gen_settings", TOP_P)
    return Job(input_ids=prompt, max_new_tokens=budget, stop_conditions=[], seed=seed,
               identifier=seed, **extra)


def _waves() -> list[list[Job]]:
    """Jobs enqueued at steps 0, 3 and 7: sampled ones of different budgets (they end at
    different steps), one with banned strings and one asking for probabilities (both sampled
    on the host, so launches stop while they run), and late arrivals after they end."""
    prompts = mixed_prompts(8, seed=11)
    first = [_job(prompts[i], seed=i, budget=4 + 3 * i) for i in range(4)]
    second = [_job(prompts[4], seed=10, budget=3, banned_strings=["zzz"]),
              _job(prompts[5], seed=11, budget=2, return_probs=True),
              _job(prompts[6], seed=12, budget=9)]
    third = [_job(prompts[7], seed=20, budget=6), _job(prompts[0], seed=21, budget=5)]
    return [first, second, third]


def _run_waves(generator: DynamicGenerator, cancel_seed: int | None = None
               ) -> list[dict[str, Any]]:
    waves, out, step = _waves(), [], 0
    jobs = {j.seed: j for wave in waves for j in wave}
    while True:
        if step in (0, 3, 7):
            generator.enqueue(waves[(0, 3, 7).index(step)])
        if step == 5 and cancel_seed is not None:
            generator.cancel(jobs[cancel_seed])
        step += 1
        for r in generator.iterate():
            out.append({k: (type(v).__name__ if k == "error" else v)
                        for k, v in r.items() if k not in TIMINGS and k not in ("job",
                                                                                "token_probs")})
        if step > 7 and not generator.num_remaining_jobs():
            return out


@pytest.mark.parametrize("overlap", [True, False])
def test_every_draw_carries_the_next_counter(make_generator: Callable[..., DynamicGenerator],
                                             monkeypatch: pytest.MonkeyPatch,
                                             overlap: bool) -> None:
    draws = _Draws(monkeypatch)
    results = _run_waves(make_generator(overlap_steps=overlap), cancel_seed=2)
    finals = {r["identifier"]: r for r in results if r["eos"]}
    assert finals[2]["eos_reason"] == "cancelled"
    for seed, counters in draws.by_seed.items():
        assert counters == list(range(len(counters))), seed
        if seed not in (2, 10):  # cancelled (a drawn token may be dropped), rewinds
            assert len(counters) == finals[seed]["new_tokens"], seed
    assert draws.masked_launches == 0


def test_overlapped_and_synchronous_steps_draw_alike(
        make_generator: Callable[..., DynamicGenerator],
        monkeypatch: pytest.MonkeyPatch) -> None:
    launches = [0]
    launch = Sampler.launch_tokens

    def counted(sampler: Sampler, *args: Any, **kw: Any) -> Any:
        out = launch(sampler, *args, **kw)
        launches[0] += out is not None
        return out

    with monkeypatch.context() as patch:
        patch.setattr(Sampler, "launch_tokens", counted)
        overlapped = _run_waves(make_generator(overlap_steps=True))
    assert launches[0] > 5
    assert overlapped == _run_waves(make_generator(overlap_steps=False))


def _decoding(make_generator: Callable[..., DynamicGenerator]) -> DynamicGenerator:
    generator = make_generator()
    generator.enqueue([_job(p, seed=i, budget=20) for i, p in enumerate(mixed_prompts(3, 5))])
    while any(len(j.job.new_token_ids) == 0 for j in generator._records.values()):
        generator.iterate()
    return generator


def test_a_launch_after_a_masked_host_step_of_the_same_jobs_has_no_mask(
        make_generator: Callable[..., DynamicGenerator],
        monkeypatch: pytest.MonkeyPatch) -> None:
    generator = _decoding(make_generator)
    sampler, records = generator._sampler, list(generator._records.values())
    vocab = sampler.vocab_size
    logits = torch.randn(len(records), vocab, generator=torch.Generator().manual_seed(1)) * 3
    assert sampler.start(logits, records, overlap=True).ids is not None  # launched, remembered
    only = np.zeros((len(records), mask_words(vocab)), dtype=np.int32)
    only[:, 0] = 1 << 7  # every row may only take token 7
    with monkeypatch.context() as patch:
        patch.setattr(StepSampler, "_masks", lambda self, records: only)
        for r in records:
            r.matcher = object()  # as if constrained: only a constrained job's row is its mask
        assert sampler.start(logits, records).tokens() == [7] * len(records)
        for r in records:
            r.matcher = None
    draws = _Draws(monkeypatch)
    counters = [r.counter for r in records]
    launched = sampler.start(logits, records, overlap=True)
    assert launched.ids is not None and draws.masked_launches == 0
    assert launched.tokens() == sampler.start(logits, records).tokens()
    assert [r.counter for r in records] == counters  # the generator counts draws, not start


def test_launches_of_changing_jobs_take_each_jobs_own_counter(
        make_generator: Callable[..., DynamicGenerator]) -> None:
    generator = _decoding(make_generator)
    sampler, records = generator._sampler, list(generator._records.values())
    logits = torch.randn(len(records), sampler.vocab_size,
                         generator=torch.Generator().manual_seed(2)) * 3
    full = sampler.start(logits, records, overlap=True)
    records[1].counter += 5  # as if it had drawn more
    part = sampler.start(logits[[0, 2]], [records[0], records[2]], overlap=True)
    assert full.ids is not None and part.ids is not None
    assert part.tokens() == [full.tokens()[0], full.tokens()[2]]
    moved = sampler.start(logits, records, overlap=True)
    assert moved.ids is not None and moved.tokens() == sampler.start(logits, records).tokens()


def _penalized_jobs(prompt: list[int], banned: list[str]) -> list[Job]:
    return [_job(prompt, seed=s, budget=24, gen_settings=PENALIZED, banned_strings=banned)
            for s in range(4)] + [_job(prompt, seed=9, budget=24)]


def _run_checking_history(generator: DynamicGenerator, jobs: list[Job]) -> dict[int, str]:
    """Run ``jobs``, checking every job's history after every step; their texts by seed."""
    generator.enqueue(jobs)
    records = dict(generator._records)
    texts = {j.seed: "" for j in jobs}
    while generator.num_remaining_jobs():
        for r in generator.iterate():
            texts[r["job"].seed] += r.get("text", "")
        for a in records.values():
            if a.needs_history:
                assert a.history == list(a.job.input_ids) + a.job.new_token_ids
            else:
                assert a.history == []
    return texts


@pytest.mark.parametrize("overlap", [True, False])
def test_history_is_kept_exactly_for_the_jobs_that_read_it(
        make_generator: Callable[..., DynamicGenerator], monkeypatch: pytest.MonkeyPatch,
        overlap: bool) -> None:
    generator = make_generator(overlap_steps=overlap)
    prompt = generator.tokenizer.encode("the quick brown fox")
    free = _run_checking_history(generator, _penalized_jobs(prompt, []))
    # Ban a piece the penalized jobs produced: the same seeds now rewind over it.
    piece = next(t[i:i + 2] for t in list(free.values())[:4] for i in range(len(t) - 1)
                 if t[i:i + 2].strip() and "\ufffd" not in t[i:i + 2])
    rewinds = [0]
    on_rewind = JobRecord.on_rewind

    def counted(a: JobRecord, *args: Any) -> None:
        rewinds[0] += 1
        on_rewind(a, *args)

    monkeypatch.setattr(JobRecord, "on_rewind", counted)
    texts = _run_checking_history(make_generator(overlap_steps=overlap),
                                  _penalized_jobs(prompt, [piece]))
    assert rewinds[0] > 0
    assert all(piece.lower() not in text.lower() for text in texts.values())
