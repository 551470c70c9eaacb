"""Constructing ChatDynGen / DynGenLLM and mapping their fields: no engine is loaded here."""

from __future__ import annotations

from pathlib import Path

import pytest
from langchain_dyngen import ChatDynGen, DynGenLLM
from langchain_dyngen._engine import model_name_for
from langchain_dyngen._params import Generation, take_call_options
from pydantic import ValidationError

from dyngen_core import EngineOptions, SamplerSettings
from dyngen_core.errors import ModelFolderError


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    (tmp_path / "config.json").write_text("{}")
    return tmp_path


@pytest.mark.parametrize("cls", [ChatDynGen, DynGenLLM])
def test_no_engine_argument_means_the_engines_defaults(cls: type, model_dir: Path) -> None:
    """Defaults are what users get: a model built with no engine argument asks for
    ``EngineOptions()``, the generator's own defaults (checked in the core's tests)."""
    assert cls(model_dir=str(model_dir)).engine_options == EngineOptions()


@pytest.mark.parametrize("cls", [ChatDynGen, DynGenLLM])
def test_engine_options_given_flat_are_validated_by_engine_options(
    cls: type, model_dir: Path
) -> None:
    model = cls(model_dir=str(model_dir), cache_tokens=4096, cache_mode="q4", max_batch_size=8)
    assert model.engine_options == EngineOptions(cache_tokens=4096, cache_mode="q4",
                                                 max_batch_size=8)
    merged = cls(model_dir=str(model_dir), engine_options=EngineOptions(cache_tokens=4096),
                 dedup=False)
    assert merged.engine_options == EngineOptions(cache_tokens=4096, dedup=False)
    with pytest.raises(ValidationError, match="cache_mode"):
        cls(model_dir=str(model_dir), cache_mode="q3")
    split = cls(model_dir=str(model_dir), tensor_parallel=2)
    assert split.engine_options == EngineOptions(tensor_parallel=2)
    with pytest.raises(ValidationError, match="tensor_parallel"):
        cls(model_dir=str(model_dir), tensor_parallel=0)


@pytest.mark.parametrize("cls", [ChatDynGen, DynGenLLM])
def test_unknown_arguments_and_missing_folders_are_errors(cls: type, model_dir: Path) -> None:
    with pytest.raises(TypeError, match="temprature"):
        cls(model_dir=str(model_dir), temprature=0.5)
    with pytest.raises(ModelFolderError, match="no config.json"):
        cls(model_dir=str(model_dir / "missing"))
    with pytest.raises(ValidationError, match="max_tokens"):
        cls(model_dir=str(model_dir), max_tokens=0)


def test_sampling_fields_map_onto_sampler_settings_over_model_defaults() -> None:
    fields = {"max_tokens": 32, "temperature": 0.7, "top_p": None, "top_k": 40, "min_p": None,
              "repetition_penalty": 1.1, "seed": 5, "stop": ["\n\n"]}
    generation = Generation.from_fields(fields, {"top_p": 0.9}, None)
    settings = generation.sampler_settings({"temperature": 1.0, "min_p": 0.05})
    assert settings == SamplerSettings(temperature=0.7, top_k=40, top_p=0.9, min_p=0.05,
                                       token_repetition_penalty=1.1)
    assert generation.seed == 5 and generation.stop == ("\n\n",)
    unset = Generation.from_fields({**fields, "temperature": None, "top_k": None,
                                    "repetition_penalty": None}, {}, ["END"])
    assert unset.sampler_settings({"temperature": 0.3}) is None
    assert unset.stop == ("END",)
    with pytest.raises(ValidationError, match="top_p"):
        Generation.from_fields(fields, {"top_p": 1.5}, None).sampler_settings({})


def test_per_call_options_reject_unknown_names() -> None:
    assert take_call_options({"max_tokens": 3, "seed": None}, ("max_tokens", "seed"), "m") == \
        {"max_tokens": 3}
    with pytest.raises(TypeError, match="max_new_tokens"):
        take_call_options({"max_new_tokens": 3}, ("max_tokens",), "ChatDynGen")


def test_model_name_and_langsmith_params(model_dir: Path) -> None:
    chat = ChatDynGen(model_dir=str(model_dir), max_tokens=10, temperature=0.2, stop=["x"])
    params = chat._get_ls_params()
    assert params["ls_provider"] == "dyngen" and params["ls_model_name"] == model_dir.name
    assert params["ls_max_tokens"] == 10 and params["ls_temperature"] == 0.2
    assert params["ls_stop"] == ["x"]
    assert chat._get_ls_params(model="other")["ls_model_name"] == "other"
    assert model_name_for("/m/folder", "nice", None) == "nice"


def test_bind_tools_checks_tool_choice_at_bind_time(model_dir: Path) -> None:
    chat = ChatDynGen(model_dir=str(model_dir))

    def add(a: int, b: int) -> int:
        """Add two integers."""
        return a + b

    bound = chat.bind_tools([add], tool_choice="add")
    assert bound.kwargs["tools"][0]["function"]["name"] == "add"  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match="not one of the bound tools"):
        chat.bind_tools([add], tool_choice="multiply")
    with pytest.raises(ValueError, match="method must be"):
        chat.with_structured_output({"type": "object"}, method="xml")  # type: ignore[arg-type]


@pytest.mark.parametrize("cls", [ChatDynGen, DynGenLLM])
def test_the_folder_comes_from_the_environment_when_not_given(
        cls: type, model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DYNGEN_MODEL_DIR", raising=False)
    with pytest.raises(ModelFolderError, match="DYNGEN_MODEL_DIR"):
        cls()
    monkeypatch.setenv("DYNGEN_MODEL_DIR", str(model_dir))
    assert cls().model_dir == str(model_dir)
    monkeypatch.setenv("DYNGEN_MODEL_DIR", str(model_dir / "missing"))
    with pytest.raises(ModelFolderError, match="not a model folder"):
        cls()


@pytest.mark.parametrize("cls", [ChatDynGen, DynGenLLM])
def test_objects_serialize_without_their_folder_and_load_back(
        cls: type, model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from langchain_core.load import dumpd, dumps, load

    model = cls(model_dir=str(model_dir), max_tokens=12, cache_tokens=4096, tensor_parallel=1,
                stop=["\n"])
    data = dumpd(model)
    assert str(model_dir) not in dumps(model)
    assert data["kwargs"]["model_dir"] == {"lc": 1, "type": "secret", "id": ["DYNGEN_MODEL_DIR"]}
    assert data["kwargs"]["engine_options"] == {"cache_tokens": 4096}
    monkeypatch.setenv("DYNGEN_MODEL_DIR", str(model_dir))
    loaded = load(data, valid_namespaces=["langchain_dyngen"], allowed_objects=[cls],
                  secrets_from_env=True)
    assert type(loaded) is cls and loaded.dict() == model.dict()
    elsewhere = model_dir / "copy"
    elsewhere.mkdir()
    (elsewhere / "config.json").write_text("{}")
    moved = load(data, valid_namespaces=["langchain_dyngen"], allowed_objects=[cls],
                 secrets_map={"DYNGEN_MODEL_DIR": str(elsewhere)})
    assert moved.model_dir == str(elsewhere) and moved.max_tokens == 12
