"""Bad requests get OpenAI-shaped errors naming the field, through the ``openai`` client; the
API key is checked; a client that leaves cancels its jobs and frees their pages."""

from __future__ import annotations

import time
from typing import Any

import httpx
import openai
import pytest

from dyngen_core import BackgroundGenerator
from tests.serve.conftest import API_KEY, MODEL, idle_stats

pytestmark = pytest.mark.demo

HI = [{"role": "user", "content": "Hi"}]
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}


@pytest.mark.parametrize(("fields", "param", "words"), [
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages.0.role", "Input should be"),
    ({"messages": []}, "messages", "at least 1"),
    ({"temperature": 5}, "temperature", "less than or equal to 2"),
    ({"top_logprobs": 3}, "top_logprobs", "needs logprobs"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop", "at most 4"),
    ({"n": 5}, "n", "at most 4 choices"),
    ({"max_tokens": 10**6}, "max_tokens", "exceeds this model's context"),
    ({"logit_bias": {"abc": 1}}, "logit_bias", "token ids"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice", "not one of the bound tools"),
    ({"response_format": {"type": "json_schema"}}, "response_format", "needs a 'json_schema'"),
    ({"tools": [WEATHER], "tool_choice": "required",
      "response_format": {"type": "json_object"}}, "response_format", "cannot be combined"),
    ({"response_format": {"type": "json_schema",
                          "json_schema": {"name": "x", "schema": {"type": "bogus"}}}},
     "response_format", ""),
])
def test_a_bad_chat_request_is_a_400_naming_the_field(client: Any, fields: dict[str, Any],
                                                      param: str, words: str) -> None:
    request = {"model": MODEL, "messages": HI, "max_tokens": 2, **fields}
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(**request)
    error = caught.value.body
    assert caught.value.status_code == 400
    assert error["type"] == "invalid_request_error" and error["param"] == param
    assert words in error["message"]


def test_completion_fields_the_server_does_not_implement_are_refused(client: Any) -> None:
    for fields, param in (({"echo": True}, "echo"), ({"suffix": "end"}, "suffix"),
                          ({"best_of": 3}, "best_of"), ({"prompt": []}, "prompt")):
        with pytest.raises(openai.BadRequestError) as caught:
            client.completions.create(**{"model": MODEL, "prompt": "Hi", "max_tokens": 2,
                                         **fields})
        assert caught.value.body["param"] == param


def test_an_unknown_model_route_or_body(client: Any, server: Any) -> None:
    with pytest.raises(openai.NotFoundError) as caught:
        client.chat.completions.create(model="gpt-4o", messages=HI)
    assert caught.value.body["code"] == "model_not_found"
    assert caught.value.body["param"] == "model"
    missing = httpx.get(server.base_url + "/v1/nothing")
    assert missing.status_code == 404 and missing.json()["error"]["type"] == "not_found_error"
    broken = httpx.post(server.base_url + "/v1/chat/completions", content=b"{not json",
                        headers={"content-type": "application/json"})
    assert broken.status_code == 400
    assert "not valid JSON" in broken.json()["error"]["message"]


def test_the_api_key_is_required_when_set(keyed_server: Any) -> None:
    url = keyed_server.base_url
    for key in (None, "wrong", API_KEY + "x"):
        headers = {} if key is None else {"Authorization": f"Bearer {key}"}
        answer = httpx.get(url + "/v1/models", headers=headers)
        assert answer.status_code == 401
        assert answer.json()["error"]["code"] == "invalid_api_key"
    keyed = openai.OpenAI(base_url=url + "/v1", api_key=API_KEY, max_retries=0)
    assert [m.id for m in keyed.models.list().data] == [MODEL]
    reply = keyed.chat.completions.create(model=MODEL, messages=HI, max_tokens=2)
    assert reply.usage.completion_tokens == 2
    assert httpx.get(url + "/health").status_code == 200  # probes need no key


def _no_eos(engine: BackgroundGenerator) -> dict[str, float]:
    """A logit bias that keeps the model from ending its reply."""
    return {str(token): -100 for token in engine.tokenizer.eos_token_ids}


def _wait_until_idle_within(engine: BackgroundGenerator, seconds: float) -> Any:
    """The stats once the engine runs nothing; fails if that takes longer than ``seconds``."""
    start = time.monotonic()
    stats = idle_stats(engine, limit_s=seconds)
    assert time.monotonic() - start < seconds
    return stats


def test_a_stream_whose_client_leaves_cancels_its_job(server: Any,
                                                      engine: BackgroundGenerator) -> None:
    idle_stats(engine)
    # 2000 tokens (no end-of-sequence token) would take minutes on the CPU; leaving after a
    # few must free the job at once.
    body = {"model": MODEL, "messages": HI, "max_tokens": 2000, "stream": True,
            "logit_bias": _no_eos(engine)}
    with httpx.Client(base_url=server.base_url, timeout=60) as http, \
            http.stream("POST", "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200
        events = 0
        for line in response.iter_lines():
            events += line.startswith("data:")
            if events == 4:
                break
        assert engine.stats().jobs_active == 1
    stats = _wait_until_idle_within(engine, 10)
    assert stats.pages_referenced == 0 and stats.jobs_active == 0
    metrics = httpx.get(server.base_url + "/metrics").text
    assert "dyngen_client_disconnects_total 0" not in metrics


def test_a_whole_answer_whose_client_leaves_cancels_its_job(
        server: Any, engine: BackgroundGenerator) -> None:
    idle_stats(engine)
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 2000,
            "logit_bias": _no_eos(engine)}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.base_url + "/v1/completions", json=body, timeout=1.5)
    stats = _wait_until_idle_within(engine, 10)
    assert stats.pages_referenced == 0 and stats.jobs_active == 0
