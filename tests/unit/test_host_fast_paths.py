"""The host fast paths give exactly what the general paths give.

- `TokenPieces`: a token following a token emitted on its own is looked up instead of decoded;
  the chunks must equal the plain detokenizer's, chunk by chunk, for every decoder it accepts,
  and decoders whose output depends on neighbouring tokens must be refused.
- `StopMatcher`: held text is found by a regex scan of the text's end; it must be the longest
  end of the text that is a proper prefix of a stop string (what the old loop computed).
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Iterable
from typing import Any

import pytest
import tokenizers
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import decoders, models, pre_tokenizers, trainers

from dyngen_core.text.detokenize import IncrementalDetokenizer, TokenPieces
from dyngen_core.text.stop import StopMatcher
from dyngen_core.text.tokenizer import Tokenizer
from tests.unit.test_detokenize import CORPUS, SPECIAL, byte_level, sentencepiece


def _trained(decoder: Any, pre: Any, model: Any) -> Tokenizer:
    backend = tokenizers.Tokenizer(model)
    backend.pre_tokenizer = pre
    options: dict[str, Any] = {"vocab_size": 300, "special_tokens": ["<unk>", SPECIAL],
                               "show_progress": False}
    trainer = trainers.WordPieceTrainer(**options) if isinstance(model, models.WordPiece) \
        else trainers.BpeTrainer(**options)
    backend.train_from_iterator(CORPUS, trainer)
    if decoder is not None:
        backend.decoder = decoder
    return Tokenizer(backend, special_tokens={"eos_token": SPECIAL})


def metaspace() -> Tokenizer:
    return _trained(decoders.Metaspace(), pre_tokenizers.Metaspace(),
                    models.BPE(unk_token="<unk>"))


def wordpiece() -> Tokenizer:
    return _trained(decoders.WordPiece(), pre_tokenizers.Whitespace(),
                    models.WordPiece(unk_token="<unk>"))


def no_decoder() -> Tokenizer:
    return _trained(None, pre_tokenizers.Whitespace(), models.BPE(unk_token="<unk>"))


ACCEPTED: dict[str, Callable[[], Tokenizer]] = {
    "byte_level": byte_level, "sentencepiece": sentencepiece, "metaspace": metaspace,
    "wordpiece": wordpiece, "no_decoder": no_decoder,
}


class CountingDecoder:
    """A tokenizer wrapper that counts decode calls (and exposes the same backend)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.backend = tokenizer.backend
        self.calls = 0

    def decode(self, ids: Iterable[int], decode_special_tokens: bool = False) -> str:
        self.calls += 1
        return self.tokenizer.decode(ids, decode_special_tokens)


def _chunks(detok: IncrementalDetokenizer, ids: list[int], fast: bool) -> list[str]:
    out = [detok.add_token(i) if fast else detok.add([i]) for i in ids]
    return out + [detok.flush()]


def _texts(seed: int) -> list[str]:
    rng = random.Random(seed)
    alphabet = list("ab cd,.\n€😀日") + ["hello", " world", SPECIAL, "  "]
    return CORPUS[:6] + ["".join(rng.choice(alphabet) for _ in range(30)) for _ in range(60)]


@pytest.mark.parametrize("name", ACCEPTED)
@pytest.mark.parametrize("skip_special", [True, False])
def test_fast_path_chunks_equal_the_decoded_chunks(name: str, skip_special: bool) -> None:
    tokenizer = ACCEPTED[name]()
    pieces = TokenPieces.for_tokenizer(tokenizer)
    assert pieces is not None, f"{name}'s decoder should be accepted"
    for text in _texts(len(name)):
        ids = tokenizer.backend.encode(text).ids
        for cut in (0, 1, 4):
            prompt, generated = ids[:cut], ids[cut:]
            plain = IncrementalDetokenizer(tokenizer, skip_special, prompt_ids=prompt)
            fast = IncrementalDetokenizer(tokenizer, skip_special, prompt_ids=prompt,
                                          pieces=pieces)
            assert _chunks(fast, generated, True) == _chunks(plain, generated, False), text


def test_fast_path_skips_decoding() -> None:
    counting = CountingDecoder(byte_level())
    pieces = TokenPieces.for_tokenizer(counting)
    assert pieces is not None
    ids = counting.tokenizer.encode("the quick brown fox jumps over the lazy dog " * 8)
    fast = IncrementalDetokenizer(counting, pieces=pieces)
    _chunks(fast, ids, True)  # the first pass fills the table
    counting.calls = 0
    again = IncrementalDetokenizer(counting, prompt_ids=ids[:1], pieces=pieces)
    assert "".join(_chunks(again, ids[1:], True)) == counting.tokenizer.decode(ids)[
        len(counting.tokenizer.decode(ids[:1])):]
    assert counting.calls <= 4  # only the first token, whose window holds the prompt


