"""`IncrementalDetokenizer`: token ids in, finished text out, one step at a time.

Decoding token by token goes wrong in two ways: a character's UTF-8 bytes can be spread over
several tokens (byte-level BPE, byte-fallback tokens like ``<0xE2>``), and SentencePiece-style
decoders drop the leading space of the first token they see. So each step decodes a short window
of recent tokens twice, with and without the new ones, and emits the difference (the approach of
transformers' TextStreamer and vLLM): the window's first tokens give the space its context, and
text that still ends in an unfinished character (U+FFFD) waits for the next token. The window
restarts after every emission, so a step costs the same however long the text gets.

Fast path: with a `TokenPieces` table (filled for the whole vocabulary once per tokenizer), a
token that follows a token emitted on its own costs a dict look-up instead of two decodes (see
`TokenPieces` for when that is exact).
Pure Python: no torch.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Protocol

REPLACEMENT_CHAR = "\ufffd"
# Tokens of context taken from the prompt; a few is enough to fix a leading space.
PROMPT_CONTEXT_TOKENS = 4
# Past MAX_PENDING_TOKENS tokens whose text still ends unfinished (U+FFFD), the text up to the
# last token that ends a character is released. Tokens can end inside characters many times in
# a row (merges across characters), and invalid bytes (real U+FFFD) never finish: past
# OPEN_CHARACTER_TOKENS with no such token, the text is released as it decodes (invalid bytes
# as U+FFFD), which bounds the window. An unfinished character spans at most 3 tokens.
MAX_PENDING_TOKENS = 8
OPEN_CHARACTER_TOKENS = 16
UNFINISHED_CHAR_TOKENS = 3
_UNSEEN = object()  # `TokenPieces.table` has no entry yet (None means "not simple")


class Decoder(Protocol):
    """What the detokenizer needs from a tokenizer (`dyngen_core.Tokenizer` has it)."""

    def decode(self, ids: Iterable[int], decode_special_tokens: bool = False) -> str: ...


# Decoders whose output for a token does not depend on the tokens around it, except at the very
# start of the text: there, decode(w + t) == decode(w) + piece(t). BPEDecoder (the last token's
# suffix) and CTC (merges repeats) are not; see `_token_local`.
_LOCAL_DECODERS = {"ByteLevel", "Metaspace", "WordPiece", "ByteFallback", "Fuse", "Strip",
                   "Replace", "Sequence"}


class TokenPieces:
    """Each regular token's text alone and after another token, computed once per id and shared
    by every job of a tokenizer: the detokenizer's fast path.

    Exact when the decoder is token-local (decoding ``[w, t]`` gives decode([w]) followed by a
    text that depends only on ``t``) and both tokens are regular vocabulary entries (not added
    tokens) whose text is whole characters. `for_tokenizer` checks the decoder; `lookup` checks
    the tokens.

    `build` fills the table for the whole vocabulary (two decodes per id), so no step decodes
    to look a token up. A `dyngen_core.Tokenizer` builds its table once and every generator
    over it shares it (`Tokenizer.token_pieces`).

    ``table`` maps an id to its two texts (None: not simple); ``after`` and ``alone`` hold the
    same texts in lists indexed by id (None: not simple or not filled), which the detokenizer
    reads.

    tokenizer: anything with ``decode``.
    added_ids: ids of added (special or control) tokens, never put in the table.
    num_ids: fill the table for ids ``0 .. num_ids - 1`` now; ids outside that range are then
        never simple and never stored (a model may sample ids past its tokenizer's vocabulary,
        from padded embedding rows, and the table is shared by every job: it must not grow).
        0: fill lazily, id by id, in `lookup`, with no bound.
    """

    def __init__(self, tokenizer: Decoder, added_ids: Iterable[int] = (), *,
                 num_ids: int = 0) -> None:
        self._tokenizer = tokenizer
        self._added = frozenset(added_ids)
        self._num_ids = num_ids
        # id -> (text after another token, text alone), or None when the id is not simple.
        self.table: dict[int, tuple[str, str] | None] = {}
        # The same two texts in lists indexed by id (None: not simple, or not filled yet): the
        # detokenizer's per-token read. A step's tokens are spread over the vocabulary when
        # sampled (not greedy), and each look-up then misses the CPU caches: one list slot
        # costs one miss where a dict entry, its int key and the tuple cost four.
        self.after: list[str | None] = [None] * num_ids
        self.alone: list[str | None] = [None] * num_ids
        if num_ids:
            self.fill(range(num_ids))

    @classmethod
    def for_tokenizer(cls, tokenizer: Any) -> TokenPieces | None:
        """The table for a `dyngen_core.Tokenizer` (anything with a `tokenizers` ``backend``),
        filled for its whole vocabulary, or None when its decoder is not known to be
        token-local. A tokenizer with a ``token_pieces()`` method (`dyngen_core.Tokenizer`)
        gives its own shared table."""
        shared = getattr(tokenizer, "token_pieces", None)
        if callable(shared):
            pieces: TokenPieces | None = shared()
            return pieces
        return cls.build(tokenizer)

    @classmethod
    def build(cls, tokenizer: Any) -> TokenPieces | None:
        """A new table for ``tokenizer``, filled (what `for_tokenizer` returns when the
        tokenizer keeps none), or None when its decoder is not known to be token-local."""
        backend = getattr(tokenizer, "backend", None)
        if backend is None or not hasattr(backend, "get_added_tokens_decoder"):
            return None
        decoder = backend.decoder
        config = None if decoder is None else json.loads(decoder.__getstate__())
        if not _token_local(config):
            return None
        return cls(tokenizer, backend.get_added_tokens_decoder(),
                   num_ids=backend.get_vocab_size(with_added_tokens=True))

    def fill(self, token_ids: Iterable[int]) -> None:
        """Put the entries of ``token_ids`` in the table (ids already there are kept, and ids
        outside a filled table's range are left out)."""
        table, added, decode = self.table, self._added, self._tokenizer.decode
        after, alone, num_ids = self.after, self.alone, self._num_ids
        for token_id in token_ids:
            if token_id in table or num_ids and not 0 <= token_id < num_ids:
                continue
            entry = table[token_id] = None if token_id in added else _entry(
                decode([token_id]), decode([token_id, token_id]))
            if entry is not None and token_id >= 0:
                if token_id >= len(after):
                    grow = [None] * (token_id + 1 - len(after))
                    after.extend(grow)
                    alone.extend(grow)
                after[token_id], alone[token_id] = entry

    def lookup(self, token_id: int) -> tuple[str, str] | None:
        """``(text after another simple token, text alone)`` of a simple token, else None."""
        cached = self.table.get(token_id, _UNSEEN)
        if cached is not _UNSEEN:
            return cached  # type: ignore[return-value]
        self.fill((token_id,))
        return self.table.get(token_id)  # absent: outside a filled table's range


def _entry(alone: str, twice: str) -> tuple[str, str] | None:
    """A token's entry from its text alone and the text of it twice in a row."""
    piece = twice[len(alone):]
    if not (alone and piece and twice.startswith(alone) and REPLACEMENT_CHAR not in twice):
        return None
    return (alone if piece == alone else piece, alone)  # equal texts share one string


def _token_local(config: dict[str, Any] | None, fused: bool = False) -> bool:
    """Whether a decoder (its JSON config; None: tokens joined by spaces) is token-local."""
    if config is None:
        return True
    kind = config.get("type")
    if kind not in _LOCAL_DECODERS:
        return False
    if kind == "Sequence":
        for part in config.get("decoders", []):
            if not _token_local(part, fused):
                return False
            fused = fused or part.get("type") in ("Fuse", "ByteLevel", "ByteFallback")
        return True
    if not fused:
        return True  # applied token by token
    # Applied to the whole text: only edits that cannot reach across tokens.
    if kind == "Strip":
        return int(config.get("stop", 0)) == 0
    if kind == "Replace":
        pattern = config.get("pattern", {})
        return "String" in pattern and len(pattern["String"]) == 1
    return kind != "WordPiece" or not config.get("cleanup", True)


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text chunks that never split a character.

    tokenizer: anything with ``decode(ids, decode_special_tokens=...)``.
    skip_special_tokens: leave special tokens out of the text (True), or write them (False).
    pieces: a `TokenPieces` table for the fast path (None: always decode).
    prompt_ids: tokens before the first `add`; their last few are context only, so a generated
        first token keeps its leading space. Without them, the chunks concatenate to exactly
        ``tokenizer.decode(all added ids)``; with them, to ``decode(prompt + added)`` minus
        ``decode(prompt)``. (Exact whenever the ids spell valid UTF-8, and for byte-level BPE
        always; where a ByteFallback decoder meets invalid bytes, U+FFFD may be placed
        differently, since that decoder replaces a whole run of byte tokens at once.)

    A chunk never ends inside a character, unless `OPEN_CHARACTER_TOKENS` tokens in a row do
    (then the text is released as it decodes, so invalid bytes cannot stall the stream).
    """

    def __init__(
        self,
        tokenizer: Decoder,
        skip_special_tokens: bool = True,
        prompt_ids: Sequence[int] | None = None,
        pieces: TokenPieces | None = None,
    ) -> None:
        self._tokenizer = tokenizer
        self._pieces = pieces
        self._after: list[str | None] = pieces.after if pieces is not None else []
        self._alone: list[str | None] = pieces.alone if pieces is not None else []
        self._lookup: Callable[[int], tuple[str, str] | None] = (
            pieces.lookup if pieces is not None else _no_entry)
        # The window while it is one simple token, fully read (the fast path's precondition),
        # else None. While set, `_read_text` may be stale (the window's text is in ``alone``).
        self.simple_window: list[int] | None = None
        self._decode_special = not skip_special_tokens
        tail = list(prompt_ids or [])[-2 * PROMPT_CONTEXT_TOKENS :]
        first = len(tail) - PROMPT_CONTEXT_TOKENS
        start, self._read_text = self._clean_start(tail, first, len(tail))
        # _window holds the tokens since the last emission, preceded by context tokens; the first
        # _read of them are the context, already emitted (or the prompt's).
        self._window: list[int] = tail[start:]
        self._read = len(self._window)
        # Cuts of the window up to this one were found to end inside a character.
        self._open_from = 0

    @property
    def settled(self) -> bool:
        """Whether every added token's text has been returned: none waits for the rest of a
        character or sits unread after a skipped special token."""
        return len(self._window) == self._read

    def add_token(self, token_id: int) -> str:
        """Append one token; returns the text it completes (possibly empty).

        A caller may take this fast path itself (saving a call per token): while
        ``simple_window`` is not None and ``pieces.after[token_id]`` is a text (not None, the id
        within the list), that text is the token's, and storing the id in ``simple_window[0]``
        is all this call would do."""
        if self.simple_window is not None and token_id >= 0:  # (-1 would index from the end)
            try:  # the lists cover the whole vocabulary (`TokenPieces.build`)
                text = self._after[token_id]
            except IndexError:
                text = None
            if text is None and self._lookup(token_id) is not None:  # filled lazily
                text = self._after[token_id]
            if text is not None:
                # What the slow path computes for [w, t] when both are simple: t's piece, and
                # a window of just t (whose text alone is its context for the next token). The
                # window is this detokenizer's own one-token list: updated in place. Its text
                # (`_read_text`) is read from the table only when the slow path needs it.
                self._window[0] = token_id
                return text
        return self.add((token_id,))

    def add(self, token_ids: Iterable[int]) -> str:
        """Append tokens; returns the text they complete (possibly empty)."""
        if self.simple_window is not None:  # `add_token` left `_read_text` behind
            context = self._alone[self._window[0]]
            assert context is not None  # the window's token is simple
            self._read_text, self.simple_window = context, None
        self._window.extend(token_ids)
        pending = len(self._window) - self._read
        if pending == 0:
            return ""
        text = self._decode(self._window)
        if not text.endswith(REPLACEMENT_CHAR):
            if text == self._read_text and pending < MAX_PENDING_TOKENS:
                return ""  # nothing visible yet (skipped special tokens): keep the context
            return self._emit(text, len(self._window))
        if pending < MAX_PENDING_TOKENS:
            return ""  # an unfinished character: wait for its next byte
        # Many tokens and still no finished end: release the text up to the last token that
        # ends a character (each cut is tried once: its text never changes).
        end = len(self._window)
        for cut in range(end - 1, max(self._open_from, self._read), -1):
            head = self._decode(self._window[:cut])
            if not head.endswith(REPLACEMENT_CHAR):
                return self._emit(head, cut)
        self._open_from = end - 1
        if pending < OPEN_CHARACTER_TOKENS:
            return ""
        # Still none: invalid bytes (real U+FFFD) keep the end unfinished. Release all but the
        # last unfinished character, which starts in one of the last 3 tokens.
        cut = end - UNFINISHED_CHAR_TOKENS
        return self._emit(self._decode(self._window[:cut]), cut)

    def flush(self) -> str:
        """Text still held back (an unfinished character becomes U+FFFD); call at the end."""
        if len(self._window) == self._read:
            return ""
        return self._emit(self._decode(self._window), len(self._window))

    def _emit(self, text: str, upto: int) -> str:
        """Return ``text`` past the already-read part and make window[:upto] read."""
        new_text = text[_common_prefix_length(text, self._read_text) :]
        # The tokens just read become the context of the next window.
        start, self._read_text = self._clean_start(self._window, self._read, upto)
        self._window = self._window[start:]
        self._read = upto - start
        self._open_from = 0
        if self._pieces is not None and len(self._window) == 1 == self._read:
            entry = self._pieces.lookup(self._window[0])
            simple = entry is not None and entry[1] == self._read_text
            self.simple_window = self._window if simple else None
        return new_text

    def _clean_start(self, ids: list[int], start: int, upto: int) -> tuple[int, str]:
        """Move ``start`` back until ``ids[start:upto]`` does not begin inside a character, and
        return it with that text. ByteFallback decoders turn a whole run of byte tokens into
        U+FFFD when it starts mid-character, so a window must never start there."""
        start = max(start, 0)
        floor = max(start - UNFINISHED_CHAR_TOKENS, 0)  # a character spans at most 4 tokens
        text = self._decode(ids[start:upto]) if start < upto else ""
        while start > floor and text.startswith(REPLACEMENT_CHAR):
            start -= 1
            text = self._decode(ids[start:upto])
        return start, text

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, decode_special_tokens=self._decode_special)


def _no_entry(token_id: int) -> None:
    return None


def _common_prefix_length(text: str, prefix: str) -> int:
    if text.startswith(prefix):
        return len(prefix)
    # The context itself ended in an unfinished character that the new tokens completed.
    n = 0
    for a, b in zip(text, prefix, strict=False):
        if a != b:
            break
        n += 1
    return n
