"""The generator's page machinery in every cache mode: dedup, prompt cache, preemption, cancel.

Structural checks (pages, invariant, prefill counts) are exact in every mode; text checks are
exact for fp16 and q8 and only structural for q6/q4, whose rounding may flip a greedy choice.
"""

from __future__ import annotations

import random

import pytest

from dyngen_core import Cache, DynamicGenerator, Job, Model, SamplerSettings, Tokenizer
from tests.tiny_models import load_quantizable_model

GREEDY = SamplerSettings.greedy()
MODES = ("fp16", "q8", "q6", "q4")


@pytest.fixture(scope="module")
def model_and_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> tuple[Model, Tokenizer]:
    return load_quantizable_model(tmp_path_factory.mktemp("modes"))


def _generator(parts, mode: str, cache_tokens: int, recent_window=None,
               **options) -> DynamicGenerator:
    model, tokenizer = parts
    cache = Cache(model, max_tokens=cache_tokens, mode=mode, recent_window=recent_window)
    return DynamicGenerator(model=model, cache=cache, tokenizer=tokenizer, **options)


def _ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 500) for _ in range(n)]


def _run(generator, prompts, new=6):
    jobs = [Job(input_ids=p, max_new_tokens=new, stop_conditions=[], gen_settings=GREEDY,
                identifier=i) for i, p in enumerate(prompts)]
    generator.enqueue(jobs)
    finals = {}
    while generator.num_remaining_jobs():
        for r in generator.iterate():
            if r["eos"]:
                finals[r["identifier"]] = r
    generator.check_invariant()
    return [j.new_token_ids for j in jobs], finals


@pytest.mark.parametrize("mode", MODES)
def test_dedup_and_prompt_cache_in_every_mode(model_and_tokenizer, mode):
    generator = _generator(model_and_tokenizer, mode, 8192)
    prefix = _ids(512, seed=1)
    prompts = [prefix + _ids(20, seed=10 + i) for i in range(4)]
    first, _ = _run(generator, prompts)
    stats = generator.stats()
    assert stats.prefill_tokens_computed <= 512 + 4 * 21  # the prefix once
    again, finals = _run(generator, prompts)
    assert all(f["cached_tokens"] >= 512 for f in finals.values())
    if mode in ("fp16", "q8"):
        # q6/q4 read a job's own recent rows unquantized (storage.recent), which a cached
        # prefix does not bring along: the suffix's first queries read those keys quantized.
        assert again == first  # same cache contents, same greedy choices
    assert generator.stats().pages_referenced == 0


@pytest.mark.parametrize("mode", ["q6", "q4"])
def test_without_a_window_a_cached_prefix_changes_nothing(model_and_tokenizer, mode):
    """What q6/q4 give up for their recent window: with it off, a prompt-cache hit gives the
    same greedy text as computing the prefix, as fp16 and q8 always do."""
    generator = _generator(model_and_tokenizer, mode, 8192, recent_window=0)
    prompts = [_ids(512, seed=1) + _ids(20, seed=10 + i) for i in range(4)]
    first, _ = _run(generator, prompts)
    again, finals = _run(generator, prompts)
    assert all(f["cached_tokens"] >= 512 for f in finals.values())
    assert again == first


@pytest.mark.parametrize("mode", MODES)
def test_preemption_and_cancel_in_every_mode(model_and_tokenizer, mode):
    prompts = [_ids(245, seed=20 + i) for i in range(5)]
    roomy, _ = _run(_generator(model_and_tokenizer, mode, 8192, prompt_cache=False), prompts,
                    new=16)
    tight = _generator(model_and_tokenizer, mode, 1024)
    squeezed, finals = _run(tight, prompts, new=16)
    assert all(f["new_tokens"] == 16 for f in finals.values())
    if mode in ("fp16", "q8"):
        assert squeezed == roomy
    cancelled = Job(input_ids=_ids(300, seed=30), max_new_tokens=50, stop_conditions=[])
    tight.enqueue(cancelled)
    for _ in range(3):
        tight.iterate()
    tight.cancel(cancelled)
    tight.iterate()
    tight.check_invariant()
    assert tight.stats().pages_referenced == 0


