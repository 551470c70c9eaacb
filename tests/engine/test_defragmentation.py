"""Defragmentation in the middle of generation: every running job's pages are relabelled and
copied (chains and cycles, all at once: `kv.storage.resolve_copies`) between two steps, and
every job's output is the one it gives without it, in fp16 and quantized caches, among greedy,
sampled and constrained jobs, a cancel and a failing row."""

from __future__ import annotations

import math
import random
import re
from typing import Any

import pytest

from dyngen_core import Cache, DynamicGenerator, Job, Model, SamplerSettings, Tokenizer
from dyngen_core.engine import scheduler as scheduler_module
from dyngen_core.engine.defrag import plan_defrag
from tests.engine.step_helpers import kill_row
from tests.tiny_models import load_quantizable_model

GREEDY = SamplerSettings.greedy()
SAMPLED = SamplerSettings(temperature=0.9, top_p=0.9)


@pytest.fixture(scope="module")
def parts(tmp_path_factory: pytest.TempPathFactory) -> tuple[Model, Tokenizer]:
    return load_quantizable_model(tmp_path_factory.mktemp("defrag"))


def jobs() -> list[Job]:
    """Jobs of one to three pages, greedy and sampled (a seed each), a shared start for two, a
    regex-constrained one and one `run` cancels."""
    rng = random.Random(3)
    shared = [rng.randrange(10, 500) for _ in range(256)]
    prompts = [[rng.randrange(10, 500) for _ in range(n)] for n in (600, 30, 300, 520)]
    prompts += [shared + [7, 8, 9], shared + [10, 11]]
    made = [Job(input_ids=p, max_new_tokens=10, stop_conditions=[], seed=i,
                gen_settings=GREEDY if i % 2 else SAMPLED, identifier=i)
            for i, p in enumerate(prompts)]
    made.append(Job(input_ids=prompts[2][:270], max_new_tokens=10, gen_settings=GREEDY,
                    constraint=re.compile(r"[0-9]{3}-[a-c]{2}"), identifier="constrained"))
    made.append(Job(input_ids=prompts[0][:280], max_new_tokens=40, stop_conditions=[],
                    gen_settings=GREEDY, identifier=CANCELLED))
    return made


CANCELLED = "cancelled"
# The forward (counted from the first step of `run`) whose first logits row is NaN, failing
# that row's job.
FAULT_STEP = 5


def run(generator: DynamicGenerator, defrag_at: int | None
        ) -> tuple[dict[Any, tuple[str, str]], int]:
    """Every job's end reason and completion, and the page copies a forced defragmentation
    queued after step ``defrag_at`` (None: none). The job `CANCELLED` is cancelled after step
    2; one row fails at forward `FAULT_STEP`."""
    kill_row(generator, FAULT_STEP, 0, math.nan)
    queued = jobs()
    generator.enqueue(queued)
    finals: dict[Any, tuple[str, str]] = {}
    step = copies = 0
    while generator.num_remaining_jobs():
        for result in generator.iterate():
            if result["eos"]:
                finals[result["identifier"]] = (result["eos_reason"],
                                                result.get("full_completion", ""))
        step += 1
        if step == 2:
            generator.cancel(queued[-1])
        if step == defrag_at:
            copies = generator._scheduler.defragment()
    return finals, copies


@pytest.mark.parametrize("mode", ["fp16", "q8", "q4"])
def test_outputs_do_not_change_when_pages_move_mid_run(parts, monkeypatch, mode: str) -> None:
    model, tokenizer = parts

    def generator() -> DynamicGenerator:
        cache = Cache(model, max_tokens=8192, mode=mode)
        return DynamicGenerator(model=model, cache=cache, tokenizer=tokenizer)

    expected, _ = run(generator(), None)

    def every_page(*args: Any, **kwargs: Any) -> Any:  # any layout, however little it gains
        return plan_defrag(*args, **{**kwargs, "min_fraction": 0.0, "max_moves": 10_000})

    monkeypatch.setattr(scheduler_module, "plan_defrag", every_page)
    moved = generator()
    # Fragment the pool first: a finished job leaves cached pages below the next jobs' pages.
    moved.enqueue([Job(input_ids=[10 + i % 400 for i in range(600)], max_new_tokens=2,
                       identifier="first")])
    while moved.num_remaining_jobs():
        moved.iterate()
    finals, copies = run(moved, defrag_at=3)
    assert copies > 0
    assert finals == expected
    reasons = [reason for reason, _ in finals.values()]
    assert finals[CANCELLED][0] == "cancelled" and "error" in reasons
    assert finals["constrained"][0] != "error"
    moved.check_invariant()
