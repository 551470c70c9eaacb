"""Constrained decoding: what output shape a job asked for (`Constraint`: a JSON schema, a
regex, a grammar or a list of choices; `as_constraint` reads what users pass), and its token
masks, from llguidance (CPU, Rust; no torch; imported only when a constraint is compiled).

`ConstraintCompiler` is built once per tokenizer (it wraps llguidance's view of the
vocabulary, which indexes every token) and compiles each job's `Constraint` into a
`ConstraintMatcher`: the job's own parser state. Masks are packed bitmasks (int32, bit
``i % 32`` of word ``i // 32`` = token ``i`` allowed), the layout the sampler unpacks on the
device. `ConstraintCompiler.fill_bitmasks` computes a batch of masks on llguidance's thread
pool with the GIL released, so the generator can run it on a helper thread while the model's
forward runs.

llguidance compiles JSON schemas (``$ref``s included), regexes and Lark grammars, enforces
JSON (string escapes, numeric bounds) exactly, rolls back, and needs no torch.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import numpy as np

from dyngen_core.errors import JobError


class TokenizerLike(Protocol):
    """What `ConstraintCompiler.from_tokenizer` reads (dyngen's `Tokenizer` fits)."""

    @property
    def backend(self) -> Any: ...

    eos_token_ids: tuple[int, ...]


def _llguidance() -> Any:
    try:
        import llguidance
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise JobError(
            "constrained decoding needs the llguidance package: pip install llguidance"
        ) from exc
    return llguidance


def mask_words(vocab_size: int) -> int:
    """int32 words in one packed mask row."""
    return (vocab_size + 31) // 32


def bitmask_to_bool(words: np.ndarray, vocab_size: int) -> np.ndarray:
    """Packed int32 row(s) to bool ``[..., vocab_size]``."""
    as_bytes = np.ascontiguousarray(words, dtype=np.int32).view(np.uint8)
    bits = np.unpackbits(as_bytes, axis=-1, bitorder="little")
    return bits[..., :vocab_size].astype(bool)


class ConstraintMatcher:
    """One job's constraint state: which tokens may come next, fed the tokens that came.

    Built by `ConstraintCompiler.matcher`. ``vocab_size`` is the logits width its masks cover.
    """

    def __init__(self, matcher: Any, vocab_size: int) -> None:
        self._matcher = matcher
        self.vocab_size = vocab_size

    def fill_mask(self, out: np.ndarray) -> None:
        """Write the next-token mask into ``out``: a packed int32 row of `mask_words` words,
        or a bool row of ``vocab_size``."""
        if out.dtype == np.bool_:
            out[...] = self.allowed_mask()[: out.shape[-1]]
            return
        if out.dtype != np.int32 or not out.flags["C_CONTIGUOUS"]:
            raise ValueError("fill_mask needs a contiguous int32 or bool numpy row")
        if out.size < mask_words(self.vocab_size):
            raise ValueError(f"a mask row needs {mask_words(self.vocab_size)} int32 words")
        self._matcher.unsafe_compute_mask_ptr(out.ctypes.data, out.nbytes)

    def bitmask(self) -> np.ndarray:
        """The next-token mask, packed int32 ``[mask_words]``."""
        row = np.zeros(mask_words(self.vocab_size), dtype=np.int32)
        self.fill_mask(row)
        return row

    def allowed_mask(self) -> np.ndarray:
        """The next-token mask as bool ``[vocab_size]``."""
        return bitmask_to_bool(self.bitmask(), self.vocab_size)

    def accept(self, token_id: int) -> bool:
        """Advance by one generated token. False when the constraint forbids it (the matcher
        is then in an error state: see `error`). Once the constraint is complete
        (`is_terminated`) an end-of-sequence token is taken without counting for `rollback`:
        tentative walks stop at completion (`masks_along`)."""
        try:
            return bool(self._matcher.consume_token(int(token_id)))
        except OverflowError:
            raise JobError(f"token id {token_id} is outside the vocabulary "
                           f"(0 to {self.vocab_size - 1})") from None

    def masks_along(self, tokens: Sequence[int]) -> list[np.ndarray]:
        """The packed mask before each of ``tokens`` while the constraint allows them, then
        the mask after the last one allowed (so one more mask than tokens allowed; a token
        that completes the constraint is the last allowed). What a verify step's rows and a
        drafter's cut read; the matcher is left as it was found."""
        masks = [self.bitmask()]
        taken = 0
        try:
            for token in tokens:
                if self.is_terminated():
                    break  # what follows would not roll back
                words = masks[-1].view(np.uint32)
                if not 0 <= token < self.vocab_size \
                        or not (int(words[token >> 5]) >> (token & 31)) & 1 \
                        or not self.accept(token):
                    break
                taken += 1
                masks.append(self.bitmask())
        finally:
            self.rollback(taken)
        return masks

    def rollback(self, num_tokens: int) -> None:
        """Forget the last ``num_tokens`` accepted tokens (banned-string rewinds, rejected
        drafts)."""
        if num_tokens > 0 and not self._matcher.rollback(int(num_tokens)):
            raise JobError(f"the constraint cannot roll back {num_tokens} tokens: {self.error}")

    def is_terminated(self) -> bool:
        """True when nothing but EOS may follow: the output is complete (or an EOS was
        accepted, or the matcher failed). The generator ends the job here."""
        return bool(self._matcher.is_stopped())

    def is_accepting(self) -> bool:
        """True when the output so far is a complete match (EOS would be allowed). A job that
        hits max_new_tokens while this is False did not satisfy its constraint."""
        return bool(self._matcher.is_accepting())

    @property
    def error(self) -> str | None:
        """Why the matcher failed, or None."""
        return _brief(self._matcher.get_error()) if self._matcher.is_error() else None


class ConstraintCompiler:
    """Compiles constraints for one tokenizer.

    tokenizer_json: the tokenizer's ``tokenizer.json`` text.
    eos_token_ids: the ids that end generation (allowed once the output is complete).
    vocab_size: the logits width (may exceed the tokenizer's size; extra ids are never allowed).
    """

    def __init__(self, tokenizer_json: str, eos_token_ids: Iterable[int], vocab_size: int) -> None:
        eos = list(dict.fromkeys(int(t) for t in eos_token_ids))
        if not eos:
            raise JobError("constrained decoding needs at least one EOS token id")
        self.vocab_size = vocab_size
        self._llg = _llguidance()
        self._tokenizer = self._llg.LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=eos)
        self._executor: Any = None

    @classmethod
    def from_tokenizer(cls, tokenizer: TokenizerLike, vocab_size: int) -> ConstraintCompiler:
        """From a dyngen `Tokenizer` (its backend's JSON and its EOS ids)."""
        return cls(tokenizer.backend.to_str(), tokenizer.eos_token_ids, vocab_size)

    def grammar(self, constraint: Any) -> str:
        """llguidance's grammar text for a constraint (anything `as_constraint` takes);
        raises `JobError` with the engine's message when it is invalid."""
        spec = as_constraint(constraint)
        text = self._grammar_text(spec)
        problem = self._llg.LLMatcher.validate_grammar(text, self._tokenizer)
        if problem and not problem.startswith("WARNING"):
            raise JobError(f"invalid {spec.kind} constraint: {_brief(problem)}")
        return str(text)

    def matcher(self, constraint: Any) -> ConstraintMatcher:
        """A fresh `ConstraintMatcher` for one job."""
        text = self.grammar(constraint)
        matcher = self._llg.LLMatcher(self._tokenizer, text, log_level=0)
        if matcher.is_error():
            raise JobError(f"invalid constraint: {_brief(matcher.get_error())}")
        return ConstraintMatcher(matcher, self.vocab_size)

    def new_bitmask(self, rows: int) -> np.ndarray:
        """A zeroed packed-mask array ``[rows, mask_words]`` for `fill_bitmasks`."""
        return np.zeros((rows, mask_words(self.vocab_size)), dtype=np.int32)

    def fill_bitmasks(
        self, matchers: Sequence[ConstraintMatcher | None], bitmask: np.ndarray
    ) -> None:
        """Row ``i`` of ``bitmask`` gets ``matchers[i]``'s mask (None rows are left as they
        are), computed in parallel with the GIL released."""
        if bitmask.dtype != np.int32 or not bitmask.flags["C_CONTIGUOUS"] or bitmask.ndim != 2:
            raise ValueError("bitmask must be a contiguous int32 [rows, words] array")
        if bitmask.shape[1] < mask_words(self.vocab_size):
            raise ValueError(f"bitmask rows need {mask_words(self.vocab_size)} words")
        work = [(m._matcher, i) for i, m in enumerate(matchers) if m is not None]
        if not work:
            return
        if self._executor is None:
            self._executor = self._llg.LLExecutor()
        self._executor.unsafe_compute_mask_ptr(
            work, bitmask.ctypes.data, bitmask.shape[1] * 4, bitmask.shape[0])

    def _grammar_text(self, spec: Constraint) -> str:
        lm = self._llg.LLMatcher
        if spec.kind == "json_schema":
            options: dict[str, Any] = {"whitespace_flexible": spec.flexible_whitespace}
            if not spec.flexible_whitespace:
                options.update(item_separator=", ", key_separator=": ")
            try:
                return str(lm.grammar_from_json_schema(json.loads(spec.source), defaults=options))
            except ValueError as exc:
                raise JobError(f"invalid JSON schema constraint: {_brief(str(exc))}") from exc
        if spec.kind == "regex":
            return str(lm.grammar_from_regex(spec.source))
        if spec.kind == "choice":
            return str(lm.grammar_from_regex("|".join(_literal(c) for c in spec.choices)))
        if spec.syntax == "gbnf":
            from llguidance.gbnf_to_lark import gbnf_to_lark

            try:
                lark = gbnf_to_lark(spec.source)
            except Exception as exc:  # the converter raises bare Exceptions too
                raise JobError(f"invalid GBNF grammar: {_brief(str(exc))}") from exc
            return str(lm.grammar_from_lark(lark))
        return str(lm.grammar_from_lark(spec.source))


