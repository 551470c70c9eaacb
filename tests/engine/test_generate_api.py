"""The blocking generate() convenience, argument by argument."""

from __future__ import annotations

import pytest

from dyngen_core import Job, SamplerSettings
from dyngen_core.errors import JobError

GREEDY = SamplerSettings.greedy()


def test_str_gives_str_and_list_gives_list_in_order(make_generator):
    generator = make_generator()
    prompts = ["the cat", "a dog ran over the hill", "x"]
    one_by_one = [generator.generate(p, max_new_tokens=6, gen_settings=GREEDY, stop_conditions=[])
                  for p in prompts]
    assert all(isinstance(t, str) for t in one_by_one)
    together = generator.generate(prompts, max_new_tokens=6, gen_settings=GREEDY,
                                  stop_conditions=[])
    assert together == one_by_one


def test_gen_settings_per_prompt_and_wrong_length(make_generator):
    generator = make_generator()
    out = generator.generate(["a", "b"], max_new_tokens=3,
                             gen_settings=[GREEDY, SamplerSettings(temperature=0.8)])
    assert len(out) == 2
    with pytest.raises(JobError, match="3 entries for 2 prompts"):
        generator.generate(["a", "b"], max_new_tokens=3, gen_settings=[GREEDY] * 3)


def test_bare_string_stop_condition_is_type_error(make_generator):
    with pytest.raises(TypeError, match="not a bare string"):
        make_generator().generate("a", max_new_tokens=3, stop_conditions="\n")


def test_stop_string_is_cut_and_reported(make_generator):
    generator = make_generator()
    # A random model's text can be short (special tokens decode to nothing): pick a prompt
    # whose greedy continuation has some text to cut.
    for prompt in ("once upon", "the dog", "hello world", "a b c d", "x y"):
        free = generator.generate(prompt, max_new_tokens=24, gen_settings=GREEDY,
                                  stop_conditions=[])
        if len(free) >= 8:
            break
    stop = free[5:8]
    assert stop and stop in free
    text, last = generator.generate(prompt, max_new_tokens=24, gen_settings=GREEDY,
                                    stop_conditions=[stop], return_last_results=True)
    assert text == free[: free.index(stop)]
    assert last["eos_reason"] == "stop_string"


def test_stop_token_never_appears_and_min_new_tokens(make_generator):
    generator = make_generator()
    job = Job(input_ids=generator.tokenizer.encode("hello there"), max_new_tokens=10,
              stop_conditions=[], gen_settings=GREEDY)
    generator.enqueue(job)
    while generator.num_remaining_jobs():
        generator.iterate()
    first = job.new_token_ids[2]
    text, last = generator.generate("hello there", max_new_tokens=10, gen_settings=GREEDY,
                                    stop_conditions=[first], return_last_results=True)
    assert last["eos_reason"] == "stop_token"
    assert last["new_tokens"] <= 3
    text_min, last_min = generator.generate("hello there", max_new_tokens=10,
                                            gen_settings=GREEDY, stop_conditions=[first],
                                            min_new_tokens=5, return_last_results=True)
    assert last_min["new_tokens"] >= 5


def test_completion_only_false_prepends_prompt(make_generator):
    generator = make_generator()
    completion = generator.generate("abc", max_new_tokens=4, gen_settings=GREEDY)
    full = generator.generate("abc", max_new_tokens=4, gen_settings=GREEDY, completion_only=False)
    assert full == "abc" + completion


def test_seed_makes_sampling_reproducible(make_generator):
    generator = make_generator()
    settings = SamplerSettings(temperature=1.5, top_k=50)
    a = generator.generate(["q"] * 4, max_new_tokens=12, gen_settings=settings, seed=7)
    b = generator.generate(["q"] * 4, max_new_tokens=12, gen_settings=settings, seed=7)
    assert a == b
    assert len(set(a)) > 1  # job i gets seed + i


def test_return_probs_top_tokens_and_logits(make_generator):
    generator = make_generator()
    vocab = generator.model.config.vocab_size
    job = Job(input_ids=[5, 6, 7], max_new_tokens=3, stop_conditions=[], gen_settings=GREEDY,
              return_probs=True, return_top_tokens=4, return_logits=True)
    generator.enqueue(job)
    streamed = []
    while generator.num_remaining_jobs():
        streamed += [r for r in generator.iterate() if r["stage"] == "streaming"]
    for r in streamed:
        assert tuple(r["top_k_tokens"].shape) == (1, 4)
        assert tuple(r["logits"].shape) == (1, vocab)
        assert r["top_k_tokens"][0, 0].item() == r["token_ids"][0]  # greedy takes the top token
        assert 0.0 < r["token_probs"][0].item() <= 1.0


def test_progress_bar_and_add_bos(make_generator):
    generator = make_generator()
    out = generator.generate(["a", "b"], max_new_tokens=2, add_bos=True, progress=True)
    assert len(out) == 2
