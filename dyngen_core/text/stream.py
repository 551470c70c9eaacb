"""`JobStream`: one job's text pipeline, from sampled token ids to text chunks and an end.

It owns the incremental detokenizer, the stop matcher and the banned-string matcher of one job,
and decides when the job ends (stop token, stop string, max_new_tokens). Pure Python: the
generator feeds it token ids and emits what it returns.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from dyngen_core.engine.job import Job
from dyngen_core.engine.results import EosReason
from dyngen_core.text.detokenize import IncrementalDetokenizer, TokenPieces
from dyngen_core.text.stop import BannedStringMatcher, StopIndexes, StopMatcher
from dyngen_core.text.tokenizer import Tokenizer


@dataclass(slots=True)
class StreamUpdate:
    """What one pushed token produced: text safe to show, an end, or a rewind request.

    rewind: how many of the job's generated tokens to drop because a banned string matched;
    banned_token_id: the token that started the banned string, to forbid at that position.
    """

    text: str = ""
    eos_reason: EosReason | None = None
    rewind: int = 0
    banned_token_id: int | None = None
    token_ids: list[int] = field(default_factory=list)


class JobStream:
    """Tracks one job's generated tokens and turns them into text chunks.

    job: the job (its ``new_token_ids`` are appended to here).
    tokenizer: decodes the tokens.
    stop_token_ids: ids that end the job (after ``min_new_tokens``).
    pieces: the tokenizer's shared `TokenPieces` (the detokenizer's fast path), or None.
    stop_indexes: stop-string tables shared with other jobs (`StopIndexes`), or None.
    stop_gate: for a constrained job, whether the reply so far is complete under its
        constraint (`ConstraintMatcher.is_accepting`), asked before each token's text is
        matched: a stop string ends the job only where the reply could end, so it never cuts
        a structure the constraint is writing (a JSON value, a tool call) but still ends free
        text (an "auto" tool choice's). None: stop strings apply everywhere.
    """

    def __init__(self, job: Job, tokenizer: Tokenizer, stop_token_ids: frozenset[int],
                 pieces: TokenPieces | None = None,
                 stop_indexes: StopIndexes | None = None,
                 stop_gate: Callable[[], bool] | None = None) -> None:
        self.job = job
        self.tokenizer = tokenizer
        self.stop_token_ids = stop_token_ids
        self.pieces = pieces
        self.stop = StopMatcher(list(job.stop_strings), indexes=stop_indexes)
        # Read once per token: copied here from the job (whose limits do not change).
        self._has_stop_strings = bool(self.stop.stop_strings)
        # Texts that pass the stop strings on sight (see `StopMatcher`): most token texts of
        # a sampled step, which are spread over the vocabulary, so the shared set of passing
        # texts would miss the CPU caches on them, and learn each one through `feed` first.
        self._stop_shortest = self.stop.shortest
        self._stop_end_chars = self.stop.end_chars
        self._min_new_tokens = job.min_new_tokens
        self._max_new_tokens = job.max_new_tokens
        self.banned = BannedStringMatcher(list(job.banned_strings)) if job.banned_strings else None
        self._stop_gate = stop_gate if self._has_stop_strings else None
        # Every token may end the job, none is held for a rewind and no constraint gates the
        # stop strings: `advance`'s short path.
        self._plain = (self.banned is None and self._min_new_tokens == 0
                       and self._stop_gate is None)
        self.detok = self._new_detokenizer(job.input_ids)
        # The detokenizer's fast path, taken here without a call (`add_token` says how).
        self._after: list[str | None] = pieces.after if pieces is not None else []
        self._chunks: list[str] = []  # joined on demand: += on an attribute copies every step
        # With banned strings: text the banned check holds back (a banned string may start in
        # it), which always starts where a token's text starts, so a rewind takes back whole
        # tokens and nothing shown. ``_held_from`` is the first of those tokens; ``_held_ends``
        # gives, for it and each later token, where the text of all tokens up to it ends
        # (offsets over all text produced), or -1 where that text is not settled (a character
        # waits for more bytes, or a special token was skipped): no cut there. Released text
        # never ends in the start of a banned string: a rewind may take back the held tokens
        # that kept it from growing into one, and a banned string reaching back into shown
        # text could not be taken back. So only the held text needs checking.
        self._held = ""
        self._held_from = 0
        self._held_ends: list[int] = []
        self._released = 0  # how much text the banned check released

    def _new_detokenizer(self, prefix: list[int]) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(
            self.tokenizer,
            skip_special_tokens=not self.job.decode_special_tokens,
            prompt_ids=prefix,
            pieces=self.pieces,
        )

    @property
    def released_tokens(self) -> int:
        """How many of the job's generated tokens are settled: no banned-string rewind can take
        them back any more (every token, for a job without banned strings). A caller that
        streams token ids holds the others back."""
        if self.banned is None:
            return len(self.job.new_token_ids)
        return self._held_from

    @property
    def completion(self) -> str:
        """All text released so far."""
        if len(self._chunks) > 1:
            self._chunks[:] = ["".join(self._chunks)]
        return self._chunks[0] if self._chunks else ""

    def push(self, token_id: int) -> StreamUpdate:
        """Account one sampled token; returns the text it releases and whether the job ends."""
        update = self.advance(token_id)
        if isinstance(update, str):
            return StreamUpdate(update, token_ids=[token_id])
        return update

    def advance(self, token_id: int) -> str | StreamUpdate:
        """`push` without an update object in the common case: the released text when the token
        neither ends the job nor asks for a rewind (its update would be ``StreamUpdate(text,
        token_ids=[token_id])``), else the full `StreamUpdate`."""
        generated = self.job.new_token_ids
        generated.append(token_id)
        if not self._plain:
            return self._advance_checked(token_id, generated)
        # What `_advance_checked` does without banned strings or min_new_tokens; it runs for
        # every job every step, so the stop matcher is only called when the text may matter.
        if token_id in self.stop_token_ids:
            return self._end(self._release_all(), EosReason.STOP_TOKEN, token_id)
        window = self.detok.simple_window
        text = None
        if window is not None and token_id >= 0:  # (-1 would index from the end)
            try:
                text = self._after[token_id]
            except IndexError:
                pass
            if text is not None:
                window[0] = token_id
        if text is None:
            text = self.detok.add_token(token_id)
        if self._has_stop_strings:
            stop = self.stop
            if stop.held_text or text and (
                    len(text) >= self._stop_shortest or text[-1] in self._stop_end_chars
            ) and text not in stop.passes:
                text = stop.feed(text)
                if stop.matched is not None:
                    return self._end(text, EosReason.STOP_STRING, token_id)
        if len(generated) >= self._max_new_tokens:
            return self._end(text + self._release_all(), self._limit_reason(), token_id)
        if text:
            self._chunks.append(text)
        return text

    def _limit_reason(self) -> EosReason:
        """Why a job that reached max_new_tokens ended: a stop string may complete only in the
        text released then (one ending in what looked like an unfinished character)."""
        return EosReason.MAX_NEW_TOKENS if self.stop.matched is None else EosReason.STOP_STRING

    def _end(self, text: str, reason: EosReason, token_id: int) -> StreamUpdate:
        if text:
            self._chunks.append(text)
        return StreamUpdate(text, reason, token_ids=[token_id])

    def _advance_checked(self, token_id: int, generated: list[int]) -> str | StreamUpdate:
        """`advance` with banned strings or min_new_tokens (``generated`` holds the token)."""
        # At least one token is generated, so with min_new_tokens == 0 this is always True.
        can_stop = len(generated) > self._min_new_tokens
        if can_stop and token_id in self.stop_token_ids:
            return self._end(self._release_all(), EosReason.STOP_TOKEN, token_id)
        text = self.detok.add_token(token_id)
        if self.banned is not None:
            rewind = self._check_banned(text)
            if rewind is not None:
                return rewind
            text = self._release_banned_safe()
        eos_reason = None
        if self._has_stop_strings:
            stop = self.stop
            if can_stop and (self._stop_gate is None or self._stop_gate()):
                text = stop.feed(text)
                if stop.matched is not None:
                    eos_reason = EosReason.STOP_STRING
            else:
                text = stop.flush() + text
        if eos_reason is None and len(generated) >= self._max_new_tokens:
            text += self._release_all()
            eos_reason = self._limit_reason()
        if eos_reason is not None:
            return self._end(text, eos_reason, token_id)
        if text:
            self._chunks.append(text)
        return text

    def _check_banned(self, text: str) -> StreamUpdate | None:
        """Hold the token's text; on a banned string, take back the tokens from the last token
        boundary at or before where it starts (the rewind the generator applies)."""
        assert self.banned is not None
        self._held += text
        produced = self._released + len(self._held)
        self._held_ends.append(produced if self.detok.settled else -1)
        match_at = self.banned.find(self._held)
        if match_at is None:
            return None
        kept = self._held_boundary(self._released + match_at)
        tokens = self.job.new_token_ids
        first = self._held_from + kept
        dropped, banned_token_id = len(tokens) - first, tokens[first]
        del tokens[first:]
        kept_end = self._held_ends[kept - 1] if kept else self._released
        del self._held_ends[kept:]
        self._held = self._held[: kept_end - self._released]
        self.detok = self._new_detokenizer(self.job.input_ids + tokens)
        return StreamUpdate(rewind=dropped, banned_token_id=banned_token_id)

    def _release_banned_safe(self) -> str:
        """Release the held text no banned string can start in, up to a token boundary where
        the text does not end in the start of one (whatever tokens come after it)."""
        assert self.banned is not None
        held, ends = self._held, self._held_ends
        safe = self.banned.safe_prefix_length(held)
        if safe == len(held) and ends[-1] >= 0:  # the usual token: all of it goes
            self._released += safe
            self._held_from += len(ends)
            self._held = ""
            ends.clear()
            return held
        kept = self._releasable_tokens(self._released + safe)
        if not kept:
            return ""
        end = self._held_ends[kept - 1]
        out, self._held = self._held[: end - self._released], self._held[end - self._released:]
        self._released = end
        self._held_from += kept
        del self._held_ends[:kept]
        return out

    def _releasable_tokens(self, offset: int) -> int:
        """How many held tokens may be released: their text ends, settled, at or before
        ``offset`` and not in the start of a banned string. Text the later held tokens keep from
        becoming one is not enough: a rewind may take those tokens back, and the next ones
        could complete it in text already shown."""
        assert self.banned is not None
        ends, released = self._held_ends, self._released
        kept = self._held_boundary(offset)
        while kept and (ends[kept - 1] < 0
                        or self.banned.may_continue(self._held[: ends[kept - 1] - released])):
            kept -= 1
        return kept

    def _held_boundary(self, offset: int) -> int:
        """How many held tokens have their text end, settled, at or before ``offset``."""
        ends = self._held_ends
        kept = len(ends)
        while kept and not 0 <= ends[kept - 1] <= offset:
            kept -= 1
        return kept

    def _release_all(self) -> str:
        text = self.detok.flush()
        if self.banned is not None:
            text, self._held = self._held + text, ""
            # The flush may end in U+FFFD (an unfinished character): a banned string ending in
            # one is cut off here, as the job ends and no rewind can follow.
            cut = self.banned.find(text)
            text = text if cut is None else text[:cut]
            self._released += len(text)
            self._held_from = len(self.job.new_token_ids)
            self._held_ends.clear()
        if self.job.stop_strings:
            if self._stop_gate is None or self._stop_gate():
                released, _ = self.stop.feed_text(text)
                text = released + self.stop.flush()
            else:  # inside a structure: the text held before it, then the rest, unmatched
                text = self.stop.flush() + text
        return text

    def cancel_text(self) -> str:
        """Text still held back when a job is cancelled (released so nothing is lost)."""
        text = self._release_all()
        self._chunks.append(text)
        return text
