"""Constrained decoding: Constraint specs, llguidance masks over a real byte-level BPE tokenizer,
and random walks through the sampler whose output must always parse and validate."""

from __future__ import annotations

import json
import re
from typing import Annotated, Any, Literal

import jsonschema
import numpy as np
import pytest
import tokenizers
import torch
from pydantic import BaseModel, ConfigDict, Field

from dyngen_core.errors import JobError
from dyngen_core.sampling import Sampler, SampleRequest, SamplerSettings
from dyngen_core.text.constraints import (
    Constraint,
    ConstraintCompiler,
    ConstraintMatcher,
    as_constraint,
    bitmask_to_bool,
    build_matcher,
)
from dyngen_core.text.tokenizer import Tokenizer
from tests.tiny_models import EOS_ID, trained_tokenizer_json

VOCAB = 512
LOGITS_WIDTH = 520  # wider than the tokenizer, like many models' heads


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    backend = tokenizers.Tokenizer.from_str(trained_tokenizer_json(VOCAB))
    return Tokenizer(backend, special_tokens={"eos_token": "</s>"})


@pytest.fixture(scope="module")
def compiler(tokenizer: Tokenizer) -> ConstraintCompiler:
    return ConstraintCompiler.from_tokenizer(tokenizer, LOGITS_WIDTH)


def walk(matcher: ConstraintMatcher, tokenizer: Tokenizer, seed: int,
         max_tokens: int = 300) -> str:
    """Sample tokens through the real sampler under the matcher's masks until EOS."""
    generator = torch.Generator().manual_seed(seed)
    sampler = Sampler(LOGITS_WIDTH)
    settings = SamplerSettings(temperature=1.0)
    tokens: list[int] = []
    for counter in range(max_tokens):
        logits = torch.randn(1, LOGITS_WIDTH, generator=generator) * 2
        request = SampleRequest(settings, seed=seed, counter=counter,
                                allowed_tokens=matcher.bitmask())
        token = sampler.sample(logits, [request])[0].token_id
        assert matcher.accept(token), matcher.error
        if token == EOS_ID:
            assert matcher.is_terminated()
            return tokenizer.decode(tokens)
        tokens.append(token)
    raise AssertionError(f"no EOS within {max_tokens} tokens: {tokenizer.decode(tokens)!r}")


class Address(BaseModel):
    model_config = ConfigDict(extra="forbid")  # additionalProperties: false

    city: str = Field(max_length=12)
    zip: str = Field(pattern=r"^[0-9]{5}$")


class Person(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(max_length=10)
    age: int = Field(ge=0, le=120)
    role: Literal["admin", "user", "guest"]
    tags: list[Annotated[str, Field(max_length=6)]] = Field(default_factory=list, max_length=3)
    address: Address
    nickname: str | None = Field(default=None, max_length=6)


SCHEMAS: dict[str, Any] = {
    "person (pydantic, nested, enum, optional)": Person,
    "array of objects": {
        "type": "array", "minItems": 1, "maxItems": 3,
        "items": {"type": "object", "additionalProperties": False, "required": ["id", "ok"],
                  "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999},
                                 "ok": {"type": "boolean"},
                                 "note": {"type": "string", "maxLength": 5}}},
    },
    "enum and nullable": {
        "type": "object", "additionalProperties": False, "required": ["color", "size"],
        "properties": {"color": {"enum": ["red", "green", "blue \"x\""]},
                       "size": {"anyOf": [{"type": "integer", "minimum": 1, "maximum": 9},
                                          {"type": "null"}]}},
    },
}


@pytest.mark.parametrize("name", list(SCHEMAS))
def test_json_schema_walks_always_parse_and_validate(
    name: str, compiler: ConstraintCompiler, tokenizer: Tokenizer
) -> None:
    schema = SCHEMAS[name]
    as_dict = schema.model_json_schema() if isinstance(schema, type(BaseModel)) else schema
    for seed in range(20):
        text = walk(compiler.matcher(schema), tokenizer, seed)
        jsonschema.validate(json.loads(text), as_dict)


