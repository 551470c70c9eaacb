"""`StopMatcher.shortest` / `.end_chars`: the texts `JobStream.advance` lets pass the stop
strings without a look-up (shorter than every stop string, empty or ending in a character that
ends no proper prefix of one) are exactly texts that `feed` releases unchanged, holding nothing,
and a stream that takes that path releases what the general path releases."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from dyngen_core.text.stop import StopMatcher

ALPHABET = "ab \nUs:r"


@settings(max_examples=400, deadline=None)
@given(stops=st.lists(st.text(ALPHABET, min_size=1, max_size=6), min_size=1, max_size=3),
       text=st.text(ALPHABET, max_size=6))
def test_quick_pass_texts_pass_feed_unchanged(stops: list[str], text: str) -> None:
    matcher = StopMatcher(stops)
    quick = not text or (len(text) < matcher.shortest and text[-1] not in matcher.end_chars)
    released = matcher.feed(text)
    if quick:
        assert released == text and matcher.held_text == "" and matcher.matched is None


def test_quick_pass_tables() -> None:
    matcher = StopMatcher(["t1 t2 t3", "\n\nUser:"])
    assert matcher.shortest == 7
    assert matcher.end_chars == frozenset("t1 2\nUser")
    assert StopMatcher([]).shortest == 0
