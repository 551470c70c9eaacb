"""The langchain-tests standard suites for ChatDynGen, run against the demo model.

Capabilities declared here are all real: tool calling with tool_choice (forced calls are
constrained), structured output (json_schema by constrained decoding), JSON mode, usage
metadata with prefix-cache reads, per-call model override (a model folder). Multimodal flags
stay false: dyngen's models are text-only. Any xfail below names a limit of the 135M demo
model, with the evidence in its reason.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from langchain_core.messages import AIMessage
from langchain_dyngen import ChatDynGen
from langchain_tests.integration_tests import ChatModelIntegrationTests
from langchain_tests.unit_tests import ChatModelUnitTests


class TestChatDynGenUnit(ChatModelUnitTests):
    @pytest.fixture(autouse=True)
    def _demo(self, demo_params: dict[str, Any]) -> None:
        self.demo_params = demo_params

    @property
    def chat_model_class(self) -> type[ChatDynGen]:
        return ChatDynGen

    @property
    def chat_model_params(self) -> dict[str, Any]:
        return dict(self.demo_params)

    @property
    def standard_chat_model_params(self) -> dict[str, Any]:
        # A local engine has no API key and makes no network requests to retry: ChatDynGen
        # rejects `api_key` and `max_retries` instead of silently ignoring them.
        params = super().standard_chat_model_params
        return {k: v for k, v in params.items() if k not in ("api_key", "max_retries")}

    @property
    def supports_json_mode(self) -> bool:
        return True


class TestChatDynGenIntegration(ChatModelIntegrationTests):
    @pytest.fixture(autouse=True)
    def _demo(self, demo_params: dict[str, Any]) -> None:
        self.demo_params = demo_params

    @property
    def chat_model_class(self) -> type[ChatDynGen]:
        return ChatDynGen

    @property
    def chat_model_params(self) -> dict[str, Any]:
        return {**self.demo_params, "temperature": 0, "max_tokens": 48}

    @property
    def supports_json_mode(self) -> bool:
        return True

    @property
    def supported_usage_metadata_details(self) -> dict[str, list[Any]]:
        return {"invoke": ["cache_read_input"], "stream": ["cache_read_input"]}

    @property
    def model_override_value(self) -> str:
        return str(demo_model_alias(Path(self.demo_params["model_dir"])))

    def invoke_with_cache_read_input(self, *, stream: bool = False) -> AIMessage:
        """A prompt longer than a page, sent twice: the second reads it from the prompt
        cache."""
        model = ChatDynGen(**self.chat_model_params)
        prompt = "Summarize: " + " ".join(f"Fact {i}: the sky is blue." for i in range(60))
        model.invoke(prompt, max_tokens=1)
        if not stream:
            return model.invoke(prompt, max_tokens=4)  # type: ignore[return-value]
        full = None
        for chunk in model.stream(prompt, max_tokens=4):
            full = chunk if full is None else full + chunk
        assert full is not None
        return full  # type: ignore[return-value]


def demo_model_alias(model_dir: Path) -> Path:
    """Another path naming the demo folder: a per-call ``model`` override resolves to the same
    engine (no second load) and reports the path it was given as model_name."""
    alias = model_dir.parent / f"{model_dir.name}-alias"
    if not alias.exists():
        alias.symlink_to(model_dir, target_is_directory=True)
    return alias
