"""The server through the official ``openai`` client, on the demo model: chat and completions,
streamed and not, sampling fields, logprobs, usage, tools and structured output."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest

from dyngen_core import BackgroundGenerator, Job, SamplerSettings
from tests.serve.conftest import MODEL, idle_stats

pytestmark = pytest.mark.demo

QUESTION = [{"role": "user", "content": "Name three colours of the rainbow."}]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
ADD = {"type": "function", "function": {
    "name": "add", "description": "Add two integers.",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"},
                                                    "b": {"type": "integer"}},
                   "required": ["a", "b"]}}}


def engine_text(engine: BackgroundGenerator, messages: list[dict[str, Any]],
                max_tokens: int) -> str:
    """The greedy reply the engine gives in-process, for comparison."""
    tokenizer = engine.tokenizer
    prompt = tokenizer.encode(tokenizer.apply_chat_template(messages), encode_special_tokens=True)
    job = Job(input_ids=prompt, max_new_tokens=max_tokens,
              stop_conditions=list(tokenizer.eos_token_ids),
              gen_settings=SamplerSettings.greedy())
    return engine.submit(job).text(timeout=120)


def test_models_and_health(client: Any, server: Any) -> None:
    import httpx

    assert [m.id for m in client.models.list().data] == [MODEL]
    assert client.models.retrieve(MODEL).owned_by == "dyngen"
    assert httpx.get(server.base_url + "/health").json() == {"status": "ok"}


def test_a_greedy_chat_reply_is_the_engines_and_streams_the_same(
        client: Any, engine: BackgroundGenerator) -> None:
    reply = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=10,
                                           temperature=0)
    text = reply.choices[0].message.content
    assert text == engine_text(engine, QUESTION, 10)
    assert reply.choices[0].finish_reason == "length"
    assert reply.usage.completion_tokens == 10
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + 10
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=QUESTION, max_tokens=10, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert {c.object for c in chunks} == {"chat.completion.chunk"}
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    usage = chunks[-1].usage
    assert not chunks[-1].choices and usage.completion_tokens == 10
    # The same prompt again: its pages come from the prompt cache.
    assert usage.prompt_tokens_details.cached_tokens > 0


def test_stop_max_completion_tokens_and_n(client: Any) -> None:
    whole = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=10,
                                           temperature=0).choices[0].message.content
    word = [w for w in whole.split() if len(w) > 2][1]
    stopped = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=10,
                                             temperature=0, stop=[word])
    assert stopped.choices[0].message.content == whole[:whole.index(word)]
    assert stopped.choices[0].finish_reason == "stop"
    short = client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0,
                                           max_completion_tokens=3, n=2)
    assert [c.index for c in short.choices] == [0, 1]
    assert {c.message.content for c in short.choices} == {short.choices[0].message.content}
    assert short.usage.completion_tokens == 6


def test_a_seed_makes_sampling_reproducible(client: Any) -> None:
    def sample(seed: int) -> list[str]:
        reply = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=8,
                                               temperature=1.0, seed=seed, n=2)
        return [c.message.content for c in reply.choices]

    first = sample(7)
    assert sample(7) == first
    assert len(set(first + sample(8))) > 1
    streamed = ["", ""]
    for chunk in client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=8,
                                                temperature=1.0, seed=7, n=2, stream=True):
        for choice in chunk.choices:
            streamed[choice.index] += choice.delta.content or ""
    assert streamed == first


def test_logprobs_list_the_top_alternatives(client: Any) -> None:
    reply = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=5,
                                           temperature=0, logprobs=True, top_logprobs=3)
    content = reply.choices[0].logprobs.content
    assert len(content) == 5
    assert "".join(t.token for t in content) == reply.choices[0].message.content
    for token in content:
        alternatives = [t.logprob for t in token.top_logprobs]
        assert len(alternatives) == 3 and alternatives == sorted(alternatives, reverse=True)
        assert token.top_logprobs[0].token == token.token  # greedy takes the likeliest
        assert token.logprob == pytest.approx(alternatives[0], abs=1e-5) and token.logprob <= 0


def test_completions_take_several_prompts_and_stream(client: Any) -> None:
    prompts = ["The capital of France is", "One, two, three,"]
    reply = client.completions.create(model=MODEL, prompt=prompts, max_tokens=6,
                                      temperature=0, logprobs=2)
    assert [c.index for c in reply.choices] == [0, 1]
    assert all(len(c.logprobs.tokens) == 6 for c in reply.choices)
    assert reply.choices[0].logprobs.tokens[0] in reply.choices[0].text
    assert reply.usage.completion_tokens == 12
    streamed = list(client.completions.create(model=MODEL, prompt=prompts[0], max_tokens=6,
                                              temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in streamed) == reply.choices[0].text
    assert {c.object for c in streamed} == {"text_completion"}


def test_a_prompt_of_token_ids_and_ignore_eos(client: Any, engine: BackgroundGenerator
                                              ) -> None:
    """A prompt given as token ids (as OpenAI's API allows) runs as its text does; with
    ``ignore_eos`` a reply pushed onto the end-of-sequence token still runs to max_tokens."""
    text = "The capital of France is"
    ids = engine.tokenizer.encode(text)
    by_text = client.completions.create(model=MODEL, prompt=text, max_tokens=6, temperature=0)
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=6, temperature=0)
    assert by_ids.choices[0].text == by_text.choices[0].text
    assert by_ids.usage.prompt_tokens == len(ids)
    eos = {str(engine.tokenizer.eos_token_ids[0]): 100}
    ended = client.completions.create(model=MODEL, prompt=[ids, ids], max_tokens=5,
                                      temperature=0, logit_bias=eos)
    assert [c.finish_reason for c in ended.choices] == ["stop", "stop"]
    assert ended.usage.completion_tokens == 2
    forced = client.completions.create(model=MODEL, prompt=[ids, ids], max_tokens=5,
                                       temperature=0, logit_bias=eos,
                                       extra_body={"ignore_eos": True})
    assert [c.finish_reason for c in forced.choices] == ["length", "length"]
    assert forced.usage.completion_tokens == 10


def test_a_named_tool_choice_forces_that_call_streamed_or_not(client: Any) -> None:
    ask = [{"role": "user", "content": "What is 2 plus 3?"}]
    reply = client.chat.completions.create(model=MODEL, messages=ask, tools=[WEATHER, ADD],
                                           tool_choice={"type": "function",
                                                        "function": {"name": "add"}},
                                           max_tokens=40, temperature=0)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls
    arguments = json.loads(call.function.arguments)
    assert call.function.name == "add" and call.id.startswith("call_")
    jsonschema.validate(arguments, ADD["function"]["parameters"])
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=ask, tools=[WEATHER, ADD], tool_choice="required",
        parallel_tool_calls=False, max_tokens=40, temperature=0, stream=True))
    deltas = [d for c in chunks for d in (c.choices[0].delta.tool_calls or [])]
    assert len(deltas) == 1 and deltas[0].index == 0 and deltas[0].id.startswith("call_")
    assert deltas[0].function.name in {"add", "get_weather"}
    json.loads(deltas[0].function.arguments)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_parallel_calls_and_tool_results(client: Any) -> None:
    history: list[dict[str, Any]] = [
        {"role": "user", "content": "How is the weather in Paris and in Oslo?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
            {"id": "call_2", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "call_2", "content": "rainy"},
        {"role": "assistant", "content": "Paris is sunny and Oslo is rainy."},
        {"role": "user", "content": "How is the weather in Rome and in Madrid?"},
    ]
    reply = client.chat.completions.create(model=MODEL, messages=history, tools=[WEATHER],
                                           tool_choice="required", max_tokens=40,
                                           temperature=0)
    calls = reply.choices[0].message.tool_calls
    assert [c.function.name for c in calls] == ["get_weather", "get_weather"]
    assert {json.loads(c.function.arguments)["city"] for c in calls} == {"Rome", "Madrid"}
    assert len({c.id for c in calls}) == 2
    plain = client.chat.completions.create(model=MODEL, messages=history[:4], tools=[WEATHER],
                                           tool_choice="none", max_tokens=12, temperature=0)
    assert not plain.choices[0].message.tool_calls and plain.choices[0].message.content


def test_response_format_holds_the_reply_to_a_schema(client: Any) -> None:
    schema = {"type": "object", "properties": {"name": {"type": "string"},
                                               "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False}
    ask = [{"role": "user", "content": "Invent a person; give a name and an age."}]
    reply = client.chat.completions.create(
        model=MODEL, messages=ask, max_tokens=40, temperature=0,
        response_format={"type": "json_schema",
                         "json_schema": {"name": "person", "schema": schema}})
    jsonschema.validate(json.loads(reply.choices[0].message.content), schema)
    assert reply.choices[0].finish_reason == "stop"
    loose = client.chat.completions.create(model=MODEL, messages=ask, max_tokens=40,
                                           temperature=0,
                                           response_format={"type": "json_object"})
    assert isinstance(json.loads(loose.choices[0].message.content), dict)


def test_stop_sequences_never_cut_a_forced_call_or_a_schema(client: Any) -> None:
    """The stop sequences "a" and '"' occur in the call ``{"a": 2, "b": 3}`` and in any JSON:
    they end free text, never what a forced tool call or a response format writes."""
    ask = [{"role": "user", "content": "What is 2 plus 3?"}]
    for choice in ({"type": "function", "function": {"name": "add"}}, "required"):
        reply = client.chat.completions.create(model=MODEL, messages=ask, tools=[WEATHER, ADD],
                                               tool_choice=choice, max_tokens=40, temperature=0,
                                               stop=["a", '"'])
        assert reply.choices[0].finish_reason == "tool_calls", reply.choices[0]
        [call] = reply.choices[0].message.tool_calls
        jsonschema.validate(json.loads(call.function.arguments),
                            ADD["function"]["parameters"])
    schema = {"type": "object", "properties": {"name": {"type": "string"},
                                               "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False}
    reply = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Invent a person."}], max_tokens=40,
        temperature=0, stop=[":", "name"],
        response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": schema}})
    jsonschema.validate(json.loads(reply.choices[0].message.content), schema)
    # Under tool_choice "auto" this question gets text, which a stop sequence still ends.
    reply = client.chat.completions.create(model=MODEL, messages=QUESTION, tools=[WEATHER, ADD],
                                           tool_choice="auto", max_tokens=40, temperature=0,
                                           stop=[","])
    choice = reply.choices[0]
    assert choice.finish_reason == "stop" and not choice.message.tool_calls, choice
    assert choice.message.content and "," not in choice.message.content


def test_the_metrics_show_engine_and_request_figures(client: Any, server: Any,
                                                     engine: BackgroundGenerator) -> None:
    import httpx

    client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=2)
    idle_stats(engine)
    text = httpx.get(server.base_url + "/metrics").text
    reused = engine.stats().prefill_tokens_reused
    assert f'dyngen_prefill_tokens_reused_total{{model="{MODEL}"}} {reused}' in text
    assert 'dyngen_jobs_active{model="demo"} 0' in text
    assert 'endpoint="/v1/chat/completions",status="200"' in text
