"""Constrained decoding: JSON that always parses and validates, plus a regex and a choice.

The constraint is compiled into a token mask for every step (llguidance), so even a 135M-parameter
model can only produce text the schema allows. A constraint takes a pydantic model class, a JSON
schema dict, a regex, a Lark/GBNF grammar, or a list of choices.
"""

from __future__ import annotations

from _demo import model_dir
from pydantic import BaseModel, ConfigDict, Field

from dyngen_core import DynamicGenerator, SamplerSettings
from dyngen_core.constraints import Constraint


class City(BaseModel):
    model_config = ConfigDict(extra="forbid")  # no keys beyond these

    name: str = Field(max_length=40)
    country: str = Field(max_length=40)
    population_thousands: int = Field(ge=0, le=50000)
    landmarks: list[str] = Field(max_length=3)
    capital: bool


generator = DynamicGenerator.from_model_dir(model_dir(), cache_tokens=16384)
tokenizer = generator.tokenizer
settings = SamplerSettings(temperature=0.7, top_p=0.9)


def chat(question: str) -> str:
    return tokenizer.apply_chat_template([{"role": "user", "content": question}])


cities = ["Paris", "Tokyo", "Nairobi", "Lima"]
prompts = [chat(f"Describe {city} as a JSON object with the keys name, country, "
                "population_thousands, landmarks and capital.") for city in cities]
texts = generator.generate(prompts, max_new_tokens=160, encode_special_tokens=True,
                           gen_settings=settings, seed=7, constraint=City)
for text in texts:
    city = City.model_validate_json(text)  # always parses and validates
    print(city)

date = generator.generate(chat("When did the first person walk on the moon? Answer as a date."),
                          max_new_tokens=16, encode_special_tokens=True,
                          constraint=Constraint.regex(r"[0-9]{4}-[0-9]{2}-[0-9]{2}"))
print("date:", date)
answer = generator.generate(chat("Is the sea salty? Answer yes or no."), max_new_tokens=4,
                            encode_special_tokens=True, constraint=["yes", "no"])
print("answer:", answer)
