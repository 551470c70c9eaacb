"""When a job's text must end or be taken back: stop strings and banned strings.

`StopMatcher` ends a job on a stop string. Text that could be the start of a stop string is held
back until it is known not to be one, and a matched stop string (with everything after it) is
never emitted. `BannedStringMatcher` finds banned strings, case-insensitively, and tells how much
of a text no banned string can reach, so the caller holds back the rest and can rewind to where
one began and sample something else. Pure Python: no torch.
"""

from __future__ import annotations

import re
import weakref
from bisect import bisect_right
from collections import OrderedDict
from collections.abc import Iterable
from typing import NamedTuple

from dyngen_core.errors import JobError


class StopResult(NamedTuple):
    """What `StopMatcher.feed_text` releases: ``text`` is safe to emit now; ``stop_string`` is
    the stop string that matched (the job ends; nothing after ``text`` is ever emitted)."""

    text: str
    stop_string: str | None


def _checked(strings: Iterable[str], what: str) -> tuple[str, ...]:
    out = tuple(strings)
    for s in out:
        if not isinstance(s, str) or not s:
            raise JobError(f"{what} must be non-empty strings, got {s!r}")
    return out


# Most texts one stop-string table remembers as passing through (token texts, mostly).
PASSES_LIMIT = 1 << 16
# Tables of stop-string sets no matcher uses any more that `StopIndexes` keeps for later jobs.
IDLE_TABLES_KEPT = 16


class _PrefixIndex:
    """Finds the longest end of a text that is a proper prefix of one of ``strings``.

    Its size is linear in the strings' total length: prefixes are looked up in the sorted
    strings, never listed."""

    def __init__(self, strings: tuple[str, ...]) -> None:
        # Texts that, fed with nothing held, hold nothing back and contain no string: the same
        # for every matcher of these strings, so a shared index learns each token text once.
        self.passes: set[str] = set()
        self._sorted = sorted(set(strings))
        self._longest = max((len(s) - 1 for s in strings), default=0)
        # A held end ends with the last character of some proper prefix: text ending in any
        # other character holds nothing back, found without a scan (the usual token).
        self.ends = frozenset("".join(s[:-1] for s in strings))
        # No string fits in a shorter text: with an end outside ``ends`` too, it passes.
        self.shortest = min(map(len, strings), default=0)
        # A held end starts with some string's first character: only those places are tried
        # (most text has none of them near its end), found by one regex scan.
        firsts = sorted({s[0] for s in strings if len(s) > 1})
        self._starts = re.compile("|".join(map(re.escape, firsts))) if firsts else None

    def held_length(self, text: str) -> int:
        if self._starts is None or not text or text[-1] not in self.ends:
            return 0
        tail = text[-self._longest:] if len(text) > self._longest else text
        found = self._starts.search(tail)
        while found is not None:
            at = found.start()
            if self._is_proper_prefix(tail[at:]):
                return len(tail) - at
            found = self._starts.search(tail, at + 1)
        return 0

    def _is_proper_prefix(self, text: str) -> bool:
        """Whether a string longer than ``text`` starts with it. Those strings sort right
        after ``text`` itself, so the first string sorted after it decides."""
        strings = self._sorted
        after = bisect_right(strings, text)
        return after < len(strings) and strings[after].startswith(text)


class StopMatcher:
    """Stop strings of one job: strings that end it when they appear in its text.

    Read-only attributes: ``held_text``, the text held back because it may be the start of a
    stop string; ``matched``, the stop string that matched (None until one does); ``passes``,
    texts known to pass through `feed` unchanged while nothing is held (shared by matchers of
    the same strings), so a caller may skip `feed` for them; ``end_chars`` and ``shortest``:
    while nothing is held, a text shorter than ``shortest`` (the shortest stop string's length)
    that is empty or ends in a character outside ``end_chars`` (those that end a proper prefix
    of a stop string) passes `feed` unchanged too, without being looked up.
    """

    def __init__(self, stop_strings: Iterable[str] = (), *,
                 indexes: StopIndexes | None = None) -> None:
        self.stop_strings = _checked(stop_strings, "stop strings")
        self._index = (_PrefixIndex(self.stop_strings) if indexes is None
                       else indexes.get(self.stop_strings))
        self.passes: set[str] = self._index.passes
        self.end_chars: frozenset[str] = self._index.ends
        self.shortest: int = self._index.shortest
        self.held_text = ""
        self.matched: str | None = None

    def feed_text(self, text: str) -> StopResult:
        """Add newly decoded text; returns what may be emitted and the stop string if one matched.
        After a match, further text is ignored."""
        released = self.feed(text)
        return StopResult(released, self.matched)

    def feed(self, text: str) -> str:
        """`feed_text` for the generator's per-token loop: returns only the text to emit; a
        match shows in `matched`."""
        if self.matched is not None:
            return ""
        held = self.held_text
        if not held and text in self.passes:
            return text
        buffer = held + text if held else text
        for stop in self.stop_strings:
            if stop in buffer:
                at, found = _earliest(buffer, self.stop_strings)
                self.held_text = ""
                self.matched = found
                return buffer[:at]
        keep = self._index.held_length(buffer)
        if not keep:
            self.held_text = ""
            if not held and len(self.passes) < PASSES_LIMIT:
                self.passes.add(text)
            return buffer
        self.held_text = buffer[len(buffer) - keep :]
        return buffer[: len(buffer) - keep]

    def flush(self) -> str:
        """Release the held text (the job ended another way). Empty after a stop-string match."""
        held, self.held_text = self.held_text, ""
        return held


