"""The prompt a forwarded request will run, as token ids: what a request router hashes.

Chat requests are rendered by the same code as the server's (`jobs.chat_prompt_ids`: the
model's chat template, tools included), completions requests are encoded by the same code too
(`jobs.completion_prompt_ids`; a request of several prompts is routed by its first). Imports
neither torch nor Ray: the router's process (the ingress) only needs the tokenizer.
"""

from __future__ import annotations

import json

from pydantic import ValidationError

from dyngen_core import Tokenizer
from dyngen_core.serve.errors import RequestError
from dyngen_core.serve.jobs import chat_prompt_ids, completion_prompt_ids
from dyngen_core.serve.replicas.forwarding import ForwardedRequest
from dyngen_core.serve.schemas import ChatCompletionRequest, CompletionRequest

CHAT_PATH = "/v1/chat/completions"
COMPLETIONS_PATH = "/v1/completions"


def routing_prompt(tokenizer: Tokenizer, request: ForwardedRequest) -> list[int] | None:
    """The prompt token ids ``request`` will run, or None when it runs none (another endpoint)
    or is invalid (the replica answers it with the server's 400; any replica will do)."""
    if request.method != "POST" or request.path not in (CHAT_PATH, COMPLETIONS_PATH):
        return None
    try:
        body = json.loads(request.body)
        if request.path == CHAT_PATH:
            return chat_prompt_ids(tokenizer, ChatCompletionRequest.model_validate(body))
        prompts = completion_prompt_ids(tokenizer, CompletionRequest.model_validate(body))
        return prompts[0] if prompts else None
    except (ValueError, ValidationError, RequestError):
        return None
