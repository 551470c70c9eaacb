"""Speculative decoding on the GPU, random Llama-3-8B-shape weights (issue 23's device figures).

(a) ``verify``: the cost of a verify step (each of ``batch`` jobs feeds its last token plus ``k``
    drafts) against a plain decode step of the same jobs, k = 1..8 at batch 1, 8, 32, 128, at
    a 512-token context; the runner's forwards (CUDA graphs where it replays them) and eager
    ones, CUDA-event medians.
(b) ``oracle``: batch 1, k = 4, a drafter that proposes the target's own greedy continuation
    (every draft is right): tok/s against plain decoding; the ceiling of the verify path. The
    model is made `decisive` first (same shapes and costs; its next token wins by a wide margin),
    since with plain random weights a verify forward and a one-token decode part at bf16
    near-ties, after which no recorded continuation is the oracle's.
(c) ``wrong``: a drafter that is always wrong, batch 1 to 256: tok/s with speculation on
    against off (target >= 0.97: the draft length falls to zero and steps overlap again). A
    timed run that captured a CUDA graph (a verify graph's first use) is run again.
(d) ``pair``: the Qwen2.5-Coder pair's shapes (28-layer 1.5B target, 24-layer 0.5B draft), random
    weights: the draft step's cost over the target's (plain decodes of each), and the speedup
    at an acceptance rate ``--alpha`` (the CPU-measured one) as the oracle drafter with
    random rejections at that rate, the draft model's forwards run for their cost.

    python benchmarks/speculative_gpu.py [--parts verify,oracle,wrong,pair] [--small]
        [--layers N] [--new-tokens 128] [--alpha 0.89] [--batches 1,8,32,128,256]

``--small`` runs every part on a small model (a smoke run; on the CPU too).
"""

from __future__ import annotations

import argparse
import random
import time
from collections.abc import Sequence
from typing import Any

import torch
from _common import (
    GREEDY,
    add_common_args,
    bench_config,
    cuda_seconds,
    device_name,
    free_memory,
    make_generator,
    random_model,
    random_prompts,
    report,
    synchronize,
    word_tokenizer,
)

from dyngen_core import DynamicGenerator, Job, Model
from dyngen_core.engine.plan import SequenceSlice, StepPlan
from dyngen_core.kv.attention import get_backend
from dyngen_core.kv.attention.base import build_forward_batch
from dyngen_core.kv.cache import Cache
from dyngen_core.runtime.drafters import Draft, DraftRequest, ModelDrafter
from dyngen_core.runtime.runner import ModelRunner

CONTEXT = 512
QWEN_TARGET = {"hidden_size": 1536, "intermediate_size": 8960, "num_hidden_layers": 28,
               "num_attention_heads": 12, "num_key_value_heads": 2, "head_dim": 128,
               "vocab_size": 151936, "rope_theta": 1000000.0}
QWEN_DRAFT = {**QWEN_TARGET, "hidden_size": 896, "intermediate_size": 4864,
              "num_hidden_layers": 24, "num_attention_heads": 14, "head_dim": 64}


class OracleDrafter:
    """Proposes each job's recorded continuation (``recorded[job_id]``, the plain run's
    output), each token replaced by a wrong one with probability ``1 - alpha``; ``inner``: a
    drafter run first for its cost only (its tokens are dropped)."""

    def __init__(self, recorded: dict[int, list[int]], prompt_lens: dict[int, int],
                 alpha: float = 1.0, inner: ModelDrafter | None = None, seed: int = 0) -> None:
        self.recorded, self.prompt_lens = recorded, prompt_lens
        self.alpha, self.inner = alpha, inner
        self.cost_ratio = 0.0 if inner is None else inner.cost_ratio
        self.samples = False
        self._rng = random.Random(seed)

    def follow(self, plan: StepPlan) -> None:
        if self.inner is not None:
            self.inner.follow(plan)

    def draft(self, requests: Sequence[DraftRequest]) -> list[Draft]:
        if self.inner is not None:
            self.inner.draft(requests)
        out = []
        for r in requests:
            done = len(r.history) - self.prompt_lens[r.job_id]
            truth = self.recorded[r.job_id][done:done + r.length]
            out.append(Draft([t if self._rng.random() < self.alpha else (t + 1) % 1000 + 1
                              for t in truth]))
        return out

    def settle(self, job_id: int, valid: int) -> None:
        if self.inner is not None:
            self.inner.settle(job_id, valid)

    def forget(self, job_id: int) -> None:
        if self.inner is not None:
            self.inner.forget(job_id)


