"""Mixed steps: constrained, plain, banned-string and sampled jobs sampled together give what
each gives alone (a job's options never change another job's output)."""

from __future__ import annotations

from typing import Any

import pytest

from dyngen_core import Job, SamplerSettings
from tests.engine.step_helpers import run_to_finals

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 6},
                   "age": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["name", "age"],
    "additionalProperties": False,
}


def _jobs(tokenizer: Any) -> list[Job]:
    """One job of each kind, built fresh (a Job runs once)."""
    prompt = tokenizer.encode("the quick brown fox")
    sampled = SamplerSettings(temperature=1.0, top_p=0.9)
    greedy = SamplerSettings.greedy()
    return [
        Job(input_ids=prompt, max_new_tokens=12, stop_conditions=[], gen_settings=greedy,
            identifier="plain"),
        Job(input_ids=prompt, max_new_tokens=40, gen_settings=sampled, seed=7,
            identifier="json", constraint=SCHEMA),
        Job(input_ids=prompt, max_new_tokens=12, stop_conditions=[], gen_settings=sampled,
            seed=3, identifier="sampled"),
        Job(input_ids=prompt, max_new_tokens=12, stop_conditions=[], gen_settings=greedy,
            identifier="banned", banned_strings=["e"]),
        Job(input_ids=prompt, max_new_tokens=8, gen_settings=sampled, seed=5,
            identifier="choice", constraint=["yes", "no", "maybe later"]),
        Job(input_ids=prompt, max_new_tokens=12, min_new_tokens=4, gen_settings=sampled,
            seed=11, identifier="min_tokens"),
    ]


@pytest.mark.parametrize("overlap_steps", [True, False])
def test_constrained_job_beside_plain_jobs_leaves_them_unharmed(make_generator, overlap_steps):
    generator = make_generator(overlap_steps=overlap_steps)
    alone = {}
    for job in _jobs(generator.tokenizer):
        alone.update(run_to_finals(generator, [job]))
    together = run_to_finals(generator, _jobs(generator.tokenizer))
    for name, final in together.items():
        assert final["eos_reason"] != "error", (name, final.get("error"))
        assert final["full_completion"] == alone[name]["full_completion"], name
        assert final["eos_reason"] == alone[name]["eos_reason"], name
    assert "e" not in together["banned"]["full_completion"].lower()
    assert together["choice"]["full_completion"] in ("yes", "no", "maybe later")
