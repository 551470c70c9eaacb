"""Banned strings never reach the output; the job rewinds and samples something else."""

from __future__ import annotations

import re

from dyngen_core import Job, SamplerSettings


def _run(generator, jobs):
    generator.enqueue(jobs)
    texts = {j.identifier: "" for j in jobs}
    finals = {}
    while generator.num_remaining_jobs():
        for r in generator.iterate():
            texts[r["identifier"]] += r.get("text", "")
            if r["eos"]:
                finals[r["identifier"]] = r
    return texts, finals


def test_banned_strings_never_appear_over_seeded_samples(make_generator):
    generator = make_generator()
    settings = SamplerSettings(temperature=1.0)
    prompt = generator.tokenizer.encode("the quick brown fox")
    free_jobs = [Job(input_ids=prompt, max_new_tokens=24, stop_conditions=[],
                     gen_settings=settings, seed=s, identifier=s) for s in range(12)]
    free, _ = _run(generator, free_jobs)
    # Ban the most common two-character piece the model actually produces.
    counts: dict[str, int] = {}
    for text in free.values():
        for i in range(len(text) - 1):
            piece = text[i:i + 2]
            if piece.strip() and "\ufffd" not in piece:
                counts[piece] = counts.get(piece, 0) + 1
    banned = max(counts, key=counts.__getitem__)
    assert sum(banned.lower() in t.lower() for t in free.values()) >= 2
    jobs = [Job(input_ids=prompt, max_new_tokens=24, stop_conditions=[], gen_settings=settings,
                seed=s, identifier=s, banned_strings=[banned.upper()]) for s in range(12)]
    texts, finals = _run(generator, jobs)
    for s in range(12):
        assert banned.lower() not in texts[s].lower()
        assert banned.lower() not in generator.tokenizer.decode(jobs[s].new_token_ids).lower()
        assert texts[s] == finals[s]["full_completion"]
        assert finals[s]["new_tokens"] == len(jobs[s].new_token_ids)
    generator.check_invariant()


SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 8},
                   "age": {"type": "integer", "minimum": 0, "maximum": 99},
                   "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2}},
    "required": ["name", "age"],
    "additionalProperties": False,
}


def test_json_schema_constraint_always_validates(make_generator):
    import json

    import jsonschema

    generator = make_generator()
    prompt = generator.tokenizer.encode("person:")
    jobs = [Job(input_ids=prompt, max_new_tokens=80, gen_settings=SamplerSettings(temperature=1.0),
                seed=s, identifier=s, constraint=SCHEMA) for s in range(6)]
    texts, finals = _run(generator, jobs)
    for s in range(6):
        assert finals[s]["eos_reason"] == "stop_token", finals[s]
        jsonschema.validate(json.loads(texts[s]), SCHEMA)


def test_choice_and_regex_constraints(make_generator):
    import re

    generator = make_generator()
    prompt = generator.tokenizer.encode("pick:")
    choices = ["yes", "no", "maybe later"]
    jobs = [Job(input_ids=prompt, max_new_tokens=20, gen_settings=SamplerSettings(temperature=1.0),
                seed=s, identifier=s, constraint=choices) for s in range(5)]
    jobs += [Job(input_ids=prompt, max_new_tokens=20, gen_settings=SamplerSettings(temperature=1.0),
                 seed=s, identifier=10 + s, constraint=re.compile(r"[0-9]{3}-[a-c]{2}"))
             for s in range(5)]
    texts, _ = _run(generator, jobs)
    assert all(texts[s] in choices for s in range(5))
    assert all(re.fullmatch(r"[0-9]{3}-[a-c]{2}", texts[10 + s]) for s in range(5))


def test_constraint_that_cannot_finish_reports_incomplete(make_generator):
    generator = make_generator()
    job = Job(input_ids=generator.tokenizer.encode("x"), max_new_tokens=3,
              gen_settings=SamplerSettings.greedy(), constraint=re.compile(r"[a-z]{20}"))
    _, finals = _run(generator, [job])
    assert finals[None]["eos_reason"] == "constraint_incomplete"


