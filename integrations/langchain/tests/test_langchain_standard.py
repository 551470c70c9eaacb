"""The langchain-tests standard suites for ChatDynGen, run against the demo model.

Capabilities declared here are all real: tool calling with tool_choice (forced calls are
constrained), structured output (json_schema by constrained decoding), JSON mode, usage
metadata with prefix-cache reads, per-call model override (a model folder). Multimodal flags
stay false: dyngen's models are text-only.

Each xfail below names a limit of the 135M demo model (greedy decoding), with the model's own
output as evidence, and accepts only the failure that limit causes (``raises=``): the adapter's
part — constraint, parsing, ids, metadata — is checked by the other assertions and by this
package's own tests.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from langchain_core.exceptions import OutputParserException
from langchain_core.language_models import BaseChatModel
from langchain_core.messages import AIMessage
from langchain_dyngen import ChatDynGen
from langchain_tests.integration_tests import ChatModelIntegrationTests
from langchain_tests.unit_tests import ChatModelUnitTests
from syrupy.assertion import SnapshotAssertion

from integrations.langchain.tests.standard_suite import SERDES_ALLOWLIST


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

    @property
    def init_from_env_params(self) -> tuple[dict[str, str], dict[str, Any], dict[str, Any]]:
        # The folder from $DYNGEN_MODEL_DIR; serialized objects name that variable (test_serdes).
        folder = self.demo_params["model_dir"]
        return {"DYNGEN_MODEL_DIR": folder}, {}, {"model_dir": folder}

    @pytest.mark.xfail(reason=SERDES_ALLOWLIST, raises=ValueError, strict=True)
    def test_serdes(self, model: BaseChatModel, snapshot: SnapshotAssertion) -> None:
        super().test_serdes(model, snapshot)


# Evidence: what SmolLM2-135M-Instruct answered (greedy) in these tests.
LOOPS_IN_STRING = (
    "135M demo model limit: inside the schema-constrained JSON it loops in the first string "
    "and never closes it before max_tokens, so required keys are missing; it answered "
    '\'{"setup": "A cat is a cat, right? A cat is a cat, a cat is a cat, a cat is a cat, ...\' '
    "(still looping at 160 tokens). A repetition penalty (1.2) breaks the loop but makes the "
    "model miscopy tool arguments (magic_function(3) became input 256), so the suite stays greedy"
)
LOOPS_IN_STRING_PARAMS = (
    LOOPS_IN_STRING + ". The typeddict and json_schema variants get the same looping output "
    "but pass (XPASS): their check accepts a partial dict"
)
JSON_MODE_KEYS = (
    "135M demo model limit: JSON mode constrains the reply to a JSON object, not its keys, and "
    "the model leaves out 'punchline' although the prompt asks for it: "
    '\'{"setup": "The cat was having a cat-themed party, and the cat had a cat-themed '
    'punchline."}\''
)
NO_CALL_UNDER_AUTO = (
    "135M demo model limit: with tool_choice='auto' it answers in prose instead of calling "
    "get_weather: 'The weather in San Francisco, CA, is mostly sunny with a high of 75°F ...'"
)
LOOPS_IN_ARGUMENT = (
    "135M demo model limit: the forced call copies customer_name '你好啊集团' correctly, then "
    "loops in 'description' ('A Chinese technology company that specializes in creating a "
    "customer with Unicode name. This company is ...') and never closes the call before "
    "max_tokens (still looping at 160 tokens), so it is reported as an invalid tool call"
)


class TestChatDynGenIntegration(ChatModelIntegrationTests):
    @pytest.fixture(autouse=True)
    def _demo(self, demo_params: dict[str, Any]) -> None:
        self.demo_params = demo_params

    @property
    def chat_model_class(self) -> type[ChatDynGen]:
        return ChatDynGen

    @property
    def chat_model_params(self) -> dict[str, Any]:
        return {**self.demo_params, "temperature": 0, "max_tokens": 32}

    @property
    def supports_json_mode(self) -> bool:
        return True

    @property
    def supported_usage_metadata_details(self) -> dict[str, list[Any]]:
        return {"invoke": ["cache_read_input"], "stream": ["cache_read_input"]}

    @property
    def supports_anthropic_inputs(self) -> bool:
        # Anthropic-format tools and content blocks (text, tool_use, thinking): text only.
        return True

    @property
    def enable_vcr_tests(self) -> bool:
        # A local engine makes no HTTP requests to record: the test streams a reply.
        return True

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

    @pytest.mark.xfail(reason=LOOPS_IN_STRING_PARAMS, raises=OutputParserException, strict=False)
    @pytest.mark.parametrize("schema_type", ["pydantic", "typeddict", "json_schema"])
    def test_structured_output(self, model: BaseChatModel, schema_type: Any) -> None:
        super().test_structured_output(model, schema_type)

    @pytest.mark.xfail(reason=LOOPS_IN_STRING_PARAMS, raises=OutputParserException, strict=False)
    @pytest.mark.parametrize("schema_type", ["pydantic", "typeddict", "json_schema"])
    async def test_structured_output_async(self, model: BaseChatModel, schema_type: Any) -> None:
        await super().test_structured_output_async(model, schema_type)

    @pytest.mark.xfail(reason=LOOPS_IN_STRING, raises=OutputParserException, strict=False)
    def test_structured_output_pydantic_2_v1(self, model: BaseChatModel) -> None:
        super().test_structured_output_pydantic_2_v1(model)

    @pytest.mark.xfail(reason=JSON_MODE_KEYS, raises=OutputParserException, strict=False)
    def test_json_mode(self, model: BaseChatModel) -> None:
        super().test_json_mode(model)

    @pytest.mark.xfail(reason=NO_CALL_UNDER_AUTO, raises=AssertionError, strict=False)
    @pytest.mark.parametrize("model", [{}, {"output_version": "v1"}], indirect=True)
    def test_agent_loop(self, model: BaseChatModel) -> None:
        super().test_agent_loop(model)

    @pytest.mark.xfail(reason=LOOPS_IN_ARGUMENT, raises=AssertionError, strict=False)
    def test_unicode_tool_call_integration(
        self, model: BaseChatModel, *, tool_choice: str | None = None,
        force_tool_call: bool = True,
    ) -> None:
        super().test_unicode_tool_call_integration(
            model, tool_choice=tool_choice, force_tool_call=force_tool_call)


def demo_model_alias(model_dir: Path) -> Path:
    """Another path naming the demo folder: a per-call ``model`` override resolves to the same
    engine (no second load) and reports the path it was given as model_name."""
    alias = model_dir.parent / f"{model_dir.name}-alias"
    if not alias.exists():
        alias.symlink_to(model_dir, target_is_directory=True)
    return alias
