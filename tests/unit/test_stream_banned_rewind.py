"""Banned-string rewinds take back whole tokens and nothing already shown, also when a token's
text straddles the start of the banned string or a character is spread over byte tokens; and
the detokenizer never shows half a character when many tokens in a row end inside characters.

The generator's side of a rewind is played by `generate`: the token that started the banned
string is forbidden at that position and the next candidate is drawn instead.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import tokenizers
from tokenizers import decoders, models

from dyngen_core.engine.job import Job
from dyngen_core.text.detokenize import IncrementalDetokenizer
from dyngen_core.text.stream import JobStream
from dyngen_core.text.tokenizer import Tokenizer
from tests.unit.test_detokenize import byte_level


def folded(text: str) -> str:
    """Lower case character by character (a banned string matches case-insensitively)."""
    return "".join(c.lower() if len(c.lower()) == 1 else c for c in text)


def ends_in_a_banned_start(text: str, banned: Sequence[str]) -> bool:
    """Whether ``text`` ends in a proper prefix of one of ``banned`` (case-insensitively): some
    next token would complete a banned string in it."""
    end = folded(text)
    return any(end.endswith(folded(b)[:n]) for b in banned for n in range(1, len(b)))


def generate(stream: JobStream, proposals: list[int], other: Callable[[int], int],
             steps: int = 300) -> str:
    """Push ``proposals`` (then ``other(position)``) through ``stream`` as the generator does,
    rewinding on banned strings; returns all text shown (held text released at the end).

    While the job runs, the text shown never ends in the start of a banned string (checked
    for jobs without stop strings, which may hold back the end of what the banned check
    released): whatever comes next, no banned string can complete in shown text."""
    job, forbidden, shown = stream.job, dict[int, set[int]](), ""
    for _ in range(steps):
        position = len(job.new_token_ids)
        token = proposals[position] if position < len(proposals) else other(position)
        while token in forbidden.get(position, ()):
            token = other(position)
        update = stream.push(token)
        if update.rewind:
            assert update.banned_token_id is not None
            forbidden.setdefault(len(job.new_token_ids), set()).add(update.banned_token_id)
            continue
        shown += update.text
        if update.eos_reason is not None:
            return shown
        assert job.stop_strings or not ends_in_a_banned_start(shown, job.banned_strings), shown
    return shown + stream.cancel_text()


def _banned_stream(tokenizer: Tokenizer, banned: list[str], max_new_tokens: int) -> JobStream:
    job = Job(input_ids=tokenizer.encode("Hello"), max_new_tokens=max_new_tokens,
              stop_conditions=[], banned_strings=banned)
    return JobStream(job, tokenizer, frozenset())


def test_a_banned_string_starting_inside_a_token_takes_the_whole_token_back() -> None:
    tokenizer = byte_level()
    proposals = tokenizer.encode("hello")
    assert [tokenizer.decode([t]) for t in proposals] == ["he", "llo"]
    stream = _banned_stream(tokenizer, ["EL"], max_new_tokens=3)
    fallback = tokenizer.encode("quick")
    shown = generate(stream, proposals, lambda position: fallback[position % len(fallback)])
    # "h" of "he" must not be shown: "he" is taken back when "el" completes, and "qu" drawn.
    assert shown == tokenizer.decode(stream.job.new_token_ids) == "qu" + "llo" + "qu"


def test_a_banned_string_after_characters_spread_over_byte_tokens() -> None:
    tokenizer = byte_level()
    proposals = tokenizer.encode("€€x")
    assert len(proposals) == 7  # each "€" is three byte tokens
    stream = _banned_stream(tokenizer, ["€X"], max_new_tokens=7)
    fallback = tokenizer.encode("ok")
    shown = generate(stream, proposals, lambda position: fallback[position % len(fallback)])
    assert shown == tokenizer.decode(stream.job.new_token_ids)
    assert shown.startswith("€") and "€x" not in shown.lower()


def test_no_text_is_shown_that_a_rewind_could_leave_the_start_of_a_banned_string() -> None:
    tokenizer = byte_level()
    proposals = [t for c in "aa a" for t in tokenizer.encode(c)]
    stream = _banned_stream(tokenizer, ["ab", "a a"], max_new_tokens=4)
    fallback = tokenizer.encode("c") + tokenizer.encode("b")
    shown = generate(stream, proposals, lambda position: fallback[position % len(fallback)])
    # The second "a" keeps the first from becoming "ab", but "a a" takes the second back and
    # "b" is drawn in its place: had the first "a" been shown, "ab" would be. It is held, so
    # "ab" is taken back whole and "c" drawn for it.
    assert shown == tokenizer.decode(stream.job.new_token_ids) == "cb a"


def _straddling_byte_level() -> Tokenizer:
    """A byte-level vocabulary of single bytes and the pairs ``80 F0`` and ``9F 98``, so
    "😀😀..." can be written in tokens that each end inside a character."""
    chars = _bytes_to_unicode()
    vocab = {chars[b]: b for b in range(256)}
    vocab[chars[0x80] + chars[0xF0]] = 256
    vocab[chars[0x9F] + chars[0x98]] = 257
    backend = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.decoder = decoders.ByteLevel()
    return Tokenizer(backend)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-to-character mapping, which the ByteLevel decoder reverses."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    extra = [b for b in range(256) if b not in printable]
    mapping = {b: chr(b) for b in printable}
    mapping.update({b: chr(256 + n) for n, b in enumerate(extra)})
    return mapping


def test_many_tokens_in_a_row_ending_inside_characters_never_show_half_a_character() -> None:
    tokenizer = _straddling_byte_level()
    # F0 | 9F 98 | 80 F0 | 9F 98 | 80 F0 ... | 80: no token ends where a character does.
    ids = [0xF0] + [257, 256] * 5 + [257, 0x80]
    text = tokenizer.decode(ids)
    assert text == "😀" * 6
    detok = IncrementalDetokenizer(tokenizer)
    chunks = [detok.add_token(t) for t in ids] + [detok.flush()]
    assert "".join(chunks) == text  # was "😀" then U+FFFD: 8 tokens without an end released