def test_stop_strings_never_cut_what_a_constraint_writes(make_generator):
    """Stop strings that occur inside a JSON value or a choice do not end those jobs (the
    structure is always whole), in a mixture with a job whose constraint allows any text, where
    the same stop string still ends the reply, and a plain job."""
    import json

    import jsonschema

    generator = make_generator()
    prompt = generator.tokenizer.encode("person:")
    sampled = SamplerSettings(temperature=1.0)
    inside = ["name", ":", '"', "e", "y"]  # JSON keys and punctuation; in "yes" and "maybe"
    jobs = [Job(input_ids=prompt, max_new_tokens=80, gen_settings=sampled, seed=s,
                identifier=f"json{s}", constraint=SCHEMA, stop_conditions=inside)
            for s in range(4)]
    jobs += [Job(input_ids=prompt, max_new_tokens=20, gen_settings=sampled, seed=s,
                 identifier=f"choice{s}", constraint=["yes", "no", "maybe later"],
                 stop_conditions=inside) for s in range(4)]
    free = re.compile(r"[^\n]{0,60}")
    jobs.append(Job(input_ids=prompt, max_new_tokens=60, gen_settings=SamplerSettings.greedy(),
                    identifier="free", constraint=free, stop_conditions=[]))
    jobs.append(Job(input_ids=prompt, max_new_tokens=60, gen_settings=SamplerSettings.greedy(),
                    identifier="plain", stop_conditions=[]))
    texts, finals = _run(generator, jobs)
    for s in range(4):
        assert finals[f"json{s}"]["eos_reason"] == "stop_token", finals[f"json{s}"]
        jsonschema.validate(json.loads(texts[f"json{s}"]), SCHEMA)
        assert texts[f"choice{s}"] in ("yes", "no", "maybe later")
    # Where any text is a whole reply, a stop string taken from it ends the job there.
    reply = texts["free"]
    assert len(reply) > 12, reply
    stop = reply[8:11]
    cut = reply.index(stop)
    again = Job(input_ids=prompt, max_new_tokens=60, gen_settings=SamplerSettings.greedy(),
                identifier="free", constraint=free, stop_conditions=[stop])
    texts, finals = _run(generator, [again])
    assert texts["free"] == reply[:cut] and finals["free"]["eos_reason"] == "stop_string"
    generator.check_invariant()


def _streamed(generator, jobs, cancel_after: dict[str, int] | None = None):
    """Run ``jobs`` to their ends, cancelling each job named in ``cancel_after`` once it has
    streamed that many results; each job's streamed token ids, text, extra rows and final."""
    generator.enqueue(jobs)
    by_name = {job.identifier: job for job in jobs}
    ids = {name: [] for name in by_name}
    text = dict.fromkeys(by_name, "")
    rows = dict.fromkeys(by_name, 0)
    seen = dict.fromkeys(by_name, 0)
    finals = {}
    for _ in range(400):
        if not generator.num_remaining_jobs():
            break
        for r in generator.iterate():
            name = r["identifier"]
            ids[name] += r.get("token_ids", [])
            text[name] += r.get("text", "")
            probs = r.get("token_probs")
            rows[name] += 0 if probs is None else len(probs)
            seen[name] += r["stage"] == "streaming"
            if r["eos"]:
                finals[name] = r
            elif cancel_after and seen[name] == cancel_after.get(name):
                generator.cancel(by_name[name])
    return ids, text, rows, finals


def _holding_mixture(prompt: list[int]) -> list[Job]:
    """Banned-string jobs (greedy with probabilities, sampled, one to draft, one to cancel)
    beside a plain job."""
    sampled = SamplerSettings(temperature=1.0, top_p=0.95)
    greedy = SamplerSettings.greedy()
    return [
        Job(input_ids=prompt, max_new_tokens=20, stop_conditions=[], gen_settings=greedy,
            banned_strings=["e"], identifier="greedy", return_probs=True),
        Job(input_ids=prompt, max_new_tokens=20, stop_conditions=[], gen_settings=sampled,
            seed=4, banned_strings=["a", "o"], identifier="sampled"),
        Job(input_ids=prompt, max_new_tokens=20, stop_conditions=[], gen_settings=greedy,
            banned_strings=["e"], identifier="drafting"),
        Job(input_ids=prompt, max_new_tokens=12, stop_conditions=[], gen_settings=greedy,
            identifier="plain", return_probs=True),
        Job(input_ids=prompt, max_new_tokens=40, stop_conditions=[], gen_settings=greedy,
            banned_strings=["e"], identifier="cancelled"),
    ]


def test_streamed_tokens_are_never_taken_back(make_generator):
    """A banned-string rewind takes back tokens whose text was held: their ids (and extra
    outputs) are held too, so what a job streams is exactly its tokens, in a mixture with plain
    and sampled jobs, with drafts, overlapped or not, and when the job is cancelled mid-hold."""
    for overlap in (True, False):
        generator = make_generator(overlap_steps=overlap, use_ngram_draft=True)
        made = _holding_mixture(generator.tokenizer.encode("the quick brown fox"))
        ids, text, rows, finals = _streamed(generator, made, cancel_after={"cancelled": 4})
        for job in made:
            name = job.identifier
            assert ids[name] == job.new_token_ids, (overlap, name)
            assert finals[name]["new_tokens"] == len(job.new_token_ids)
            assert text[name] == finals[name]["full_completion"], (overlap, name)
            if job.return_probs:
                assert rows[name] == len(job.new_token_ids), (overlap, name)
        assert finals["cancelled"]["eos_reason"] == "cancelled"
        assert "e" not in finals["greedy"]["full_completion"].lower()
        stats = generator.stats()  # verify steps ran (their runs stream token by token)
        assert stats.draft_tokens_accepted + stats.draft_tokens_rejected > 0
        generator.check_invariant()
