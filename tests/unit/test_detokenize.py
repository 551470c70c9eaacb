"""IncrementalDetokenizer: chunks never split a character and add up to the full decode.

Two real `tokenizers` pipelines are built here (no torch, no files): a byte-level BPE, whose
tokens split multi-byte characters anywhere, and a SentencePiece-style BPE with byte fallback
(``<0xE2>`` tokens, ``▁`` for spaces, a leading space stripped by the decoder).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from functools import lru_cache

import pytest
import tokenizers
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import decoders, models, normalizers, pre_tokenizers, trainers

from dyngen_core.text.detokenize import (
    MAX_PENDING_TOKENS,
    OPEN_CHARACTER_TOKENS,
    Decoder,
    IncrementalDetokenizer,
)
from dyngen_core.text.tokenizer import Tokenizer

CORPUS = [
    "Hello world, hello there. The quick brown fox jumps over the lazy dog.",
    "héllo wörld café naïve résumé", "日本語のテキスト 你好世界", "emoji 😀👍🏽🇺🇸 ❤️ 🎉",
    "def f(x):\n    return x ** 2\n", "    indented   spaces\t\ttabs",
] * 20
SPECIAL = "<|end|>"


@lru_cache(maxsize=1)
def byte_level() -> Tokenizer:
    backend = tokenizers.Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=420, special_tokens=[SPECIAL], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    backend.train_from_iterator(CORPUS, trainer)
    return Tokenizer(backend, special_tokens={"eos_token": SPECIAL})


@lru_cache(maxsize=1)
def sentencepiece() -> Tokenizer:
    """Llama-2 style: Prepend/Replace normalizer, byte fallback, Strip decoder."""
    backend = tokenizers.Tokenizer(models.BPE(unk_token="<unk>"))
    backend.normalizer = normalizers.Sequence(
        [normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")]
    )
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<unk>", SPECIAL], limit_alphabet=40, show_progress=False
    )
    backend.train_from_iterator(CORPUS, trainer)
    data = json.loads(backend.to_str())
    vocab = data["model"]["vocab"]
    for byte in range(256):
        vocab.setdefault(f"<0x{byte:02X}>", len(vocab))
    data["model"]["byte_fallback"] = True
    data["model"]["fuse_unk"] = True
    data["decoder"] = json.loads(
        decoders.Sequence([
            decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]).__getstate__()
    )
    return Tokenizer(tokenizers.Tokenizer.from_str(json.dumps(data)),
                     special_tokens={"eos_token": SPECIAL})


TOKENIZERS = {"byte_level": byte_level, "sentencepiece": sentencepiece}


def stream(tokenizer: Decoder, ids: list[int], chunk_sizes: list[int] | None = None,
           **options: object) -> list[str]:
    detok = IncrementalDetokenizer(tokenizer, **options)  # type: ignore[arg-type]  # **options
    chunks, i, sizes = [], 0, list(chunk_sizes or [])
    while i < len(ids):
        n = sizes.pop(0) if sizes else 1
        chunks.append(detok.add(ids[i : i + n]))
        i += n
    chunks.append(detok.flush())
    return chunks


@pytest.mark.parametrize("name", TOKENIZERS)
@pytest.mark.parametrize("text", [
    "Hello world", "😀👍🏽🇺🇸 ❤️", "日本語のテキスト 你好世界", "naïve café ∑ ≈ 𝔘𝔫𝔦",
    "  two leading spaces", "tabs\tand\nnewlines\n\n", "🎉", "ÿ€𐍈",
])
def test_chunks_never_split_characters_and_add_up(name: str, text: str) -> None:
    tokenizer = TOKENIZERS[name]()
    ids = tokenizer.encode(text)
    chunks = stream(tokenizer, ids)
    assert all("\ufffd" not in chunk for chunk in chunks), chunks
    assert "".join(chunks) == tokenizer.decode(ids) == text


@pytest.mark.parametrize("name", TOKENIZERS)
def test_multibyte_characters_really_span_tokens(name: str) -> None:
    # Guards the test above: the tokenizers must split characters for it to mean anything.
    tokenizer = TOKENIZERS[name]()
    ids = tokenizer.encode("😀👍🏽𐍈")
    assert any("\ufffd" in tokenizer.decode([i]) for i in ids)
    chunks = stream(tokenizer, ids)
    assert "" in chunks[:-1]  # some token completed no character and was held back


def test_byte_fallback_tokens_are_held_until_the_character_is_whole() -> None:
    tokenizer = sentencepiece()
    pieces = [tokenizer.id_to_piece(i) for i in tokenizer.encode("a€")]
    assert pieces[-3:] == ["<0xE2>", "<0x82>", "<0xAC>"]
    detok = IncrementalDetokenizer(tokenizer)
    out = [detok.add([i]) for i in tokenizer.encode("a€")]
    assert out[-3:] == ["", "", "€"]


def test_sentencepiece_leading_space_kept_mid_text() -> None:
    tokenizer = sentencepiece()
    ids = tokenizer.encode("The lazy dog, hello there")
    pieces = [tokenizer.id_to_piece(i) or "" for i in ids]
    chunks = stream(tokenizer, ids)[:-1]  # ASCII only: one chunk per token
    assert "".join(chunks) == "The lazy dog, hello there"
    spaced = [k for k, piece in enumerate(pieces) if k > 0 and piece.startswith("▁")]
    assert spaced, pieces
    for k in spaced:
        assert chunks[k].startswith(" "), (pieces, chunks)
    assert not chunks[0].startswith(" ")  # the decoder strips the text's own leading space


@pytest.mark.parametrize("name", TOKENIZERS)
def test_prompt_ids_give_the_first_token_its_space(name: str) -> None:
    tokenizer = TOKENIZERS[name]()
    full = tokenizer.encode("The lazy dog, hello there")
    pieces = [tokenizer.id_to_piece(i) or "" for i in full]
    k = next(k for k in range(1, len(full)) if pieces[k][0] in "▁Ġ")
    prompt, generated = full[:k], full[k:]
    with_prompt = "".join(stream(tokenizer, generated, prompt_ids=prompt))
    assert with_prompt.startswith(" ")
    assert with_prompt == tokenizer.decode(full)[len(tokenizer.decode(prompt)) :]
    if name == "sentencepiece":  # alone, the decoder would strip that space
        assert not "".join(stream(tokenizer, generated)).startswith(" ")


def test_prompt_ending_inside_a_character() -> None:
    tokenizer = sentencepiece()
    ids = tokenizer.encode("ab\u00800A€")
    cut = [tokenizer.id_to_piece(i) for i in ids].index("<0xC2>") + 1
    chunks = stream(tokenizer, ids[cut:], prompt_ids=ids[:cut])
    assert "".join(chunks) == "\u00800A€"  # the character the prompt began is written whole
    assert all("\ufffd" not in c for c in chunks)


@pytest.mark.parametrize("name", TOKENIZERS)
def test_special_tokens_skipped_or_written(name: str) -> None:
    tokenizer = TOKENIZERS[name]()
    eos = tokenizer.eos_token_id
    assert eos is not None
    ids = tokenizer.encode("Hello") + [eos] + tokenizer.encode(" world")
    skipped = "".join(stream(tokenizer, ids))
    assert SPECIAL not in skipped and skipped == tokenizer.decode(ids)
    written = "".join(stream(tokenizer, ids, skip_special_tokens=False))
    assert SPECIAL in written and written == tokenizer.decode(ids, decode_special_tokens=True)


def test_invalid_bytes_are_released_and_the_window_stays_bounded() -> None:
    tokenizer = sentencepiece()
    lone = tokenizer.piece_to_id("<0x80>")
    assert lone is not None
    ids = [lone] * 40 + tokenizer.encode(" ok")
    seen: list[int] = []

    class Recording:
        def decode(self, ids: Iterable[int], decode_special_tokens: bool = False) -> str:
            ids = list(ids)
            seen.append(len(ids))
            return tokenizer.decode(ids, decode_special_tokens)

    detok = IncrementalDetokenizer(Recording())
    chunks = [detok.add([i]) for i in ids] + [detok.flush()]
    assert "".join(chunks) == tokenizer.decode(ids)
    assert "".join(chunks[:40])  # invalid bytes were released before the end
    assert max(seen) <= 2 * OPEN_CHARACTER_TOKENS  # a released chunk is the next context


def test_window_is_bounded_on_long_text() -> None:
    tokenizer = byte_level()
    ids = tokenizer.encode(" ".join(CORPUS))
    assert len(ids) > 1000
    longest = 0

    class Recording:
        def decode(self, ids: Iterable[int], decode_special_tokens: bool = False) -> str:
            ids = list(ids)
            nonlocal longest
            longest = max(longest, len(ids))
            return tokenizer.decode(ids, decode_special_tokens)

    chunks = stream(Recording(), ids)
    assert "".join(chunks) == tokenizer.decode(ids)
    assert longest <= 2 * MAX_PENDING_TOKENS


def test_many_tokens_at_once_and_nothing_after_flush() -> None:
    tokenizer = byte_level()
    ids = tokenizer.encode("😀 Hello world 日本語")
    detok = IncrementalDetokenizer(tokenizer)
    assert detok.add(ids) + detok.flush() == tokenizer.decode(ids)
    assert detok.flush() == "" and detok.add([]) == ""


TEXT = st.text(
    # Lone surrogates are not text (no tokenizer takes them); newer hypothesis versions draw
    # them unless told not to.
    alphabet=st.characters(exclude_characters="\ufffd", exclude_categories=("Cs",)),
    max_size=30,
)


@settings(max_examples=150, deadline=None)
@given(text=TEXT, sizes=st.lists(st.integers(1, 4), max_size=40),
       name=st.sampled_from(sorted(TOKENIZERS)), prefix=st.integers(0, 5))
def test_random_text_and_chunking_add_up(
    text: str, sizes: list[int], name: str, prefix: int
) -> None:
    tokenizer = TOKENIZERS[name]()
    ids = tokenizer.encode(text)
    prompt, generated = ids[:prefix], ids[prefix:]
    chunks = stream(tokenizer, generated, sizes, prompt_ids=prompt)
    assert all("\ufffd" not in chunk for chunk in chunks)
    if prompt:
        expected = tokenizer.decode(ids)[len(tokenizer.decode(prompt)) :]
        if "\ufffd" not in tokenizer.decode(prompt):
            assert "".join(chunks) == expected
    else:
        assert "".join(chunks) == tokenizer.decode(ids)
