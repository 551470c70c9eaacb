"""A finished job's text state (its stop-string tables, detokenizer, matchers) does not outlive
it in the generator beyond a small bounded cache."""

from __future__ import annotations

import gc
import tracemalloc

from dyngen_core import Job
from tests.unit.test_stop_memory import _long_string


def test_jobs_with_long_stop_strings_leave_bounded_memory(make_generator) -> None:
    generator = make_generator()
    prompt = generator.tokenizer.encode("the quick brown fox")

    def run(salts: range) -> None:
        for salt in salts:
            generator.enqueue(Job(input_ids=prompt, max_new_tokens=3, identifier=salt,
                                  stop_conditions=[_long_string(2000, salt)]))
        while generator.num_remaining_jobs():
            generator.iterate()

    run(range(2))  # warm up what every run builds once
    gc.collect()
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        run(range(2, 42))
        gc.collect()
        retained = tracemalloc.get_traced_memory()[0] - base
    finally:
        tracemalloc.stop()
    # 40 jobs whose stop tables each took 2 MB when they listed every prefix.
    assert retained < 3_000_000
