"""Stop and banned matchers cost memory linear in their strings' length, and what a shared
`StopIndexes` keeps after its jobs end is bounded."""

from __future__ import annotations

import gc
import tracemalloc
from collections.abc import Callable

from dyngen_core.text.stop import IDLE_TABLES_KEPT, BannedStringMatcher, StopIndexes, StopMatcher

LONG = 12_000


def _long_string(length: int, salt: int = 0) -> str:
    """A string whose prefixes are all different (no short period)."""
    return "".join(chr(0x41 + (i * 7919 + salt) % 50) for i in range(length))


def _peak_bytes(build: Callable[[], object]) -> int:
    gc.collect()
    tracemalloc.start()
    try:
        kept = build()
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    del kept
    return peak


def test_a_long_stop_or_banned_string_costs_memory_linear_in_its_length() -> None:
    stop = _long_string(LONG)
    # The string itself is 12 kB; an index listing its prefixes would need 72 MB.
    assert _peak_bytes(lambda: StopMatcher([stop])) < 1_000_000
    assert _peak_bytes(lambda: BannedStringMatcher([stop])) < 1_000_000


def test_a_long_stop_string_still_matches_across_any_chunks() -> None:
    stop = _long_string(LONG)
    matcher = StopMatcher([stop])
    text = "before " + stop[:-1]
    released = "".join(matcher.feed(text[i:i + 7]) for i in range(0, len(text), 7))
    assert released == "before " and matcher.held_text == stop[:-1]
    assert matcher.feed(stop[-1] + " after") == "" and matcher.matched == stop
    banned = BannedStringMatcher([stop])
    assert banned.safe_prefix_length(text) == len("before ")
    assert banned.find(text + stop[-1].lower()) == len("before ")


def test_ended_jobs_leave_a_bounded_number_of_shared_tables() -> None:
    shared = StopIndexes()
    gc.collect()
    tracemalloc.start()
    try:
        for job in range(40):  # each job's matcher ends when the job does
            matcher = StopMatcher([_long_string(2000, salt=job)], indexes=shared)
            matcher.feed("some text")
            del matcher
        gc.collect()
        retained = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    assert len(shared) == IDLE_TABLES_KEPT
    assert retained < 2_000_000  # 16 tables of a 2 kB string (each had 2 MB of prefixes)
