"""Speculative decoding through the generator: drafts from an n-gram index, a draft model that
is the target itself (always right), or a different small model (mostly wrong), never change
what a job outputs: greedy and seeded sampled jobs give the tokens of plain decoding, in mixed
batches with constraints, banned and stop strings, dedup, prompt-cache hits, preemption and
cancellation. Every generator's page invariant is checked when its test ends."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from dyngen_core import Cache, DynamicGenerator, Job, Model, SamplerSettings, Tokenizer
from dyngen_core.engine.record import SampleRequest
from dyngen_core.engine.speculation import accept_run
from dyngen_core.errors import JobError
from dyngen_core.runtime.speculator import build_speculator
from dyngen_core.sampling.sampler import Sampler
from tests.engine.test_mixed_steps import _jobs
from tests.tiny_models import write_tiny_model

DRAFTERS = ["ngram", "oracle", "small_model"]
# Logits of plain and verify forwards are summed in different orders: a greedy token may
# differ only where the two best logits are closer than this.
NEAR_TIE = 1e-4
REPEAT = "one two three four five six seven eight one two three four five six seven eight one"


@pytest.fixture(scope="module")
def small_draft(tmp_path_factory: pytest.TempPathFactory) -> Model:
    """A one-layer random model of the target's vocabulary: its drafts are mostly wrong."""
    folder = write_tiny_model(tmp_path_factory.mktemp("draft"), arch="llama", seed=11,
                              num_hidden_layers=1)
    return Model.load(folder, device="cpu", dtype="float32")


@pytest.fixture
def speculative(make_generator: Callable[..., DynamicGenerator],
                engine_parts: tuple[Model, Tokenizer], small_draft: Model
                ) -> Callable[..., DynamicGenerator]:
    """``speculative(drafter, **options)``: a generator drafting the given way; drafts are
    made to pay (the drafter's cost is set to zero, and the step cost model keeps its prior,
    whatever a loaded machine's step timings say) so that every path is exercised."""

    def make(drafter: str, **options: Any) -> DynamicGenerator:
        if drafter == "ngram":
            generator = make_generator(use_ngram_draft=True, **options)
        else:
            draft = engine_parts[0] if drafter == "oracle" else small_draft
            generator = make_generator(draft_model=draft, **options)
        assert generator.speculator is not None
        generator.speculator.measure_draft_cost = False
        generator.speculator.draft_cost_ratio = 0.0
        costs = generator.speculator.costs
        costs.record = lambda tokens, seconds: None  # type: ignore[method-assign]
        return generator

    return make


def run_tokens(generator: DynamicGenerator, jobs: list[Job], limit: int = 800,
               cancel: tuple[Any, int] | None = None) -> dict[Any, dict[str, Any]]:
    """Run ``jobs`` to their ends: per identifier, every token id and the final result.
    ``cancel``: (identifier, step) cancels that job at that step."""
    generator.enqueue(jobs)
    by_id = {job.identifier: job for job in jobs}
    out: dict[Any, dict[str, Any]] = {job.identifier: {"tokens": []} for job in jobs}
    for step in range(limit):
        if not generator.num_remaining_jobs():
            return out
        if cancel is not None and step == cancel[1]:
            generator.cancel(by_id[cancel[0]])
        for r in generator.iterate():
            out[r["identifier"]]["tokens"].extend(r.get("token_ids", []))
            if r["eos"]:
                out[r["identifier"]]["final"] = r
    raise AssertionError(f"jobs still running after {limit} steps")


def assert_same_output(plain: dict[str, Any], drafted: dict[str, Any],
                       model: Model, prompt: list[int], name: Any) -> None:
    """The same tokens, or a first difference at a near-tie of the target's logits."""
    a, b = plain["tokens"], drafted["tokens"]
    if a == b:
        assert plain["final"]["full_completion"] == drafted["final"]["full_completion"], name
        return
    at = next(i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y)
    logits = _logits_after(model, prompt + a[:at])
    top2 = torch.topk(logits, 2).values
    assert float(top2[0] - top2[1]) < NEAR_TIE, (name, at, a, b)


