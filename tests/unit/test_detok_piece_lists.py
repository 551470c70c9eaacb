"""`TokenPieces.after` / `.alone`, the lists the detokenizer's fast path reads by token id,
hold exactly the table's entries, also when the table is filled lazily (the lists grow), and a
detokenizer over a lazily filled table gives the plain detokenizer's chunks."""

from __future__ import annotations

import pytest

from dyngen_core.text.detokenize import IncrementalDetokenizer, TokenPieces
from tests.unit.test_host_fast_paths import ACCEPTED, _chunks, _texts


def _lists_match_table(pieces: TokenPieces) -> None:
    for token_id, entry in pieces.table.items():
        after = pieces.after[token_id] if token_id < len(pieces.after) else None
        alone = pieces.alone[token_id] if token_id < len(pieces.alone) else None
        assert (after, alone) == (entry if entry is not None else (None, None)), token_id


@pytest.mark.parametrize("name", ["byte_level", "sentencepiece", "wordpiece"])
def test_filled_lists_hold_the_table(name: str) -> None:
    tokenizer = ACCEPTED[name]()
    pieces = tokenizer.token_pieces()
    assert pieces is not None
    assert len(pieces.after) == len(pieces.alone) == tokenizer.vocab_size
    assert any(text is not None for text in pieces.after)
    _lists_match_table(pieces)


@pytest.mark.parametrize("name", ["byte_level", "sentencepiece"])
def test_lazy_table_grows_its_lists_and_decodes_like_the_plain_path(name: str) -> None:
    tokenizer = ACCEPTED[name]()
    lazy = TokenPieces(tokenizer, tokenizer.backend.get_added_tokens_decoder())
    assert lazy.after == [] and lazy.alone == []
    for text in _texts(3)[:20]:
        ids = tokenizer.backend.encode(text).ids
        prompt, generated = ids[:2], ids[2:]
        plain = IncrementalDetokenizer(tokenizer, prompt_ids=prompt)
        fast = IncrementalDetokenizer(tokenizer, prompt_ids=prompt, pieces=lazy)
        assert _chunks(fast, generated, True) == _chunks(plain, generated, False), text
    assert lazy.table and len(lazy.after) == len(lazy.alone) > 0
    _lists_match_table(lazy)