class WrongDrafter(OracleDrafter):
    """Proposes tokens the target never picks (``alpha`` 0)."""

    def __init__(self, recorded: dict[int, list[int]], prompt_lens: dict[int, int]) -> None:
        super().__init__(recorded, prompt_lens, alpha=0.0)


class Phases:
    """Where a generator's steps go, for a diagnosis (the generator's own methods wrapped, so
    this reads private attributes): steps, verify steps by query length (``verify_q5``: the
    longest draft 4), steps that did not overlap the next, the host seconds inside the runner
    (verify and plain steps apart), the drafter, and the sampler's start; ``reset`` between
    runs."""

    def __init__(self, generator: DynamicGenerator) -> None:
        self.counts: dict[str, float] = {}
        runner, sampler = generator._runner, generator._sampler
        self._wrap(runner, "run", lambda plan, *a, **k: "plain" if not any(
            s.draft_ids for s in plan.slices) else
            f"verify_q{1 + max(len(s.draft_ids) for s in plan.slices)}")
        self._wrap(sampler, "start", lambda *a, **k: "sample")
        may_overlap = generator._may_overlap

        def overlap() -> bool:
            result = may_overlap()
            self.counts["steps"] = self.counts.get("steps", 0) + 1
            self.counts["no_overlap"] = self.counts.get("no_overlap", 0) + (not result)
            return result

        generator._may_overlap = overlap  # type: ignore[method-assign]
        if generator.speculator is not None:
            self._speculator = generator.speculator

    def _wrap(self, owner: Any, name: str, label: Any) -> None:
        inner = getattr(owner, name)

        def timed(*args: Any, **kwargs: Any) -> Any:
            began = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                key = label(*args, **kwargs)
                self.counts[key + "_ms"] = (self.counts.get(key + "_ms", 0.0)
                                            + (time.perf_counter() - began) * 1e3)
                self.counts[key] = self.counts.get(key, 0) + 1

        setattr(owner, name, timed)

    def draft_timer(self, drafter: Any) -> Any:
        """``drafter`` with its ``draft`` timed into these counts."""
        self._wrap(drafter, "draft", lambda *a, **k: "draft")
        return drafter

    def reset(self) -> dict[str, float]:
        counts, self.counts = self.counts, {}
        return {k: round(v, 3) for k, v in counts.items()}


def generate(generator: DynamicGenerator, prompts: list[list[int]], new_tokens: int
             ) -> tuple[float, dict[int, list[int]], dict[str, int]]:
    """Greedy jobs of exactly ``new_tokens`` tokens: (seconds, tokens by job id, draft counts).
    The seconds are the decode phase's for one job (its ``time_generate``, over the tokens
    after the first), else enqueue to end."""
    jobs = [Job(input_ids=p, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                stop_conditions=[], gen_settings=GREEDY) for p in prompts]
    synchronize()
    start = time.perf_counter()
    generator.enqueue(jobs)
    finals = []
    while generator.num_remaining_jobs():
        finals += [r for r in generator.iterate() if r["eos"]]
    synchronize()
    seconds = time.perf_counter() - start
    if len(jobs) == 1 and new_tokens > 1:
        seconds = float(finals[0]["time_generate"]) * new_tokens / (new_tokens - 1)
    stats = generator.stats()
    return seconds, {j.job_id: list(j.new_token_ids) for j in jobs if j.job_id is not None}, {
        "accepted": stats.draft_tokens_accepted, "rejected": stats.draft_tokens_rejected}


