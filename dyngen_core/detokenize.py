"""`IncrementalDetokenizer`: token ids in, finished text out, one step at a time.

Decoding token by token goes wrong in two ways: a character's UTF-8 bytes can be spread over
several tokens (byte-level BPE, byte-fallback tokens like ``<0xE2>``), and SentencePiece-style
decoders drop the leading space of the first token they see. So each step decodes a short window
of recent tokens twice, with and without the new ones, and emits the difference (the approach of
transformers' TextStreamer and vLLM): the window's first tokens give the space its context, and
text that still ends in an unfinished character (U+FFFD) waits for the next token. The window
restarts after every emission, so a step costs the same however long the text gets.
Pure Python: no torch.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol

REPLACEMENT_CHAR = "\ufffd"
# Tokens of context taken from the prompt; a few is enough to fix a leading space.
PROMPT_CONTEXT_TOKENS = 4
# A UTF-8 character spans at most 4 bytes, each at least one token, so an unfinished one spans at
# most 3 tokens. Past MAX_PENDING_TOKENS pending tokens, text before it is released even when
# invalid bytes (real U+FFFD) keep the end unfinished, which bounds the window.
MAX_PENDING_TOKENS = 8
UNFINISHED_CHAR_TOKENS = 3


class Decoder(Protocol):
    """What the detokenizer needs from a tokenizer (`dyngen_core.Tokenizer` has it)."""

    def decode(self, ids: Iterable[int], decode_special_tokens: bool = False) -> str: ...


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text chunks that never split a character.

    tokenizer: anything with ``decode(ids, decode_special_tokens=...)``.
    skip_special_tokens: leave special tokens out of the text (True), or write them (False).
    prompt_ids: tokens before the first `add`; their last few are context only, so a generated
        first token keeps its leading space. Without them, the chunks concatenate to exactly
        ``tokenizer.decode(all added ids)``; with them, to ``decode(prompt + added)`` minus
        ``decode(prompt)``. (Exact whenever the ids spell valid UTF-8, and for byte-level BPE
        always; where a ByteFallback decoder meets invalid bytes, U+FFFD may be placed
        differently, since that decoder replaces a whole run of byte tokens at once.)
    """

    def __init__(
        self,
        tokenizer: Decoder,
        skip_special_tokens: bool = True,
        prompt_ids: Sequence[int] | None = None,
    ) -> None:
        self._tokenizer = tokenizer
        self._decode_special = not skip_special_tokens
        tail = list(prompt_ids or [])[-2 * PROMPT_CONTEXT_TOKENS :]
        first = len(tail) - PROMPT_CONTEXT_TOKENS
        start, self._read_text = self._clean_start(tail, first, len(tail))
        # _window holds the tokens since the last emission, preceded by context tokens; the first
        # _read of them are the context, already emitted (or the prompt's).
        self._window: list[int] = tail[start:]
        self._read = len(self._window)

    def add(self, token_ids: Iterable[int]) -> str:
        """Append tokens; returns the text they complete (possibly empty)."""
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
        # Many tokens and still no finished end: release all but the unfinished character.
        # It has at most 3 bytes, so it starts in one of the last 3 tokens.
        end = len(self._window)
        for cut in range(end - 1, max(end - 1 - UNFINISHED_CHAR_TOKENS, self._read), -1):
            head = self._decode(self._window[:cut])
            if not head.endswith(REPLACEMENT_CHAR):
                return self._emit(head, cut)
        # Invalid bytes come right before it: they are real U+FFFD, release them too.
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
