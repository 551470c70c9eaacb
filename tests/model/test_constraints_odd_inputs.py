"""Odd constraint inputs end in a short `JobError` that names the problem, never in another
exception class (UnicodeEncodeError, TypeError, OverflowError, the GBNF converter's errors) or
in a message that quotes a whole grammar."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
import tokenizers
from pydantic import BaseModel, ConfigDict

from dyngen_core.errors import JobError
from dyngen_core.text.constraints import Constraint, ConstraintCompiler, as_constraint
from dyngen_core.text.tokenizer import Tokenizer
from tests.tiny_models import trained_tokenizer_json

VOCAB = 512


@pytest.fixture(scope="module")
def compiler() -> ConstraintCompiler:
    tokenizer = Tokenizer(tokenizers.Tokenizer.from_str(trained_tokenizer_json(VOCAB)),
                          special_tokens={"eos_token": "</s>"})
    return ConstraintCompiler.from_tokenizer(tokenizer, VOCAB)


class _Opaque:
    pass


class _Unschemable(BaseModel):
    model_config = ConfigDict(arbitrary_types_allowed=True)
    thing: _Opaque


def _cyclic() -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "object", "properties": {}}
    schema["properties"]["self"] = schema
    return schema


def _deep(levels: int) -> dict[str, Any]:
    schema: dict[str, Any] = {}
    for _ in range(levels):
        schema = {"items": schema}
    return schema


ODD: dict[str, tuple[Callable[[], Any], str]] = {
    "regex with a lone surrogate": (lambda: Constraint.regex("a\ud800"), "lone surrogate"),
    "text taken as a regex": (lambda: as_constraint("\udfff"), "lone surrogate"),
    "grammar with a lone surrogate": (lambda: Constraint.grammar('start: "\ud800"'),
                                      "lone surrogate"),
    "choice with a lone surrogate": (lambda: Constraint.choice(["ok", "\ud800"]),
                                     "lone surrogate"),
    "schema holding a set": (lambda: Constraint.json_schema({"enum": {1, 2}}),
                             "cannot be written as JSON"),
    "schema containing itself": (lambda: Constraint.json_schema(_cyclic()),
                                 "cannot be written as JSON"),
    "schema nested 100,000 deep": (lambda: Constraint.json_schema(_deep(100_000)),
                                   "cannot be written as JSON"),
    "schema text nested 100,000 deep": (
        lambda: Constraint.json_schema("[" * 100_000 + "]" * 100_000), "not valid JSON"),
    "pydantic model without a JSON schema": (lambda: Constraint.json_schema(_Unschemable),
                                             "model_json_schema"),
}


@pytest.mark.parametrize("name", ODD)
def test_odd_specs_raise_a_job_error(name: str) -> None:
    build, words = ODD[name]
    with pytest.raises(JobError, match=words):
        build()


@pytest.mark.parametrize(("grammar", "words"), [
    ("root ::= (", "invalid GBNF grammar"),
    ('rule ::= "a"', "invalid GBNF grammar: No 'root' rule"),
    ("::= ::=", "invalid GBNF grammar"),
])
def test_bad_gbnf_raises_a_job_error(compiler: ConstraintCompiler, grammar: str,
                                     words: str) -> None:
    with pytest.raises(JobError, match=words):
        compiler.matcher(Constraint.grammar(grammar, "gbnf"))


def test_errors_quote_at_most_a_bounded_part_of_the_engine_message(
        compiler: ConstraintCompiler) -> None:
    with pytest.raises(JobError, match="characters in all") as caught:
        compiler.matcher(Constraint.grammar("start: " + "a" * 100_000 + " %%%"))
    assert len(str(caught.value)) < 3_000  # the message quoted the 100 kB grammar line
    with pytest.raises(JobError, match="cannot roll back") as rolled:
        compiler.matcher(Constraint.regex("a+")).rollback(10)
    assert "<state>" not in str(rolled.value)  # no parser state dump


@pytest.mark.parametrize("token_id", [-1, 2**32 + 1, 10**12])
def test_token_ids_outside_the_vocabulary_raise_a_job_error(
        compiler: ConstraintCompiler, token_id: int) -> None:
    matcher = compiler.matcher(Constraint.regex("a+"))
    with pytest.raises(JobError, match=f"token id {token_id} is outside the vocabulary"):
        matcher.accept(token_id)


def test_nan_bounds_in_a_schema_are_a_job_error(compiler: ConstraintCompiler) -> None:
    with pytest.raises(JobError, match="maximum"):
        compiler.matcher(Constraint.json_schema({"type": "number", "maximum": math.nan}))