def test_first_json_mask_allows_only_valid_starts(compiler: ConstraintCompiler,
                                                  tokenizer: Tokenizer) -> None:
    allowed = np.flatnonzero(compiler.matcher(SCHEMAS["array of objects"]).allowed_mask())
    assert len(allowed) > 0
    for token in allowed:
        assert tokenizer.decode([int(token)]).startswith("[")
    assert not bitmask_to_bool(compiler.matcher(Person).bitmask(), LOGITS_WIDTH)[VOCAB:].any()


def regex_prefix_ok(text: str) -> bool:
    return bool(re.fullmatch(r"[0-9]{0,3}|[0-9]{3}-[a-z]{0,4}", text))


def test_regex_masks_are_exact(compiler: ConstraintCompiler, tokenizer: Tokenizer) -> None:
    matcher = compiler.matcher(Constraint.regex(r"[0-9]{3}-[a-z]{1,4}"))
    pieces = [tokenizer.decode([t]) for t in range(VOCAB)]
    text = ""
    for step in "12", "3-", "ab":
        mask = matcher.allowed_mask()
        for token in range(VOCAB):
            if token in tokenizer.special_token_ids:
                assert mask[token] == (token == EOS_ID and
                                       re.fullmatch(r"[0-9]{3}-[a-z]{1,4}", text) is not None)
            elif "\ufffd" not in pieces[token]:
                assert mask[token] == regex_prefix_ok(text + pieces[token]), (text, pieces[token])
        for token in tokenizer.encode(step):
            assert matcher.accept(token)
        text += step
    assert matcher.is_accepting() and not matcher.is_terminated()
    assert matcher.allowed_mask()[EOS_ID]


def test_regex_and_choice_walks(compiler: ConstraintCompiler, tokenizer: Tokenizer) -> None:
    for seed in range(10):
        text = walk(compiler.matcher(Constraint.regex(r"\(\d{3}\) [a-z]+ ?")), tokenizer, seed)
        assert re.fullmatch(r"\(\d{3}\) [a-z]+ ?", text), text
    choices = ["yes", "no way", 'quo"te\\', "naïve", "a.b*c"]
    seen = {walk(compiler.matcher(choices), tokenizer, seed) for seed in range(40)}
    assert seen <= set(choices)
    assert len(seen) >= 3


def test_grammars(compiler: ConstraintCompiler, tokenizer: Tokenizer) -> None:
    lark = 'start: "(" NUMBER ("+" NUMBER)* ")"\nNUMBER: /[0-9]{1,3}/'
    gbnf = 'root ::= "x" [0-9] [0-9]? " end"'
    for seed in range(10):
        assert re.fullmatch(r"\(\d{1,3}(\+\d{1,3})*\)",
                            walk(compiler.matcher(Constraint.grammar(lark)), tokenizer, seed))
        assert re.fullmatch(r"x\d\d? end",
                            walk(compiler.matcher(Constraint.grammar(gbnf, "gbnf")), tokenizer,
                                 seed))


def test_rollback_restores_masks(compiler: ConstraintCompiler, tokenizer: Tokenizer) -> None:
    matcher = compiler.matcher(Person)
    for token in tokenizer.encode("{"):
        assert matcher.accept(token)
    before = matcher.bitmask()  # a key must start
    more = tokenizer.encode('"name": "Al')
    for token in more:
        assert matcher.accept(token)
    assert not np.array_equal(matcher.bitmask(), before)  # inside a string value
    matcher.rollback(len(more))
    assert np.array_equal(matcher.bitmask(), before)


