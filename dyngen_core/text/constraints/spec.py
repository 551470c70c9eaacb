"""`Constraint`: what output shape a job asked for (pure data; no grammar engine here).

A constraint is a JSON schema, a regular expression, a grammar (Lark, or GBNF which is
converted) or a list of choices. `as_constraint` turns what users pass to ``Job(constraint=...)``
into one; `dyngen_core.text.constraints.compiler` compiles it into token masks.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from dyngen_core.errors import JobError

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
