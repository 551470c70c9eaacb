"""The per-step fast paths of emitting give exactly what the general paths give.

- `StreamingResult` (what the generator builds for a running job's step) reads exactly like
  the plain `Result` with the same six keys: equal both ways, same keys in the same order,
  same repr, same errors for absent keys, and copies and pickles that are plain results.
- `JobStream.advance` of a job without banned strings or min_new_tokens skips the stop
  matcher for texts it knows pass; its updates must equal the general path's token by token.
"""

from __future__ import annotations

import copy
import pickle
from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dyngen_core.engine.job import Job
from dyngen_core.engine.results import Result, StreamingResult, streaming_result
from dyngen_core.text.detokenize import TokenPieces
from dyngen_core.text.stop import StopIndexes
from dyngen_core.text.stream import JobStream, StreamUpdate
from tests.unit.test_detokenize import byte_level


def _plain(job: object, text: str, token_ids: list[int]) -> Result:
    return Result(job=job, identifier=7, stage="streaming", eos=False, text=text,
                  token_ids=token_ids)


@dataclass(frozen=True)
class _Job:
    """What a streaming result reads from its job: the identifier."""

    identifier: int = 7


def test_streaming_result_reads_like_the_plain_result() -> None:
    job = _Job()
    fast, plain = streaming_result(job, "hi", 5), _plain(job, "hi", [5])
    assert fast == plain and plain == fast
    assert list(fast) == list(plain) and list(fast.items()) == list(plain.items())
    assert len(fast) == len(plain) == 6
    assert repr(fast) == repr(plain)
    assert fast["text"] == fast.text == "hi" and fast.get("token_ids") == [5]
    assert fast.stage == fast["stage"] == "streaming" and fast["eos"] is False
    assert fast["job"] is job and fast.identifier == 7
    assert "text" in fast and "logits" not in fast and fast.get("logits") is None
    assert fast != _plain(job, "ho", [5])
    with pytest.raises(KeyError):
        fast["logits"]
    with pytest.raises(AttributeError, match="no 'logits' at stage 'streaming'"):
        _ = fast.logits
    assert isinstance(fast, Result)


def test_streaming_result_copies_are_plain_results() -> None:
    fast = streaming_result(_Job(), "hi", 5)
    for other in (copy.copy(fast), copy.deepcopy(fast), pickle.loads(pickle.dumps(fast))):
        assert type(other) is Result and other == _plain(_Job(), "hi", [5])
    assert type(fast) is StreamingResult


PIECES = TokenPieces.for_tokenizer(byte_level())
INDEXES = StopIndexes()


def _stream(stops: list[int | str], max_new_tokens: int, checked: bool) -> JobStream:
    tokenizer = byte_level()
    job = Job(input_ids=tokenizer.encode("Hello"), max_new_tokens=max_new_tokens,
              stop_conditions=stops)
    stream = JobStream(job, tokenizer, frozenset(job.stop_token_ids), PIECES, INDEXES)
    assert stream._plain
    stream._plain = not checked  # the general path, with nothing that needs it
    return stream


def _run(stream: JobStream, tokens: list[int]) -> list[tuple[str, object]]:
    out: list[tuple[str, object]] = []
    for token in tokens:
        update = stream.advance(token)
        if isinstance(update, StreamUpdate):
            out.append((update.text, (update.eos_reason, update.token_ids, update.rewind)))
            break
        out.append((update, None))
    return out + [("completion", stream.completion)]


WORDS = byte_level().encode("the quick brown fox, hello there; café 😀 world\n\n")


@settings(max_examples=150, deadline=None)
@given(tokens=st.lists(st.sampled_from(WORDS), min_size=1, max_size=40),
       stop_spans=st.lists(st.tuples(st.integers(0, len(WORDS) - 2), st.integers(1, 6)),
                           max_size=3),
       stop_token=st.sampled_from([None, WORDS[0], WORDS[3]]),
       max_new_tokens=st.integers(1, 40))
def test_plain_stream_updates_equal_the_general_path(tokens: list[int],
                                                     stop_spans: list[tuple[int, int]],
                                                     stop_token: int | None,
                                                     max_new_tokens: int) -> None:
    # Stop strings that span token boundaries (parts of two adjacent words' text), so text is
    # held back between tokens and released or matched later.
    texts = [byte_level().decode(WORDS[i:i + 2]) for i, _ in stop_spans]
    stops = [text[len(text) // 3:][:n] for text, (_, n) in zip(texts, stop_spans, strict=True)]
    conditions: list[int | str] = [s for s in stops if s.strip()]
    conditions += [] if stop_token is None else [stop_token]
    fast = _run(_stream(conditions, max_new_tokens, checked=False), tokens)
    general = _run(_stream(conditions, max_new_tokens, checked=True), tokens)
    assert fast == general
