"""JSON-schema constrained output from the real demo model always parses and validates
(20 seeds per schema: nested objects, enums, arrays, optional fields), and regex / choice
constraints hold."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from dyngen_core import DynamicGenerator, SamplerSettings
from dyngen_core.text.constraints import Constraint

pytestmark = pytest.mark.demo

SCHEMAS: dict[str, dict[str, Any]] = {
    "nested object with enum": {
        "type": "object", "additionalProperties": False, "required": ["name", "home"],
        "properties": {
            "name": {"type": "string", "maxLength": 16},
            "home": {"type": "object", "additionalProperties": False,
                     "required": ["city", "kind"],
                     "properties": {"city": {"type": "string", "maxLength": 16},
                                    "kind": {"enum": ["house", "flat", "boat"]}}},
        },
    },
    "array with optional fields": {
        "type": "array", "minItems": 1, "maxItems": 2,
        "items": {"type": "object", "additionalProperties": False, "required": ["animal"],
                  "properties": {"animal": {"type": "string", "maxLength": 8},
                                 "legs": {"type": "integer", "minimum": 0, "maximum": 8},
                                 "wild": {"type": "boolean"}}},
    },
    "numbers and nullable": {
        "type": "object", "additionalProperties": False, "required": ["score", "grade", "note"],
        "properties": {"score": {"type": "integer", "minimum": 0, "maximum": 100},
                       "grade": {"enum": ["A", "B", "C"]},
                       "note": {"anyOf": [{"type": "string", "maxLength": 10},
                                          {"type": "null"}]}},
    },
}


@pytest.fixture(scope="module")
def generator(demo_model_dir: Path) -> DynamicGenerator:
    return DynamicGenerator.from_model_dir(demo_model_dir, cache_tokens=16384)


def chat(generator: DynamicGenerator, question: str) -> str:
    return str(generator.tokenizer.apply_chat_template([{"role": "user", "content": question}]))


@pytest.mark.parametrize("name", list(SCHEMAS))
def test_json_schema_output_validates_for_20_seeds(generator: DynamicGenerator,
                                                   name: str) -> None:
    schema = SCHEMAS[name]
    prompt = chat(generator, f"Reply with JSON for this schema: {json.dumps(schema)}")
    texts = generator.generate([prompt] * 20, max_new_tokens=160, encode_special_tokens=True,
                               gen_settings=SamplerSettings(temperature=1.0, top_p=0.95),
                               seed=1000, constraint=schema)
    assert len(set(texts)) > 1  # the seeds really differ
    for text in texts:
        jsonschema.validate(json.loads(text), schema)


def test_regex_and_choice_constraints(generator: DynamicGenerator) -> None:
    prompt = chat(generator, "Give a date.")
    dates = generator.generate([prompt] * 4, max_new_tokens=20, encode_special_tokens=True,
                               seed=5, constraint=Constraint.regex(r"[0-9]{4}-[0-9]{2}-[0-9]{2}"))
    assert all(re.fullmatch(r"[0-9]{4}-[0-9]{2}-[0-9]{2}", d) for d in dates), dates
    answers = generator.generate([chat(generator, "Is water wet?")] * 4, max_new_tokens=8,
                                 encode_special_tokens=True, seed=5,
                                 constraint=["yes", "no", "maybe"])
    assert set(answers) <= {"yes", "no", "maybe"}
