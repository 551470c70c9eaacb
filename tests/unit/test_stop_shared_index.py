"""Stop matchers sharing a `StopIndexes` (which remembers the texts that pass a set of stop
strings untouched) release exactly what a matcher of their own releases."""

from __future__ import annotations

import gc
import random
import weakref

from hypothesis import given, settings
from hypothesis import strategies as st

from dyngen_core.text.stop import StopIndexes, StopMatcher

ALPHABET = "ab \nUs:r"
stops = st.lists(st.text(ALPHABET, min_size=1, max_size=4), min_size=1, max_size=3)
chunks = st.lists(st.text(ALPHABET, max_size=3), max_size=30)


def _feed(matcher: StopMatcher, pieces: list[str]) -> tuple[list[str], str | None, str]:
    out = [matcher.feed(p) for p in pieces]
    return out, matcher.matched, matcher.flush()


@settings(max_examples=300, deadline=None)
@given(stops, st.lists(chunks, min_size=1, max_size=4))
def test_shared_tables_release_what_own_tables_release(strings: list[str],
                                                       streams: list[list[str]]) -> None:
    shared = StopIndexes()
    for pieces in streams:  # later streams run on a table earlier ones filled
        alone = _feed(StopMatcher(strings), pieces)
        assert _feed(StopMatcher(strings, indexes=shared), pieces) == alone


def test_matchers_of_the_same_strings_share_one_table_and_learn_passing_texts() -> None:
    shared = StopIndexes()
    first = StopMatcher(["\n\nUser:"], indexes=shared)
    second = StopMatcher(["\n\nUser:"], indexes=shared)
    other = StopMatcher(["</s>"], indexes=shared)
    assert shared.get(("\n\nUser:",)) is shared.get(("\n\nUser:",))
    assert first.feed(" hello") == " hello"
    assert " hello" in shared.get(("\n\nUser:",)).passes
    assert " hello" not in shared.get(("</s>",)).passes
    assert second.feed(" hello") == " hello"
    assert second.feed(" there\n") == " there"  # held: may start "\n\nUser:"
    assert " there\n" not in shared.get(("\n\nUser:",)).passes
    assert second.feed("\nUser: hi") == "" and second.matched == "\n\nUser:"
    assert other.feed(" hello") == " hello"


def test_tables_live_while_used_and_a_few_idle_ones_are_kept() -> None:
    shared = StopIndexes(keep=2)
    in_use = StopMatcher(["s0"], indexes=shared)
    table = weakref.ref(shared.get(("s0",)))
    for i in range(1, 10):  # jobs with other strings come and go
        StopMatcher([f"s{i}"], indexes=shared)
    gc.collect()
    assert len(shared) == 3  # s0 in use, s8 and s9 the two idle ones kept
    assert shared.get(("s0",)) is table()  # in use: still shared
    del in_use
    for i in range(10, 12):
        StopMatcher([f"s{i}"], indexes=shared)
    gc.collect()
    assert len(shared) == 2
    assert table() is None  # idle and pushed out: dropped
    rng = random.Random(0)
    text = "".join(rng.choice("s0 ") for _ in range(50))
    assert StopMatcher(["s0"], indexes=shared).feed_text(text) == \
        StopMatcher(["s0"]).feed_text(text)