def verify_costs(model: Model, batches: Sequence[int], max_k: int) -> None:
    """(a): verify-step forwards against plain decode forwards, as the runner runs them (CUDA
    graphs where `StepGraphs.can_run` takes the step) and eagerly."""
    runners = {}
    for graphs in (True, False):
        cache = Cache(model, max_tokens=max(batches) * (CONTEXT + 256))
        runners[graphs] = ModelRunner(model, cache, get_backend("auto", model.device),
                                      cuda_graphs=graphs, max_batch_size=max(batches))
    pages_per_job = -(-(CONTEXT + max_k + 1) // runners[True].cache.page_size)
    for batch in batches:
        def plan(k: int, batch: int = batch) -> StepPlan:
            return StepPlan(slices=[SequenceSlice(
                j, [5], CONTEXT, list(range(j * pages_per_job, (j + 1) * pages_per_job)), True,
                list(range(7, 7 + k))) for j in range(batch)])
        graphed, eager = runners[True], runners[False]
        plain = cuda_seconds(lambda: graphed.run(plan(0)))  # noqa: B023 - called here
        plain_eager = cuda_seconds(lambda: eager.run(plan(0)))  # noqa: B023
        for k in range(1, max_k + 1):
            seconds = cuda_seconds(lambda k=k: graphed.run(plan(k)))  # noqa: B023
            seconds_eager = cuda_seconds(lambda k=k: eager.run(plan(k)))  # noqa: B023
            replayed = graphed.graphs is not None and graphed.graphs.can_run(plan(k))
            report("speculative_gpu.verify", batch=batch, k=k, plain_ms=plain * 1e3,
                   verify_ms=seconds * 1e3, ratio=seconds / plain, graphed=replayed,
                   eager_plain_ms=plain_eager * 1e3, eager_verify_ms=seconds_eager * 1e3,
                   eager_ratio=seconds_eager / plain_eager)
    del runners
    free_memory()


def with_drafter(model: Model, tokenizer: Any, prompts: list[list[int]], drafter: Any, k: int,
                 cache_tokens: int = 4096) -> DynamicGenerator:
    """A speculative generator whose drafter is ``drafter`` (a benchmark-only drafter), with
    ``cache_tokens`` per prompt."""
    generator = make_generator(model, tokenizer, cache_tokens=len(prompts) * cache_tokens,
                               use_ngram_draft=True, num_draft_tokens=k,
                               max_batch_size=max(len(prompts), 1))
    assert generator.speculator is not None
    generator.speculator.drafter = drafter
    generator.speculator.draft_cost_ratio = 0.0  # the drafter is free: its tokens are known
    generator.speculator.measure_draft_cost = False
    return generator


def own_continuation(generator: DynamicGenerator, prompts: list[list[int]], new_tokens: int,
                     truth: list[int], make_drafter: Any, attempts: int = 6
                     ) -> tuple[float, list[int], bool, dict[str, int]]:
    """Run one job again and again with ``make_drafter(truth)`` as the drafter, ``truth`` each
    time the last run's output, until a run makes the very tokens it was offered (a verify
    forward and a one-token decode may pick different tokens at near-ties, after which a
    recorded continuation is wrong; the speculative run's own continuation is the oracle).
    The measured run is one that made its offered tokens and captured no CUDA graph (a run's
    draft lengths, and so its verify graphs, may differ from the last one's). Returns the last
    run's seconds, tokens, whether they were the offered ones, and its draft counts."""
    assert generator.speculator is not None
    matched = False
    runs = 0
    while runs < attempts:
        runs += 1
        generator.speculator.drafter = make_drafter(truth)
        before, captures = generator.stats(), captured(generator)
        seconds, got, _ = generate(generator, prompts, new_tokens)
        after = generator.stats()
        output = next(iter(got.values()))
        matched = output == truth
        truth = output
        if matched and captured(generator) == captures:
            break
    counts = {"accepted": after.draft_tokens_accepted - before.draft_tokens_accepted,
              "rejected": after.draft_tokens_rejected - before.draft_tokens_rejected,
              "runs": runs}
    return seconds, truth, matched, counts


def captured(generator: DynamicGenerator) -> int:
    """The CUDA graphs the generator's runner captured so far (a verify graph is captured the
    first time its batch bucket and draft length come up: a run that captured one timed the
    capture too)."""
    return generator._runner.graph_captures


def timed_run(generator: DynamicGenerator, prompts: list[list[int]], new_tokens: int,
              attempts: int = 4) -> float:
    """`generate`'s seconds of a run that captured no CUDA graph (run again while one did)."""
    for _ in range(attempts):
        captures = captured(generator)
        seconds = generate(generator, prompts, new_tokens)[0]
        if captured(generator) == captures:
            break
    return seconds


def _every_job(tokens: list[int], count: int = 64) -> dict[int, list[int]]:
    return dict.fromkeys(range(count), tokens)


def decisive(model: Model, seed: int = 5) -> Model:
    """Make a random model's greedy choice robust to rounding, in place, without changing its
    shapes or costs: the layers' output projections are scaled down (the residual stream stays
    near the input token's embedding) and the output head is the embedding rows permuted, so
    the next token is a fixed permutation of the current one, ahead of the runner-up by tens of
    logits (near-ties between a verify forward and a one-token decode part plain random weights
    in bf16 within a few dozen tokens)."""
    generator = torch.Generator(device="cpu").manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("attn.o_weight", "mlp.down_weight")):
                param.mul_(0.05)
        embed = dict(model.named_parameters())["embed_weight"]
        embed.mul_(50.0)  # token embeddings well above what the scaled layers add
        order = torch.randperm(embed.shape[0], generator=generator).to(embed.device)
        dict(model.named_parameters())["lm_head_weight"].copy_(embed[order])
    return model


