"""The official OpenAI client against ``dyngen serve``: a reply, a stream, a tool call and a
reply held to a JSON schema.

Against a running server (``dyngen serve --model DIR --port 8000``), set
``DYNGEN_SERVER_URL=http://127.0.0.1:8000``; otherwise the example starts one in this process
over the demo model (the model folder may also be given as the first argument).
Needs ``pip install 'dyngen-core[serve]' openai``.
"""

from __future__ import annotations

import json
import os
from contextlib import ExitStack

import openai
from _demo import model_dir

from dyngen_core.serve.options import ServeOptions
from dyngen_core.serve.server import ServerThread, build_app

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
PERSON = {"type": "object", "properties": {"name": {"type": "string"},
                                           "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}

with ExitStack() as stack:
    url = os.environ.get("DYNGEN_SERVER_URL")
    if url is None:
        options = ServeOptions(model_dir=str(model_dir()))
        url = stack.enter_context(ServerThread(build_app(options))).base_url
    client = openai.OpenAI(base_url=url + "/v1", api_key=os.environ.get("DYNGEN_API_KEY", "-"))
    model = client.models.list().data[0].id

    reply = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "What is a paged KV cache?"}],
        max_tokens=60, temperature=0)
    print(reply.choices[0].message.content)
    print("usage:", reply.usage.model_dump(exclude_none=True))

    for chunk in client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "Count from one to five."}],
            max_tokens=30, stream=True):
        print(chunk.choices[0].delta.content or "", end="", flush=True)
    print()

    called = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "How is the weather in Oslo?"}],
        tools=[WEATHER], tool_choice="required", max_tokens=40, temperature=0)
    for call in called.choices[0].message.tool_calls or []:
        print("tool call:", call.function.name, json.loads(call.function.arguments))

    person = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Invent a person."}],
        response_format={"type": "json_schema",
                         "json_schema": {"name": "person", "schema": PERSON}},
        max_tokens=40, temperature=0)
    print("person:", json.loads(person.choices[0].message.content or "{}"))
