"""`JobStream.advance` takes the detokenizer's fast path itself (through
`IncrementalDetokenizer.simple_window`, without calling `add_token`): its texts and completion
equal a stream that always decodes, over filled and lazily filled tables, with and without
special tokens, and it does skip the call for plain text."""

from __future__ import annotations

import pytest

from dyngen_core.engine.job import Job
from dyngen_core.text.detokenize import IncrementalDetokenizer, TokenPieces
from dyngen_core.text.stream import JobStream, StreamUpdate
from tests.unit.test_host_fast_paths import ACCEPTED, _texts


def _stream(tokenizer: object, prompt: list[int], pieces: TokenPieces | None,
            decode_special: bool) -> JobStream:
    job = Job(input_ids=prompt, max_new_tokens=1000, stop_conditions=[],
              decode_special_tokens=decode_special)
    return JobStream(job, tokenizer, frozenset(), pieces)  # type: ignore[arg-type]


def _texts_of(stream: JobStream, ids: list[int]) -> list[str]:
    out = []
    for token in ids:
        update = stream.advance(token)
        assert not isinstance(update, StreamUpdate)
        out.append(update)
    return out + [stream.cancel_text(), stream.completion]


@pytest.mark.parametrize("name", ["byte_level", "sentencepiece", "wordpiece"])
@pytest.mark.parametrize("table", ["filled", "lazy"])
@pytest.mark.parametrize("decode_special", [False, True])
def test_inline_fast_path_equals_decoding(name: str, table: str, decode_special: bool) -> None:
    tokenizer = ACCEPTED[name]()
    if table == "filled":
        pieces = tokenizer.token_pieces()
    else:
        pieces = TokenPieces(tokenizer, tokenizer.backend.get_added_tokens_decoder())
    assert pieces is not None
    for text in _texts(7):
        ids = tokenizer.backend.encode(text).ids
        for cut in (1, 3):
            if len(ids) <= cut:
                continue
            prompt, generated = ids[:cut], ids[cut:]
            fast = _stream(tokenizer, prompt, pieces, decode_special)
            plain = _stream(tokenizer, prompt, None, decode_special)
            assert _texts_of(fast, generated) == _texts_of(plain, generated), text


def test_plain_text_skips_the_detokenizer_call(monkeypatch: pytest.MonkeyPatch) -> None:
    tokenizer = ACCEPTED["byte_level"]()
    calls = [0]
    add_token = IncrementalDetokenizer.add_token

    def counted(detok: IncrementalDetokenizer, token_id: int) -> str:
        calls[0] += 1
        return add_token(detok, token_id)

    monkeypatch.setattr(IncrementalDetokenizer, "add_token", counted)
    ids = tokenizer.backend.encode(" hello world, the quick brown fox jumps").ids
    stream = _stream(tokenizer, ids[:2], tokenizer.token_pieces(), False)
    text = "".join(_texts_of(stream, ids[2:])[:-2])
    assert text == tokenizer.decode(ids)[len(tokenizer.decode(ids[:2])):]
    assert calls[0] <= 2 < len(ids) - 2