def oracle(model: Model, tokenizer: Any, new_tokens: int, k: int) -> None:
    """(b): the target's own continuation as drafts, batch 1 (`own_continuation`). Where it
    differs from plain decoding's, the report says where and the gap between the two best
    logits there."""
    prompts = random_prompts(1, CONTEXT, model.config.vocab_size)
    plain = make_generator(model, tokenizer, cache_tokens=4096)
    generate(plain, prompts, 8)
    seconds, recorded, _ = generate(plain, prompts, new_tokens)
    base = new_tokens / seconds
    del plain
    free_memory()
    spec = with_drafter(model, tokenizer, prompts, None, k)
    phases = Phases(spec)
    runs: list[dict[str, float]] = []

    def oracle_drafter(truth: list[int]) -> OracleDrafter:
        runs.append(phases.reset())
        return OracleDrafter(_every_job(truth), _every_job(CONTEXT))

    seconds, got, offered, counts = own_continuation(spec, prompts, new_tokens, recorded[1],
                                                     oracle_drafter)
    rate = new_tokens / seconds
    report("speculative_gpu.oracle", k=k, plain_tok_s=base, speculative_tok_s=rate,
           speedup=rate / base, drafts_were_output=offered,
           **_agreement(model, prompts[0], recorded[1], got), **counts,
           phases=phases.reset(), earlier_runs_phases=runs[1:],
           step_ms_predicted=[round((spec.speculator.costs.predict(n) or 0.0) * 1e3, 4)
                              for n in (1, 1 + k)],
           threshold=spec.speculator.costs.threshold(1, spec.speculator.draft_cost_ratio))
    del spec
    free_memory()


