"""Two engine replicas on Ray Serve, routed by page hashes, through the official OpenAI client.

Starts a local Ray instance (or joins $RAY_ADDRESS), deploys two replicas of the model (the demo
model unless a folder is given as the first argument) behind one OpenAI endpoint, and asks
questions about two documents in turn: each document's questions land on the replica whose
prompt cache holds its pages (the response header ``x-dyngen-replica``), and their prompt tokens
come from that cache (``usage.prompt_tokens_details.cached_tokens``).

The same as ``dyngen serve --model DIR --replicas 2 --port 8000`` plus a client.
Needs ``pip install 'dyngen-core[replicas]' openai``.
"""

from __future__ import annotations

import os

import openai
import ray
from _demo import model_dir
from ray import serve

from dyngen_core import EngineOptions
from dyngen_core.serve.options import ServeOptions
from dyngen_core.serve.replicas.deployment import build_replicas_app
from dyngen_core.serve.replicas.options import ReplicaOptions

PORT = int(os.environ.get("DYNGEN_PORT", "8000"))
DOCUMENTS = {
    name: "\n".join(f"{name}, note {i}: shelf {i % 9} holds {10 + 7 * i % 50} {item}."
                    for i in range(60))
    for name, item in (("Archive", "maps"), ("Workshop", "tools"))}

ray.init(address=os.environ.get("RAY_ADDRESS"), num_cpus=None if os.environ.get(
    "RAY_ADDRESS") else 2, include_dashboard=False)
try:
    serve.start(http_options={"host": "127.0.0.1", "port": PORT})
    options = ServeOptions(model_dir=str(model_dir()),
                           engine_options=EngineOptions(cache_tokens=4096, max_batch_size=16))
    serve.run(build_replicas_app(options, ReplicaOptions(replicas=2)), name="dyngen",
              route_prefix="/")
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{PORT}/v1", api_key="-")
    for shelf in range(3):
        for name, document in DOCUMENTS.items():
            raw = client.chat.completions.with_raw_response.create(
                model=options.model_name, max_tokens=12, temperature=0,
                messages=[{"role": "system", "content": f"Answer from the {name} notes."},
                          {"role": "user", "content": f"{document}\n\nWhat is on shelf "
                                                      f"{shelf}?"}])
            reply, usage = raw.parse(), raw.parse().usage
            details = usage.prompt_tokens_details if usage else None
            cached = details.cached_tokens if details else 0
            print(f"{name:9} replica {raw.headers['x-dyngen-replica']}: {cached} prompt tokens "
                  f"cached -> {reply.choices[0].message.content!r}")
finally:
    serve.shutdown()
    ray.shutdown()