@pytest.mark.parametrize("name", ACCEPTED)
def test_filled_table_equals_the_lazy_lookups(name: str) -> None:
    tokenizer = ACCEPTED[name]()
    filled = tokenizer.token_pieces()
    assert filled is not None and filled is tokenizer.token_pieces()  # built once, shared
    assert TokenPieces.for_tokenizer(tokenizer) is filled
    assert len(filled.table) == tokenizer.vocab_size  # nothing left to decode in a step
    lazy = TokenPieces(tokenizer, tokenizer.backend.get_added_tokens_decoder())
    assert {i: lazy.lookup(i) for i in range(tokenizer.vocab_size)} == filled.table
    assert any(entry is not None for entry in filled.table.values())


def test_ids_past_the_vocabulary_leave_a_filled_table_as_it_is() -> None:
    """A model may sample ids past its tokenizer's vocabulary (padded embedding rows); the
    table every job shares stays the vocabulary's, and such ids take the slow path."""
    tokenizer = byte_level()
    pieces = TokenPieces.build(tokenizer)  # a table of this test's own, like the shared one
    assert pieces is not None
    size = tokenizer.vocab_size
    ids = tokenizer.encode("hello world") + [size, size + 3, -1] + tokenizer.encode(" again")
    assert [pieces.lookup(i) for i in (size, size + 3, -1)] == [None] * 3
    pieces.fill([size + 7])
    detok = IncrementalDetokenizer(tokenizer, pieces=pieces)
    assert "".join(_chunks(detok, [i for i in ids if i >= 0], True)) == tokenizer.decode(
        [i for i in ids if i >= 0])
    assert sorted(pieces.table) == list(range(size))
    assert len(pieces.after) == len(pieces.alone) == size


def _with_decoder(decoder: Any) -> Tokenizer:
    data = json.loads(byte_level().backend.to_str())
    data["decoder"] = json.loads(decoder.__getstate__())
    return Tokenizer(tokenizers.Tokenizer.from_str(json.dumps(data)))


@pytest.mark.parametrize("decoder", [
    decoders.BPEDecoder(),  # the last token's suffix decodes differently
    decoders.CTC(),  # repeated tokens merge
    decoders.Sequence([decoders.Fuse(), decoders.Strip(" ", 0, 1)]),  # trims the text's end
    decoders.Sequence([decoders.Fuse(), decoders.Replace("ab", "x")]),  # may span two tokens
], ids=["bpe", "ctc", "strip_end", "replace_across"])
def test_context_dependent_decoders_get_no_fast_path(decoder: Any) -> None:
    assert TokenPieces.for_tokenizer(_with_decoder(decoder)) is None


def test_added_tokens_never_take_the_fast_path() -> None:
    tokenizer = byte_level()
    pieces = TokenPieces.for_tokenizer(tokenizer)
    assert pieces is not None and tokenizer.eos_token_id is not None
    assert pieces.lookup(tokenizer.eos_token_id) is None
    assert pieces.lookup(tokenizer.encode("hello")[0]) is not None


def held_oracle(text: str, stops: list[str]) -> str:
    """The longest end of ``text`` that is a proper prefix of a stop string."""
    for k in range(len(text), 0, -1):
        if any(len(s) > k and s.startswith(text[-k:]) for s in stops):
            return text[-k:]
    return ""


@settings(max_examples=300, deadline=None)
@given(stops=st.lists(st.text(alphabet="ab\nc", min_size=1, max_size=5), min_size=1,
                      max_size=3),
       chunks=st.lists(st.text(alphabet="abc\n", max_size=6), max_size=10))
def test_held_text_is_the_longest_possible_stop_start(stops: list[str],
                                                      chunks: list[str]) -> None:
    matcher = StopMatcher(stops)
    seen = ""
    for chunk in chunks:
        released, matched = matcher.feed_text(chunk)
        if matched is not None:
            return
        seen += chunk
        assert matcher.held_text == held_oracle(seen, stops)
        assert seen.endswith(matcher.held_text)


def test_a_negative_token_id_never_reads_the_last_vocabulary_entry() -> None:
    """The fast path indexes a list by token id: -1 (the planner's pending-token mark) must not
    come back as the last token's text; it takes the decoding path, which refuses it."""
    tokenizer = byte_level()
    pieces = tokenizer.token_pieces()
    assert pieces is not None
    fast = IncrementalDetokenizer(tokenizer, pieces=pieces)
    assert pieces.after[-1]  # what the unguarded fast path would have returned
    with pytest.raises((ValueError, OverflowError)):
        fast.add_token(-1)