def test_batched_masks_equal_single_masks(compiler: ConstraintCompiler,
                                          tokenizer: Tokenizer) -> None:
    matchers = [compiler.matcher(Person), compiler.matcher(["yes", "no"]),
                compiler.matcher(Constraint.regex("[a-c]+"))]
    for token in tokenizer.encode('{"na'):
        matchers[0].accept(token)
    bitmask = compiler.new_bitmask(4)
    compiler.fill_bitmasks([matchers[0], None, matchers[1], matchers[2]], bitmask)
    assert np.array_equal(bitmask[0], matchers[0].bitmask())
    assert not bitmask[1].any()
    assert np.array_equal(bitmask[2], matchers[1].bitmask())
    assert np.array_equal(bitmask[3], matchers[2].bitmask())
    as_bool = np.zeros(LOGITS_WIDTH, dtype=bool)
    matchers[1].fill_mask(as_bool)
    assert np.array_equal(as_bool, matchers[1].allowed_mask())


def test_incomplete_output_is_not_accepting(compiler: ConstraintCompiler,
                                            tokenizer: Tokenizer) -> None:
    matcher = build_matcher(Person, tokenizer, LOGITS_WIDTH)
    for token in tokenizer.encode('{"name": "Bo", "age": 4'):
        assert matcher.accept(token)
    assert not matcher.is_accepting() and not matcher.is_terminated()
    assert not matcher.accept(tokenizer.encode("}")[0])
    assert matcher.error


def test_as_constraint_coercions() -> None:
    assert as_constraint({"type": "string"}).kind == "json_schema"
    assert as_constraint(Person).kind == "json_schema"
    assert as_constraint(["a", "b"]).choices == ["a", "b"]
    assert as_constraint(re.compile("[0-9]+")) == Constraint.regex("[0-9]+")
    assert as_constraint("[0-9]+").kind == "regex"
    assert as_constraint('start: "a"').syntax == "lark"
    assert as_constraint('root ::= "a"').syntax == "gbnf"
    assert as_constraint('{"type": "integer"}').kind == "json_schema"
    spec = Constraint.json_schema({"type": "integer"}, flexible_whitespace=True)
    assert as_constraint(spec) is spec


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        (42, "constraint must be a JSON schema"),
        ([], "non-empty list of strings"),
        (["ok", ""], "choices must be non-empty strings"),
        (int, "is not a pydantic model class"),
    ],
)
def test_bad_constraints_raise_job_errors(bad: object, message: str) -> None:
    with pytest.raises(JobError, match=message):
        as_constraint(bad)


def test_invalid_patterns_fail_at_compile_time(compiler: ConstraintCompiler) -> None:
    with pytest.raises(JobError, match="(?s)invalid regex constraint.*look-around"):
        compiler.matcher(Constraint.regex("a(?=b)"))
    with pytest.raises(JobError, match="invalid grammar constraint"):
        compiler.matcher(Constraint.grammar("start: undefined_rule"))
    with pytest.raises(JobError, match="JSON object"):
        Constraint.json_schema("[1, 2]")


def test_masks_along_drafts_stop_at_completion_and_leave_the_matcher_as_found(
        compiler: ConstraintCompiler, tokenizer: Tokenizer) -> None:
    """`masks_along` gives one mask per allowed token plus one, stops at completion (a
    complete matcher takes EOS without counting it, so a rollback would undo real tokens),
    and leaves the matcher's state as it was."""
    matcher = compiler.matcher(["yes", "no way"])
    ids = tokenizer.encode("yes")
    before = matcher.bitmask().copy()
    masks = matcher.masks_along([*ids, EOS_ID, EOS_ID])
    assert len(masks) == len(ids) + 1  # "yes" completes it: nothing after is taken
    assert (matcher.bitmask() == before).all()
    for token in ids:
        assert matcher.accept(token)
    assert matcher.is_terminated()
    matcher.rollback(len(ids))
    assert (matcher.bitmask() == before).all()
    other = tokenizer.encode("no way")
    assert len(matcher.masks_along([other[0], ids[0]])) == 2  # the second is not allowed
