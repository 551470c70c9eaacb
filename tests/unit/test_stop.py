"""StopMatcher and BannedStringMatcher: held-back text, cuts at matches, offsets, no text lost."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dyngen_core.errors import JobError
from dyngen_core.text.stop import BannedStringMatcher, StopMatcher, StopResult


def feed_all(matcher: StopMatcher, chunks: list[str]) -> tuple[list[str], str | None]:
    out, matched = [], None
    for chunk in chunks:
        result = matcher.feed_text(chunk)
        out.append(result.text)
        if result.stop_string is not None:
            matched = result.stop_string
            break
    else:
        out.append(matcher.flush())
    return out, matched


def test_partial_match_is_held_then_cut_at_the_full_match() -> None:
    matcher = StopMatcher(["</answer>"])
    assert matcher.feed_text("The answer is 4") == StopResult("The answer is 4", None)
    assert matcher.feed_text(".</ans") == StopResult(".", None)
    assert matcher.held_text == "</ans"
    assert matcher.feed_text("wer> and more") == StopResult("", "</answer>")
    assert matcher.flush() == ""  # the stop string and what follows are never emitted
    assert matcher.feed_text("later") == StopResult("", "</answer>")


def test_stop_string_spanning_many_chunks() -> None:
    chunks = ["Hello", "\n", "User", ":", " hi"]
    out, matched = feed_all(StopMatcher(["\nUser:"]), chunks)
    assert matched == "\nUser:" and "".join(out) == "Hello"
    assert out[:4] == ["Hello", "", "", ""]


def test_false_partial_match_is_released() -> None:
    matcher = StopMatcher(["\n\n"])
    assert matcher.feed_text("line one\n") == StopResult("line one", None)
    assert matcher.feed_text("line two") == StopResult("\nline two", None)
    assert matcher.feed_text("\n") == StopResult("", None)
    assert matcher.flush() == "\n"


def test_first_stop_string_to_complete_wins() -> None:
    matcher = StopMatcher(["STOP", "ab"])
    assert matcher.feed_text("xxabSTOP") == StopResult("xx", "ab")
    tie = StopMatcher(["bc", "abc"])  # both end at the same character: the longer wins
    assert tie.feed_text("zabc") == StopResult("z", "abc")
    # "\n" completes before "a\na" does, whether the text comes at once or char by char.
    assert StopMatcher(["a\na", "\n"]).feed_text("a\na") == StopResult("a", "\n")
    assert feed_all(StopMatcher(["a\na", "\n"]), list("a\na")) == (["", "a"], "\n")


def test_match_inside_one_chunk_and_no_stop_strings() -> None:
    assert StopMatcher(["\n"]).feed_text("a\nb") == StopResult("a", "\n")
    assert StopMatcher([]).feed_text("anything") == StopResult("anything", None)


def test_empty_stop_string_is_refused() -> None:
    with pytest.raises(JobError, match="non-empty"):
        StopMatcher(["ok", ""])


STOPS = st.lists(st.text(alphabet="ab\n", min_size=1, max_size=4), min_size=1, max_size=3)
TEXT = st.text(alphabet="abc\n", max_size=40)


def cut_points(text: str) -> st.SearchStrategy[list[int]]:
    return st.lists(st.integers(0, len(text)), max_size=8).map(sorted)


def chunked(text: str, cuts: list[int]) -> list[str]:
    bounds = [0, *cuts, len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]


def first_completed(text: str, strings: list[str]) -> tuple[int, str] | None:
    """Reference: read ``text`` one character at a time; the first strings to end win, the
    longest of them first."""
    for end in range(1, len(text) + 1):
        done = sorted((s for s in strings if text[:end].endswith(s)), key=len, reverse=True)
        if done:
            return end - len(done[0]), done[0]
    return None


@settings(max_examples=300, deadline=None)
@given(data=st.data(), stops=STOPS, text=TEXT)
def test_stop_output_is_text_up_to_the_first_stop_string(
    data: st.DataObject, stops: list[str], text: str
) -> None:
    chunks = chunked(text, data.draw(cut_points(text)))
    out, matched = feed_all(StopMatcher(stops), chunks)
    first = first_completed(text, stops)
    if first is not None:
        assert matched == first[1] and "".join(out) == text[: first[0]]
    else:
        assert matched is None and "".join(out) == text


def test_banned_find_is_case_insensitive_with_offsets() -> None:
    banned = BannedStringMatcher(["Badword", "ÉCOLE"])
    assert banned.find("this has a BADWORD in it") == 11
    assert banned.find("une école") == 4
    assert banned.find("clean text") is None


def test_banned_safe_prefix_holds_partial_matches() -> None:
    banned = BannedStringMatcher(["secret"])
    assert banned.safe_prefix_length("the SEC") == 4
    assert banned.safe_prefix_length("the sector") == len("the sector")
    assert banned.safe_prefix_length("a Secret b") == 2


def test_banned_offsets_survive_characters_that_lower_to_two() -> None:
    # "İ".lower() is two characters; offsets must still index the original text.
    banned = BannedStringMatcher(["bad"])
    assert banned.find("İİ bad") == 3