class StopIndexes:
    """The scanning tables of stop-string sets, shared by the matchers that use the same strings
    (each table learns which token texts pass through; see `StopMatcher.feed`).

    A table lives as long as a matcher uses it. Of the tables no matcher uses any more, the
    ``keep`` most recently asked for are kept for later jobs with the same strings; older ones
    are dropped. So what outlives the jobs is at most ``keep`` tables of at most `PASSES_LIMIT`
    texts each, plus their strings.
    """

    def __init__(self, keep: int = IDLE_TABLES_KEPT) -> None:
        self._keep = keep
        self._in_use: weakref.WeakValueDictionary[tuple[str, ...], _PrefixIndex] = (
            weakref.WeakValueDictionary())
        self._recent: OrderedDict[tuple[str, ...], _PrefixIndex] = OrderedDict()

    def get(self, strings: tuple[str, ...]) -> _PrefixIndex:
        """The table of ``strings``, shared with every matcher that uses it now."""
        table = self._in_use.get(strings)
        if table is None:
            table = self._in_use[strings] = _PrefixIndex(strings)
        self._recent[strings] = table
        self._recent.move_to_end(strings)
        if len(self._recent) > self._keep:
            self._recent.popitem(last=False)
        return table

    def __len__(self) -> int:
        """How many tables are alive: those in use and those kept."""
        return len(self._in_use)


def _earliest(text: str, strings: tuple[str, ...]) -> tuple[int, str | None]:
    """The first of ``strings`` to be complete in ``text`` read left to right (the earliest end;
    on a tie the longest, which starts first), and where it starts. Streaming the text in any
    chunks finds the same match."""
    best_end, best_at, best = len(text) + 1, len(text), None
    for s in strings:
        at = text.find(s, 0, best_end)
        if at == -1:
            continue
        end = at + len(s)
        if end < best_end or end == best_end and at < best_at:
            best_end, best_at, best = end, at, s
    return best_at, best


def _fold(text: str) -> str:
    """Lower case, one character for one, so offsets in the folded text are offsets in ``text``."""
    lowered = text.lower()
    if len(lowered) == len(text):
        return lowered
    # A few characters lower to two ("İ"); keep those as they are.
    return "".join(c.lower() if len(c.lower()) == 1 else c for c in text)


class BannedStringMatcher:
    """Banned strings of one job, matched case-insensitively (character by character).

    banned: strings the job's text must never contain. The caller holds the text: `find` says
    where a banned string starts in it, `safe_prefix_length` how much of it no banned string
    can reach, `may_continue` whether a text ends where one could still be completed.
    """

    def __init__(self, banned: Iterable[str]) -> None:
        self.banned = _checked(banned, "banned strings")
        self._folded = tuple(_fold(s) for s in self.banned)
        self._index = _PrefixIndex(self._folded)

    def find(self, text: str) -> int | None:
        """Offset in ``text`` where the first banned string to complete starts, or None."""
        at, found = _earliest(_fold(text), self._folded)
        return None if found is None else at

    def safe_prefix_length(self, text: str) -> int:
        """Length of the start of ``text`` that no banned string can reach: before a full match,
        and before an end that may still grow into one."""
        folded = _fold(text)
        at, found = _earliest(folded, self._folded)
        if found is not None:
            return at
        return len(text) - self._index.held_length(folded)

    def may_continue(self, text: str) -> bool:
        """Whether ``text`` ends in the start of a banned string (a proper prefix of one), so
        some continuation of it completes one."""
        return self._index.held_length(_fold(text)) > 0