# Longest engine message quoted in an error (llguidance quotes the grammar and its state).
MESSAGE_LIMIT = 2000


def _brief(message: str) -> str:
    """An engine message for an error: without the parser state dump, at most MESSAGE_LIMIT
    characters."""
    text = str(message).split("\n<state>", 1)[0].strip()
    if len(text) <= MESSAGE_LIMIT:
        return text
    return f"{text[:MESSAGE_LIMIT]}... ({len(text)} characters in all)"


def _literal(text: str) -> str:
    """A regex matching exactly ``text`` (every non-alphanumeric character hex-escaped)."""
    return "(" + "".join(c if c.isascii() and c.isalnum() else f"\\x{{{ord(c):x}}}"
                         for c in text) + ")"


def build_matcher(constraint: Any, tokenizer: TokenizerLike, vocab_size: int) -> ConstraintMatcher:
    """One-off convenience: compile ``constraint`` for ``tokenizer``. This rebuilds the
    vocabulary view each call; a generator should keep one `ConstraintCompiler` instead."""
    return ConstraintCompiler.from_tokenizer(tokenizer, vocab_size).matcher(constraint)


ConstraintKind = Literal["json_schema", "regex", "grammar", "choice"]
GrammarSyntax = Literal["lark", "gbnf"]


@dataclass(frozen=True)
class Constraint:
    """A constraint on a job's generated text (the whole completion must match it).

    kind: ``"json_schema"``, ``"regex"``, ``"grammar"`` or ``"choice"``.
    source: the schema as JSON text, the regex, the grammar text, or the choices as a JSON list.
    syntax: for grammars, ``"lark"`` or ``"gbnf"``.
    flexible_whitespace: for JSON schemas, allow any JSON whitespace between tokens; by default
        the output is compact with ``", "`` and ``": "`` separators (a small model cannot then
        loop on whitespace).

    Build one with `json_schema`, `regex`, `grammar` or `choice`.
    """

    kind: ConstraintKind
    source: str
    syntax: GrammarSyntax = "lark"
    flexible_whitespace: bool = False

    @classmethod
    def json_schema(
        cls, schema: Mapping[str, Any] | str | type, *, flexible_whitespace: bool = False
    ) -> Constraint:
        """Output is JSON valid under ``schema``: a dict, its JSON text, or a pydantic model
        class (its ``model_json_schema()``)."""
        if isinstance(schema, type):
            as_json = getattr(schema, "model_json_schema", None)
            if as_json is None:
                raise JobError(
                    f"{schema.__name__} is not a pydantic model class; pass a JSON schema dict"
                )
            model = schema.__name__
            try:
                schema = as_json()
            except Exception as exc:  # pydantic's errors for types JSON schema cannot describe
                raise JobError(f"{model}.model_json_schema() failed: {exc}") from exc
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except (json.JSONDecodeError, RecursionError) as exc:
                raise JobError(f"the JSON schema text is not valid JSON: {exc}") from None
        if not isinstance(schema, Mapping):
            raise JobError(f"a JSON schema must be a JSON object; got {type(schema).__name__}")
        try:
            text = json.dumps(schema)
        except (TypeError, ValueError, RecursionError) as exc:
            raise JobError(f"the JSON schema cannot be written as JSON ({exc}); pass plain dicts, "
                           "lists, strings, numbers, booleans and None, without cycles") from None
        return cls("json_schema", text, flexible_whitespace=flexible_whitespace)

    @classmethod
    def regex(cls, pattern: str | re.Pattern[str]) -> Constraint:
        """Output fully matches ``pattern`` (Rust ``regex`` syntax: no look-around or
        back-references)."""
        text = pattern.pattern if isinstance(pattern, re.Pattern) else pattern
        if not isinstance(text, str) or not text:
            raise JobError("a regex constraint needs a non-empty pattern string")
        return cls("regex", _utf8(text, "the regex"))

    @classmethod
    def grammar(cls, text: str, syntax: GrammarSyntax = "lark") -> Constraint:
        """Output is derived from the grammar's start rule (``start`` in Lark, ``root`` in
        GBNF)."""
        if syntax not in ("lark", "gbnf"):
            raise JobError(f"grammar syntax must be 'lark' or 'gbnf'; got {syntax!r}")
        if not isinstance(text, str) or not text.strip():
            raise JobError("a grammar constraint needs the grammar text")
        return cls("grammar", _utf8(text, "the grammar"), syntax=syntax)

    @classmethod
    def choice(cls, options: Sequence[str]) -> Constraint:
        """Output is exactly one of ``options`` (non-empty strings)."""
        if isinstance(options, str) or not options:
            raise JobError("a choice constraint needs a non-empty list of strings")
        bad = [o for o in options if not isinstance(o, str) or not o]
        if bad:
            raise JobError(f"choices must be non-empty strings; got {bad[:3]!r}")
        for option in options:
            _utf8(option, "a choice")
        return cls("choice", json.dumps(list(dict.fromkeys(options))))

    @property
    def choices(self) -> list[str]:
        """The options of a choice constraint."""
        if self.kind != "choice":
            raise JobError(f"a {self.kind} constraint has no choices")
        return list(json.loads(self.source))