def _agreement(model: Model, prompt: list[int], recorded: list[int], got: list[int]
               ) -> dict[str, Any]:
    """Whether ``got`` equals ``recorded``; else the first difference and the gap between the
    two best logits of an eager prefill forward at that position."""
    if got == recorded:
        return {"same_output": True}
    index = next(i for i, (a, b) in enumerate(zip(got, recorded, strict=False)) if a != b)
    tokens = prompt + recorded[:index]
    cache = Cache(model, max_tokens=len(tokens) + 256)
    pages = list(range(-(-len(tokens) // cache.page_size)))
    batch = build_forward_batch(StepPlan([SequenceSlice(0, tokens, 0, pages, True)]),
                                cache.page_size, model.device)
    with torch.inference_mode():
        logits = model.forward(batch, cache.storage, get_backend("auto", model.device))
    best = logits[-1].float().topk(2).values
    return {"same_output": False, "first_difference": index,
            "top_two_gap": float(best[0] - best[1])}


def always_wrong(model: Model, tokenizer: Any, batches: Sequence[int], new_tokens: int,
                 repeats: int = 3) -> None:
    """(c): speculation on with an always-wrong drafter against off, by batch size: both
    generators warmed up, then runs alternating off / on ``repeats`` times, medians."""
    for batch in batches:
        prompts = random_prompts(batch, 128, model.config.vocab_size, seed=batch)
        plain = make_generator(model, tokenizer, cache_tokens=batch * 512,
                               max_batch_size=batch)
        drafter = WrongDrafter({}, dict.fromkeys(range(4 * repeats * batch + 4 * batch), 128))
        drafter.recorded = dict.fromkeys(drafter.prompt_lens, [0] * (new_tokens + 8))
        spec = with_drafter(model, tokenizer, prompts, drafter, 4, cache_tokens=512)
        for generator in (plain, spec):  # the warm-ups also capture the verify graphs
            generate(generator, prompts, new_tokens)
        off, on = [], []
        for _ in range(repeats):  # runs that captured a graph are run again
            off.append(timed_run(plain, prompts, new_tokens))
            on.append(timed_run(spec, prompts, new_tokens))
        off_s, on_s = sorted(off)[len(off) // 2], sorted(on)[len(on) // 2]
        stats = spec.stats()
        report("speculative_gpu.always_wrong", batch=batch, off_tok_s=batch * new_tokens / off_s,
               on_tok_s=batch * new_tokens / on_s, on_over_off=off_s / on_s,
               on_over_off_runs=[round(a / b, 4) for a, b in zip(off, on, strict=True)],
               rejected_per_job_run=stats.draft_tokens_rejected / ((repeats + 1) * batch))
        del plain, spec
        free_memory()


def pair(device: torch.device, new_tokens: int, alpha: float, k: int, small: bool) -> None:
    """(d): the Qwen pair's shapes, random weights."""
    base = bench_config(argparse.Namespace(small=small, layers=None))
    target_config = {**base, **({} if small else QWEN_TARGET)}
    draft_config = {**target_config, **({"num_hidden_layers": 1} if small else QWEN_DRAFT)}
    target = decisive(random_model(target_config, device))
    draft = random_model(draft_config, device, seed=1)
    tokenizer = word_tokenizer(target.config.vocab_size)
    prompts = random_prompts(1, CONTEXT, target.config.vocab_size)
    costs = {}
    for name, model in (("target", target), ("draft", draft)):
        plain = make_generator(model, tokenizer, cache_tokens=4096)
        generate(plain, prompts, 8)
        seconds, recorded, _ = generate(plain, prompts, new_tokens)
        costs[name] = seconds / new_tokens
        if name == "target":
            truth = recorded[1]
        del plain
        free_memory()
    plain = make_generator(target, tokenizer, cache_tokens=4096)
    generate(plain, prompts, 8)
    phases = Phases(plain)
    base_seconds, _, _ = generate(plain, prompts, new_tokens)
    plain_phases = phases.reset()
    del plain
    free_memory()
    spec = make_generator(target, tokenizer, cache_tokens=4096, draft_model=draft,
                          num_draft_tokens=k)
    assert spec.speculator is not None
    inner = spec.speculator.drafter
    assert isinstance(inner, ModelDrafter)
    phases = Phases(spec)
    runs: list[dict[str, float]] = []

    def oracle_drafter(own: list[int]) -> OracleDrafter:
        runs.append(phases.reset())
        return phases.draft_timer(OracleDrafter(_every_job(own), _every_job(CONTEXT),
                                                alpha=alpha, inner=inner))

    seconds, got, offered, counts = own_continuation(spec, prompts, new_tokens, truth,
                                                     oracle_drafter)
    report("speculative_gpu.pair", alpha=alpha, k=k, draft_over_target=costs["draft"] /
           costs["target"], plain_tok_s=new_tokens / base_seconds,
           speculative_tok_s=new_tokens / seconds, speedup=base_seconds / seconds,
           drafts_were_output=offered, **_agreement(target, prompts[0], truth, got), **counts,
           draft_cost_ratio=spec.speculator.draft_cost_ratio,
           step_ms_predicted=[round((spec.speculator.costs.predict(n) or 0.0) * 1e3, 4)
                              for n in (1, 1 + k)],
           threshold=spec.speculator.costs.threshold(1, spec.speculator.draft_cost_ratio),
           plain_phases=plain_phases,
           speculative_phases=phases.reset(), earlier_runs_phases=runs[1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    add_common_args(parser)
    parser.add_argument("--parts", default="verify,oracle,wrong,pair")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--alpha", type=float, default=0.89)
    parser.add_argument("--batches", default="1,8,32,128,256",
                        help="batch sizes of the always-wrong part, comma-separated")
    args = parser.parse_args()
    device = torch.device(args.device)
    parts = args.parts.split(",")
    report("speculative_gpu.setup", device=device_name(), parts=parts)
    small_batches = [1, 2, 4] if args.small else None
    if {"verify", "oracle", "wrong"} & set(parts):
        model = random_model(bench_config(args), device)
        tokenizer = word_tokenizer(model.config.vocab_size)
        if "verify" in parts:
            verify_costs(model, small_batches or [1, 8, 32, 128], 8)
        if "oracle" in parts:
            oracle(decisive(model), tokenizer, args.new_tokens, args.k)
        if "wrong" in parts:
            always_wrong(model, tokenizer,
                         small_batches or [int(b) for b in args.batches.split(",")],
                         args.new_tokens)
        del model
        free_memory()
    if "pair" in parts:
        pair(device, args.new_tokens, args.alpha, args.k, args.small)


if __name__ == "__main__":
    main()