def _logits_after(model: Model, tokens: list[int]) -> torch.Tensor:
    """The target's next-token logits after ``tokens`` (one plain prefill)."""
    from dyngen_core.engine.plan import SequenceSlice, StepPlan
    from dyngen_core.kv.attention import get_backend
    from dyngen_core.kv.attention.base import build_forward_batch

    cache = Cache(model, max_tokens=len(tokens) + 256)
    pages = list(range(-(-len(tokens) // cache.page_size)))
    plan = StepPlan(slices=[SequenceSlice(0, tokens, 0, pages, True)])
    batch = build_forward_batch(plan, cache.page_size, model.device)
    return model.forward(batch, cache.storage, get_backend("sdpa", model.device))[0]


def _mix(tokenizer: Tokenizer) -> list[Job]:
    """The mixed-step jobs (constrained, plain, sampled, banned, choice, min_new_tokens) and
    jobs whose prompts repeat (n-gram drafts hit)."""
    repeat = tokenizer.encode(REPEAT)
    return [*_jobs(tokenizer),
            Job(input_ids=repeat, max_new_tokens=16, stop_conditions=[],
                gen_settings=SamplerSettings.greedy(), identifier="repeat-greedy"),
            Job(input_ids=repeat, max_new_tokens=16, stop_conditions=[],
                gen_settings=SamplerSettings(temperature=0.8, top_k=20), seed=2,
                identifier="repeat-sampled"),
            Job(input_ids=repeat, max_new_tokens=12, stop_conditions=[],
                gen_settings=SamplerSettings(temperature=0.8, token_repetition_penalty=1.2,
                                             dry_multiplier=0.8), seed=9,
                identifier="repeat-penalty")]


@pytest.mark.parametrize("drafter", DRAFTERS)
def test_mixed_batch_output_is_unchanged(make_generator, speculative, engine_parts, drafter):
    model, tokenizer = engine_parts
    plain = run_tokens(make_generator(), _mix(tokenizer))
    generator = speculative(drafter)
    jobs = _mix(tokenizer)
    drafted = run_tokens(generator, jobs)
    for job in jobs:
        name = job.identifier
        assert drafted[name]["final"]["eos_reason"] != "error", drafted[name]["final"]
        assert_same_output(plain[name], drafted[name], model, job.input_ids, name)
    stats = generator.stats()
    finals = [d["final"] for d in drafted.values()]
    assert stats.draft_tokens_accepted == sum(f["accepted_draft_tokens"] for f in finals)
    assert stats.draft_tokens_rejected == sum(f["rejected_draft_tokens"] for f in finals)
    assert stats.draft_tokens_accepted + stats.draft_tokens_rejected > 0
    if drafter == "oracle":
        # Drafts follow the constraint and stop where it completes (the matcher, fed past
        # completion, rolled back wrongly and let invalid JSON through).
        for name in ("repeat-greedy", "json"):
            assert drafted[name]["final"]["accepted_draft_tokens"] > 0, name


@pytest.mark.parametrize("drafter", DRAFTERS)
def test_dedup_prompt_cache_and_preemption_keep_output(make_generator, speculative,
                                                       engine_parts, drafter):
    """Six jobs of 240-252 tokens sharing a 200-token prefix in a 4-page cache: their decodes
    cross a page boundary, so jobs wait and running ones are preempted and recomputed; then
    the same jobs again (prompt-cache hits)."""
    model, tokenizer = engine_parts
    prefix = tokenizer.encode(REPEAT * 30)[:200]
    rng = random.Random(5)
    prompts = [prefix + [rng.randrange(10, 500) for _ in range(rng.randrange(40, 52))]
               for _ in range(6)]

    def jobs(round_: int) -> list[Job]:
        return [Job(input_ids=prompt, max_new_tokens=16, stop_conditions=[],
                    gen_settings=SamplerSettings.greedy() if i % 2 else
                    SamplerSettings(temperature=0.9, top_p=0.95), seed=i,
                    identifier=(round_, i)) for i, prompt in enumerate(prompts)]

    plain = make_generator(cache_tokens=1024)
    generator = speculative(drafter, cache_tokens=1024)
    for round_ in range(2):
        expected = run_tokens(plain, jobs(round_))
        batch = jobs(round_)
        got = run_tokens(generator, batch)
        for job in batch:
            assert_same_output(expected[job.identifier], got[job.identifier], model,
                               job.input_ids, job.identifier)
    stats = generator.stats()
    assert stats.preemptions > 0 and stats.prefill_tokens_reused > 0


@pytest.mark.parametrize("drafter", ["ngram", "oracle"])
def test_stop_strings_and_cancellation_inside_runs(make_generator, speculative, engine_parts,
                                                   drafter):
    model, tokenizer = engine_parts
    prompt = tokenizer.encode(REPEAT)
    probe = run_tokens(make_generator(), [Job(input_ids=prompt, max_new_tokens=20,
                                              stop_conditions=[], identifier="probe",
                                              gen_settings=SamplerSettings.greedy())])
    text = probe["probe"]["final"]["full_completion"]
    stop = text[len(text) // 2:len(text) // 2 + 2]  # reached mid-output, maybe mid-run

    def jobs() -> list[Job]:
        return [Job(input_ids=prompt, max_new_tokens=20, stop_conditions=[stop],
                    gen_settings=SamplerSettings.greedy(), identifier="stop"),
                Job(input_ids=prompt, max_new_tokens=20, stop_conditions=[],
                    gen_settings=SamplerSettings.greedy(), identifier="cancelled"),
                Job(input_ids=prompt[3:], max_new_tokens=20, stop_conditions=[],
                    gen_settings=SamplerSettings.greedy(), identifier="other")]

    plain = run_tokens(make_generator(), jobs())
    got = run_tokens(speculative(drafter), jobs(), cancel=("cancelled", 4))
    assert got["stop"]["final"]["eos_reason"] == "stop_string"
    assert got["stop"]["final"]["full_completion"] == plain["stop"]["final"]["full_completion"]
    assert got["cancelled"]["final"]["eos_reason"] == "cancelled"
    assert_same_output(plain["other"], got["other"], model, prompt[3:], "other")


def test_opted_out_jobs_never_draft(speculative, engine_parts):
    tokenizer = engine_parts[1]
    prompt = tokenizer.encode(REPEAT)
    jobs = [Job(input_ids=prompt, max_new_tokens=16, stop_conditions=[],
                gen_settings=SamplerSettings.greedy(), identifier=i, speculative=i == 0)
            for i in range(2)]
    got = run_tokens(speculative("oracle"), jobs)
    assert got[0]["final"]["accepted_draft_tokens"] > 0
    assert got[1]["final"]["accepted_draft_tokens"] == 0
    assert got[1]["final"]["rejected_draft_tokens"] == 0
    assert got[0]["tokens"] == got[1]["tokens"]
    with pytest.raises(JobError, match="speculative"):
        Job(input_ids=prompt, max_new_tokens=4, speculative=1)  # type: ignore[arg-type]


def test_bad_speculative_options_are_refused(engine_parts, small_draft, tmp_path: Path):
    model, tokenizer = engine_parts

    def build(cache: Cache | None = None, **options: Any) -> DynamicGenerator:
        return DynamicGenerator(model=model, cache=cache or Cache(model, max_tokens=1024),
                                tokenizer=tokenizer, **options)

    wide = Model.load(write_tiny_model(tmp_path / "wide", arch="llama", hidden_size=128),
                      device="cpu", dtype="float32")  # head_dim 32: quantized caches take it
    with pytest.raises(ValueError, match="recent window"):
        DynamicGenerator(model=wide, cache=Cache(wide, max_tokens=1024, mode="q4"),
                         tokenizer=tokenizer, use_ngram_draft=True)
    DynamicGenerator(model=wide, cache=Cache(wide, max_tokens=1024, mode="q4", recent_window=0),
                     tokenizer=tokenizer, use_ngram_draft=True)
    with pytest.raises(ValueError, match="choose one"):
        build(draft_model=small_draft, use_ngram_draft=True)
    with pytest.raises(ValueError, match="without a draft_model"):
        build(draft_cache=Cache(small_draft, max_tokens=1024))
    with pytest.raises(ValueError, match="num_draft_tokens"):
        build(use_ngram_draft=True, num_draft_tokens=0)
    with pytest.raises(ValueError, match="pages"):
        build(draft_model=small_draft, draft_cache=Cache(small_draft, max_tokens=512))
    other = Model.load(write_tiny_model(tmp_path / "other", arch="llama", vocab_size=384),
                       device="cpu", dtype="float32")
    with pytest.raises(ValueError, match="vocabulary"):
        build(draft_model=other)
    # n-gram keys hold 21 bits a token: a larger vocabulary is refused before any job runs.
    huge = SimpleNamespace(config=SimpleNamespace(vocab_size=1 << 21))
    with pytest.raises(ValueError, match="vocabularies of up to 2,097,151 tokens"):
        build_speculator(huge, Cache(model, max_tokens=1024), None, None, 4, True, "auto",
                         False, 8)


# A chi-square statistic over 8 tokens (7 degrees of freedom) exceeds this with probability
# 0.001 when the draws follow the expected distribution.
CHI2_CRITICAL_7DF = 24.32


def _chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


@pytest.mark.parametrize("rule", ["exact", "broken"])
def test_sampled_verify_draws_the_target_distribution(rule):
    """4,000 seeded requests, each with one draft, over an 8-token vocabulary: the first token
    of each run follows the target's first distribution, and the token after an accepted
    draft its second one (chi-square at p = 0.001). A rule that accepts every draft fails."""
    torch.manual_seed(0)
    p0 = torch.softmax(torch.randn(8) * 1.5, 0)
    p1 = torch.softmax(torch.randn(8) * 1.5, 0)
    draft = int(torch.argmax(p0))  # a deterministic drafter's guess
    n = 4000
    logits = torch.stack([p0.log(), p1.log()] * n)
    settings = SamplerSettings(temperature=1.0)
    requests = [SampleRequest(settings=settings, seed=i, draft_ids=[draft]) for i in range(n)]
    results = Sampler(8).sample(logits, requests)

    def accept(drafts: list[int], drawn: list[int]) -> list[int]:
        return accept_run(drafts, drawn) if rule == "exact" else [*drafts, drawn[-1]]

    runs = [accept([draft], r.token_ids) for r in results]
    first = torch.bincount(torch.tensor([run[0] for run in runs]), minlength=8).float()
    second = torch.bincount(torch.tensor([run[1] for run in runs if len(run) > 1]),
                            minlength=8).float()
    statistics = (_chi_square(first, p0), _chi_square(second, p1))
    if rule == "exact":
        assert max(statistics) < CHI2_CRITICAL_7DF, statistics
    else:
        assert statistics[0] > CHI2_CRITICAL_7DF, statistics


class _Stream:
    """The little of a text stream the sampler reads."""

    stop_token_ids: frozenset[int] = frozenset()


@pytest.mark.parametrize("rule", ["exact", "broken"])
def test_sampled_drafts_verify_to_the_target_distribution(engine_parts, monkeypatch, rule):
    """3,000 jobs, each with two drafts drawn from a draft distribution q that differs from
    the target's p, verified in one step over 8 live tokens: the first token of each run
    follows p's first row and the token after an accepted draft p's second (chi-square at
    p = 0.001). A rule that keeps every draft follows q instead, and fails."""
    from dyngen_core.engine.record import JobRecord
    from dyngen_core.sampling import step as step_module
    from dyngen_core.sampling.step import StepSampler

    tokenizer = engine_parts[1]
    vocab = 512
    torch.manual_seed(1)
    p = torch.softmax(torch.randn(3, 8) * 1.5, -1)
    q = torch.softmax(torch.randn(2, 8) * 1.5, -1)
    wide_p = torch.zeros(3, vocab)
    wide_p[:, :8] = p
    wide_q = torch.zeros(2, vocab)
    wide_q[:, :8] = q
    if rule == "broken":
        monkeypatch.setattr(step_module, "accept_sampled",
                            lambda drafts, accepted, replacements: [*drafts, replacements[-1]])
    n = 3000
    draws = torch.Generator().manual_seed(2)
    drafts = torch.stack([torch.multinomial(q[j], n, replacement=True, generator=draws)
                          for j in range(2)], 1).tolist()
    settings = SamplerSettings(temperature=1.0)
    records = []
    for i in range(n):
        job = Job(input_ids=[1, 2], max_new_tokens=8)
        job.job_id = i
        records.append(JobRecord(job=job, stream=_Stream(), settings=settings, seed=i,
                                 draft_ids=drafts[i], draft_probs=wide_q))
    logits = wide_p.log().repeat(n, 1)
    sampler = StepSampler(vocab, torch.device("cpu"), tokenizer, [])
    runs = sampler.start(logits, records, verify=True).runs
    assert runs is not None and all(runs)
    first = torch.bincount(torch.tensor([run[0] for run in runs]), minlength=8).float()
    second = torch.bincount(torch.tensor([run[1] for run in runs if len(run) > 1]),
                            minlength=8).float()
    statistics = (_chi_square(first, p[0]), _chi_square(second, p[1]))
    if rule == "exact":
        assert max(statistics) < CHI2_CRITICAL_7DF, statistics
    else:
        assert statistics[0] > CHI2_CRITICAL_7DF, statistics


@pytest.mark.parametrize("drafter", ["oracle", "small_model"])
def test_unseeded_sampled_jobs_draft_by_sampling(speculative, engine_parts, drafter):
    """Unseeded sampled jobs take sampled drafts (seeded ones keep plain decoding's output):
    with the target as its own draft nearly every draft is kept; with a different model many
    are rejected; every job ends normally either way."""
    tokenizer = engine_parts[1]
    generator = speculative(drafter)
    jobs = [Job(input_ids=tokenizer.encode(REPEAT), max_new_tokens=20, stop_conditions=[],
                gen_settings=SamplerSettings(temperature=0.9, top_k=50), identifier=i)
            for i in range(4)]
    got = run_tokens(generator, jobs)
    finals = [got[i]["final"] for i in range(4)]
    assert all(f["eos_reason"] == "max_new_tokens" and f["new_tokens"] == 20 for f in finals)
    accepted = sum(f["accepted_draft_tokens"] for f in finals)
    rejected = sum(f["rejected_draft_tokens"] for f in finals)
    if drafter == "oracle":
        assert accepted > 3 * rejected, (accepted, rejected)
    else:
        assert rejected > 0


@pytest.mark.parametrize("drafter", ["ngram", "oracle"])
def test_a_prompt_cached_to_its_page_end_drafts_within_its_pages(make_generator, speculative,
                                                                 engine_parts, drafter):
    """A 512-token prompt run twice: the second time its two full pages are prompt-cache
    hits and its last token is fed alone, at the end of its last page; drafts must not run
    past the pages that slice holds."""
    model, tokenizer = engine_parts
    prompt = (tokenizer.encode(REPEAT) * 40)[:512]

    def job(name: str) -> Job:
        return Job(input_ids=prompt, max_new_tokens=12, stop_conditions=[],
                   gen_settings=SamplerSettings.greedy(), identifier=name)

    plain = run_tokens(make_generator(), [job("first")])
    generator = speculative(drafter)
    first = run_tokens(generator, [job("first")])
    again = run_tokens(generator, [job("again")])
    assert again["again"]["final"]["eos_reason"] == "max_new_tokens", again["again"]["final"]
    assert again["again"]["final"]["cached_tokens"] > 0
    for got in (first["first"], again["again"]):
        assert_same_output(plain["first"], got, model, prompt, drafter)


def test_ngram_jobs_on_one_document_share_its_index(make_generator, speculative, engine_parts):
    """Jobs asking about one 600-token document (two full pages, deduplicated), in a mixture:
    greedy ones (one whose question fills a full page of its own), a seeded sampled one, one
    constrained to a choice, and one cancelled mid-run. From the second job on they draft over
    one shared index of the document's pages; every finished job's output is plain
    decoding's, and the drafter keeps nothing once they end."""
    model, tokenizer = engine_parts
    document = tokenizer.encode(REPEAT * 60)[:600]
    rng = random.Random(8)

    def prompt(question: int) -> list[int]:
        return document + [rng.randrange(10, 500) for _ in range(question)]

    prompts = {"short": prompt(5), "also-short": prompt(8), "long-question": prompt(300),
               "sampled": prompt(6), "choice": prompt(7), "cancelled": prompt(9)}

    def jobs() -> list[Job]:
        greedy, sampled = SamplerSettings.greedy(), SamplerSettings(temperature=0.8, top_k=20)
        out = [Job(input_ids=prompts[name], max_new_tokens=12, stop_conditions=[],
                   gen_settings=greedy, identifier=name)
               for name in ("short", "also-short", "long-question", "cancelled")]
        out.append(Job(input_ids=prompts["sampled"], max_new_tokens=12, stop_conditions=[],
                       gen_settings=sampled, seed=3, identifier="sampled"))
        out.append(Job(input_ids=prompts["choice"], max_new_tokens=8, gen_settings=sampled,
                       seed=5, identifier="choice", constraint=["yes", "no", "maybe later"]))
        return out

    expected = run_tokens(make_generator(), jobs())
    generator = speculative("ngram")
    drafter = generator.speculator.drafter
    batch = jobs()
    by_id = {job.identifier: job for job in batch}
    generator.enqueue(batch)
    seen = set()
    got: dict[Any, dict[str, Any]] = {job.identifier: {"tokens": []} for job in batch}
    step = 0
    while generator.num_remaining_jobs():
        if step == 4:
            generator.cancel(by_id["cancelled"])
        step += 1
        for r in generator.iterate():
            got[r["identifier"]]["tokens"].extend(r.get("token_ids", []))
            if r["eos"]:
                got[r["identifier"]]["final"] = r
        seen.add(drafter.shared_prefixes())
    assert any(known >= 1 and shared == 1 for known, shared in seen)  # the document's pages
    assert drafter.shared_prefixes() == (0, 0)  # the jobs ended: nothing is kept
    assert generator.stats().draft_tokens_accepted > 0
    assert got["cancelled"]["final"]["eos_reason"] == "cancelled"
    assert got["choice"]["final"]["full_completion"] in ("yes", "no", "maybe later")
    for job in batch:
        if job.identifier != "cancelled":
            assert_same_output(expected[job.identifier], got[job.identifier], model,
                               job.input_ids, job.identifier)


class CapturingRunner:
    """A runner whose forwards number ``captured_at`` count as capturing a CUDA graph."""

    def __init__(self, inner: Any, captured_at: set[int]) -> None:
        self.inner, self.captured_at = inner, captured_at
        self.calls = self.graph_captures = 0

    def run(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        self.graph_captures += self.calls in self.captured_at
        return self.inner.run(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def test_a_step_that_captures_a_graph_does_not_teach_the_cost_model(speculative, engine_parts):
    """A verify graph is captured the first time its shape is seen: that step's time is the
    capture's, so the drafter's cost model must not learn from it (a few such steps had made
    it predict a 600 ms step and switch drafting off for good)."""
    generator = speculative("ngram")
    assert generator.speculator is not None
    learned: list[int] = []
    record = generator.speculator.costs.record
    generator.speculator.costs.record = lambda tokens, seconds: (  # type: ignore[method-assign]
        learned.append(tokens), record(tokens, seconds))
    generator._runner = CapturingRunner(generator._runner, captured_at={2, 3})
    steps = []
    generator.enqueue(Job(input_ids=engine_parts[1].encode(REPEAT), max_new_tokens=12,
                          gen_settings=SamplerSettings.greedy()))
    while generator.num_remaining_jobs():
        before = len(learned)
        generator.iterate()
        steps.append(len(learned) - before)
    assert steps[1] == steps[2] == 0  # the capturing steps (calls 2 and 3) taught nothing
    assert sum(steps) > 0  # the others did
    generator.check_invariant()


@pytest.mark.parametrize("drafter", ["ngram", "small_model"])
def test_a_drafter_that_costs_more_than_it_saves_drafts_nothing(make_generator, speculative,
                                                              engine_parts, drafter):
    """A drafter whose draft position costs five steps (a draft model too big for its target,
    say): no draft can pay, and a probe would cost more than 1 % of a short job's steps, so
    jobs of a mixed batch decode plainly, with plain decoding's output; a job cancelled while
    its drafting sleeps leaves nothing behind in the speculator."""
    tokenizer = engine_parts[1]
    prompt = tokenizer.encode(REPEAT)

    def jobs() -> list[Job]:
        greedy, sampled = SamplerSettings.greedy(), SamplerSettings(temperature=0.8, top_k=20)
        return [Job(input_ids=prompt, max_new_tokens=40, stop_conditions=[],
                    gen_settings=greedy, identifier="greedy"),
                Job(input_ids=prompt[:9], max_new_tokens=30, stop_conditions=[],
                    gen_settings=sampled, seed=4, identifier="seeded"),
                Job(input_ids=prompt[2:], max_new_tokens=40, stop_conditions=[],
                    gen_settings=greedy, identifier="cancelled")]

    expected = run_tokens(make_generator(), jobs())
    generator = speculative(drafter)
    speculator = generator.speculator
    assert speculator is not None
    speculator.draft_cost_ratio = 5.0  # pinned: the fixture turned measuring off
    got = run_tokens(generator, jobs(), cancel=("cancelled", 12))
    stats = generator.stats()
    assert stats.draft_tokens_accepted == stats.draft_tokens_rejected == 0
    for name in ("greedy", "seeded"):
        assert got[name]["tokens"] == expected[name]["tokens"], name
    assert got["cancelled"]["final"]["eos_reason"] == "cancelled"
    assert not speculator._asleep.rows  # the sleeping jobs that ended, cancelled or not
    generator.check_invariant()


def test_a_plain_greedy_verify_step_keeps_drafts_while_they_are_the_argmax(engine_parts):
    """A verify step of plain greedy jobs (the argmax of every row, no row list built) cuts
    each run where `accept_run` does over the rows' argmaxes; a job whose row has no finite
    logit fails alone, as in the general path, and the others keep their runs."""
    from dyngen_core.engine.record import JobRecord
    from dyngen_core.sampling.step import StepSampler

    vocab = 64
    rng = random.Random(3)
    torch.manual_seed(3)
    records, blocks = [], []
    for i in range(12):
        job = Job(input_ids=[1, 2], max_new_tokens=8)
        job.job_id = i
        drafts = [rng.randrange(vocab) for _ in range(rng.randrange(0, 4))]
        block = torch.randn(1 + len(drafts), vocab)
        for j, token in enumerate(drafts):  # the first drafts are the argmax, then not
            if j < len(drafts) // 2 + 1 and rng.random() < 0.8:
                block[j, token] = 10.0
        records.append(JobRecord(job=job, stream=_Stream(), settings=SamplerSettings.greedy(),
                                 seed=i, draft_ids=drafts))
        blocks.append(block)
    assert all(r.plain_greedy for r in records)
    sampler = StepSampler(vocab, torch.device("cpu"), engine_parts[1], [])
    step = sampler.start(torch.cat(blocks), records, verify=True)
    expected = [accept_run(r.draft_ids, block.argmax(-1).tolist())
                for r, block in zip(records, blocks, strict=True)]
    assert step.runs == expected and not step.failed
    assert any(len(run) > 1 for run in expected) and any(len(run) == 1 for run in expected)
    blocks[4][-1] = float("-inf")  # job 4 cannot be sampled: it fails alone
    step = sampler.start(torch.cat(blocks), records, verify=True)
    assert set(step.failed) == {4}
    assert [run for i, run in enumerate(step.runs) if i != 4] == expected[:4] + expected[5:]


def test_plain_greedy_verify_steps_then_a_mixed_batch_keep_output(make_generator, speculative,
                                                                  engine_parts):
    """Plain greedy jobs verify alone first (each row's argmax: no row list), then the mixed
    jobs (constrained, sampled, banned, penalties) join the running batch, a greedy job is
    cancelled in the middle, and the greedy jobs verify alone again once the mixed ones end:
    every other job's output is plain decoding's, through steps of both verify paths (a fast
    path that cut runs wrongly fails here)."""
    model, tokenizer = engine_parts
    repeat = tokenizer.encode(REPEAT)

    def run(generator: DynamicGenerator) -> dict[Any, dict[str, Any]]:
        first = [Job(input_ids=repeat[i:], max_new_tokens=60, stop_conditions=[],
                     gen_settings=SamplerSettings.greedy(), identifier=f"greedy-{i}")
                 for i in range(3)]
        later = _mix(tokenizer)
        out: dict[Any, dict[str, Any]] = {j.identifier: {"tokens": []} for j in first + later}
        generator.enqueue(first)
        for step in range(800):
            if step == 8:  # the greedy jobs have verified alone; the mixed jobs end first
                generator.enqueue(later)
            if step == 10:
                generator.cancel(first[1])
            for r in generator.iterate():
                out[r["identifier"]]["tokens"].extend(r.get("token_ids", []))
                if r["eos"]:
                    out[r["identifier"]]["final"] = r
            if step > 10 and not generator.num_remaining_jobs():
                return out
        raise AssertionError("jobs still running after 800 steps")

    plain = run(make_generator())
    generator = speculative("ngram")
    drafted = run(generator)
    assert drafted["greedy-1"]["final"]["eos_reason"] == "cancelled"
    for name, got in drafted.items():
        if name == "greedy-1":
            continue
        assert got["final"]["eos_reason"] != "error", got["final"]
        prompt = got["final"]["job"].input_ids
        assert_same_output(plain[name], got, model, list(prompt), name)
    assert generator.stats().draft_tokens_accepted > 0


@pytest.mark.parametrize("drafter", ["ngram", "oracle"])
def test_a_job_that_fills_the_whole_cache_still_drafts(speculative, engine_parts, drafter):
    """Drafts never run past max_new_tokens, so they need no room the job does not: a job of
    exactly the cache's size passes `validate` and `enqueue` with a drafter (enqueue used to
    refuse it, after validate, and so `submit`, had accepted it), drafts to its end, and a
    second such job waits for the pages and runs after it."""
    model, tokenizer = engine_parts
    generator = speculative(drafter, cache_tokens=256)
    prompt = (tokenizer.encode(REPEAT) * 40)[:244]

    def job(name: str) -> Job:
        return Job(input_ids=prompt, max_new_tokens=12, stop_conditions=[],
                   gen_settings=SamplerSettings.greedy(), identifier=name)

    jobs = [job("first"), job("second")]
    for made in jobs:
        generator.validate(made)
    got = run_tokens(generator, jobs)
    plain = run_tokens(make_plain(engine_parts), [job("first")])
    for name in ("first", "second"):
        final = got[name]["final"]
        assert final["eos_reason"] == "max_new_tokens" and final["new_tokens"] == 12, final
        assert_same_output(plain["first"], got[name], model, prompt, (drafter, name))
    drafted = sum(got[n]["final"]["accepted_draft_tokens"]
                  + got[n]["final"]["rejected_draft_tokens"] for n in got)
    # The oracle drafts every step up to the cache's last slot; n-gram lookups find no match
    # in this random model's output, and only show the job is taken.
    assert drafted > 0 or drafter == "ngram"
    generator.check_invariant()


def make_plain(engine_parts: tuple[Model, Tokenizer]) -> DynamicGenerator:
    model, tokenizer = engine_parts
    return DynamicGenerator(model=model, cache=Cache(model, max_tokens=256), tokenizer=tokenizer)


@pytest.mark.parametrize("dedup", [True, False])
def test_a_prompt_cache_hit_leaves_the_draft_cache_whole(speculative, engine_parts, dedup):
    """A prompt of one full page run twice: the second time its page comes from the prompt
    cache (a copy of all slots but the last, without dedup) and its last token is recomputed
    alone, as a one-token sampling slice. The draft model must write that token's keys too:
    with the target as its own draft model every draft is then accepted, the second time as
    the first (with the slot missing, the second run without dedup had 5 drafts rejected)."""
    model, tokenizer = engine_parts
    generator = speculative("oracle", dedup=dedup, overlap_steps=False)
    prompt = [(37 * i) % 480 + 10 for i in range(256)]

    def job(name: str) -> Job:
        return Job(input_ids=prompt, max_new_tokens=24, stop_conditions=[],
                   gen_settings=SamplerSettings.greedy(), identifier=name)

    first = run_tokens(generator, [job("first")])["first"]
    again = run_tokens(generator, [job("again")])["again"]
    # A third time among other traffic (prompts of their own): a seeded sampled job, a
    # constrained one, and one cancelled while it runs.
    own = [(53 * i) % 470 + 20 for i in range(60)]
    others = [Job(input_ids=own[:40], max_new_tokens=12, stop_conditions=[], seed=3,
                  gen_settings=SamplerSettings(temperature=0.9), identifier="sampled"),
              Job(input_ids=own[10:40], max_new_tokens=8, identifier="choice",
                  gen_settings=SamplerSettings.greedy(), constraint=["yes", "no"]),
              Job(input_ids=own[5:55], max_new_tokens=40, stop_conditions=[],
                  gen_settings=SamplerSettings.greedy(), identifier="cancelled")]
    mixed = run_tokens(generator, [job("mixed"), *others], cancel=("cancelled", 3))
    for one in (again, mixed["mixed"]):
        assert one["final"]["cached_tokens"] > 0
        assert one["tokens"] == first["tokens"]
    for one in (first, again, mixed["mixed"]):
        assert one["final"]["accepted_draft_tokens"] > 0
        assert one["final"]["rejected_draft_tokens"] == 0, one["final"]
    assert mixed["cancelled"]["final"]["eos_reason"] == "cancelled"
    assert mixed["choice"]["final"]["full_completion"] in ("yes", "no")
    assert mixed["sampled"]["final"]["new_tokens"] == 12
    generator.check_invariant()