def _utf8(text: str, what: str) -> str:
    """``text``, checked to be writable as UTF-8 (no lone surrogates)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise JobError(f"{what} holds a lone surrogate ({text[exc.start]!r} at {exc.start}), "
                       "which is not text; remove it") from None
    return text


def as_constraint(obj: Any) -> Constraint:
    """Coerce what ``Job(constraint=...)`` accepts into a `Constraint`.

    - a `Constraint`: itself;
    - a dict, or a pydantic model class: a JSON schema;
    - a list or tuple of strings: a choice;
    - a compiled ``re.Pattern``: a regex;
    - a string: a Lark grammar when a line starts with ``start:``, a GBNF grammar when it
      holds ``::=``, a JSON schema when it parses as a JSON object, else a regex. Use the
      `Constraint` constructors to be explicit.
    """
    if isinstance(obj, Constraint):
        return obj
    if isinstance(obj, Mapping) or isinstance(obj, type):
        return Constraint.json_schema(obj)
    if isinstance(obj, (list, tuple)):
        return Constraint.choice(obj)
    if isinstance(obj, re.Pattern):
        return Constraint.regex(obj)
    if isinstance(obj, str):
        return _from_string(obj)
    raise JobError(
        f"constraint must be a JSON schema (dict or pydantic model class), a regex, a grammar, a "
        f"list of choices or a Constraint; got {type(obj).__name__}"
    )


def _from_string(text: str) -> Constraint:
    if re.search(r"^\s*start\s*:", text, re.MULTILINE):
        return Constraint.grammar(text, "lark")
    if "::=" in text:
        return Constraint.grammar(text, "gbnf")
    if text.lstrip().startswith("{"):
        try:
            parsed = json.loads(text)
        except (json.JSONDecodeError, RecursionError):
            parsed = None
        if isinstance(parsed, dict):
            return Constraint.json_schema(parsed)
    return Constraint.regex(text)