def _mixture(tokenizer, shared: list[int]) -> list[Job]:
    """Plain, sampled and constrained jobs over one shared document, and one to cancel."""
    sampled = SamplerSettings(temperature=1.0, top_p=0.9)
    return [
        Job(input_ids=shared + _ids(20, seed=41), max_new_tokens=12, stop_conditions=[],
            gen_settings=GREEDY, identifier="plain"),
        Job(input_ids=shared + _ids(33, seed=42), max_new_tokens=12, stop_conditions=[],
            gen_settings=sampled, seed=3, identifier="sampled"),
        Job(input_ids=shared + _ids(9, seed=43), max_new_tokens=8, gen_settings=sampled,
            seed=5, identifier="choice", constraint=["yes", "no", "maybe later"]),
        Job(input_ids=shared + _ids(50, seed=44), max_new_tokens=12, stop_conditions=[],
            gen_settings=GREEDY, identifier="broken"),
        Job(input_ids=shared + _ids(70, seed=45), max_new_tokens=40, stop_conditions=[],
            gen_settings=sampled, seed=9, identifier="cancelled"),
    ]


@pytest.mark.parametrize("mode", MODES)
def test_mixed_jobs_over_a_shared_document_in_every_mode(model_and_tokenizer, mode):
    """Constrained, plain and sampled jobs sharing a 300-token document (a page and a partial
    page deduplicated), a text-pipeline fault in one job and a cancel in another, in one
    generator per mode: the fault and the cancel end those jobs alone, the others finish as
    asked (the plain job exactly as alone where the mode is cache-invariant), and no page is
    lost or leaked."""
    check_mixture(model_and_tokenizer, mode)


def check_mixture(parts, mode: str, **options) -> None:
    """The mixture of `test_mixed_jobs_over_a_shared_document_in_every_mode` on ``parts``
    (a model and its tokenizer) in ``mode``, each generator built with ``options``."""
    _, tokenizer = parts
    shared = _ids(300, seed=40)
    alone = _generator(parts, mode, 8192, **options)
    alone_plain, _ = _run(alone, [_mixture(tokenizer, shared)[0].input_ids], new=12)
    generator = _generator(parts, mode, 8192, **options)
    jobs = _mixture(tokenizer, shared)
    generator.enqueue(jobs)
    stream = generator._records[jobs[3].job_id].stream
    advance, calls = stream.advance, [0]

    def broken(token_id: int):
        calls[0] += 1
        if calls[0] == 3:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "a broken detokenizer")
        return advance(token_id)

    stream.advance = broken
    finals = {}
    for step in range(300):
        if not generator.num_remaining_jobs():
            break
        if step == 4:
            generator.cancel(jobs[4])
        for r in generator.iterate():
            if r["eos"]:
                finals[r["identifier"]] = r
    assert set(finals) == {"plain", "sampled", "choice", "broken", "cancelled"}
    assert finals["cancelled"]["eos_reason"] == "cancelled"
    assert finals["cancelled"]["new_tokens"] < 40
    assert finals["broken"]["eos_reason"] == "error"
    for name in ("plain", "sampled", "choice"):
        assert finals[name]["eos_reason"] != "error", (name, finals[name].get("error"))
    assert finals["choice"]["full_completion"] in ("yes", "no", "maybe later")
    assert finals["plain"]["new_tokens"] == finals["sampled"]["new_tokens"] == 12
    assert finals["sampled"]["cached_tokens"] >= 256  # the document's full page, shared
    if mode in ("fp16", "q8"):
        assert jobs[0].new_token_ids == alone_plain[0]
    generator.check_invariant()
    assert generator.stats().pages_referenced == 0
