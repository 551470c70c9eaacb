"""Which engine a model object talks to, and how its constructor arguments are checked.

Engine options are `dyngen_core.EngineOptions` fields, defined once in the core and shared with
the LlamaIndex adapter. They may be given flat (``ChatDynGen(model_dir=..., cache_tokens=4096)``)
or as ``engine_options=EngineOptions(...)``; either way EngineOptions validates them. The engine
itself is `shared_generator(model_dir, engine_options=...)`: one per folder and options in the
process, so every object pointed at the same folder shares one model, cache and job queue.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dyngen_core import EngineOptions
from dyngen_core.errors import ModelFolderError

if TYPE_CHECKING:
    from dyngen_core import BackgroundGenerator

ENGINE_OPTION_NAMES: frozenset[str] = frozenset(EngineOptions.model_fields)
# Where a model object finds its folder when none is passed; serialized objects name this
# variable instead of the folder, which belongs to one machine (as an API key would).
MODEL_DIR_ENV = "DYNGEN_MODEL_DIR"
# Both model classes' `lc_secrets`: dumpd writes the variable's name for the folder, and load
# reads the folder from it (secrets_from_env=True, or a secrets_map).
SERIALIZED_SECRETS = {"model_dir": MODEL_DIR_ENV}


def model_dir_from_env() -> str:
    """The default of ``model_dir``: ``$DYNGEN_MODEL_DIR``, or '' when it is unset."""
    return os.environ.get(MODEL_DIR_ENV, "")


def gather_engine_options(data: dict[str, Any]) -> dict[str, Any]:
    """Move flat EngineOptions fields in constructor ``data`` into ``data["engine_options"]``
    (merged over an ``engine_options`` given as an object or dict)."""
    flat = {name: data.pop(name) for name in list(data) if name in ENGINE_OPTION_NAMES}
    given = data.get("engine_options")
    if not flat and (given is None or isinstance(given, EngineOptions)):
        return data
    if isinstance(given, EngineOptions):
        base = given.model_dump(exclude_unset=True)
    elif isinstance(given, Mapping):
        base = dict(given)
    elif given is None:
        base = {}
    else:
        raise TypeError(
            f"engine_options must be an EngineOptions or a dict; got {type(given).__name__}"
        )
    data["engine_options"] = EngineOptions(**{**base, **flat})
    return data


def with_plain_engine_options(serialized: Any) -> Any:
    """A model object's `to_json` output with its ``engine_options`` as a dict of the options
    that differ from the defaults (an `EngineOptions` is not LangChain-serializable; the
    constructor reads the dict back)."""
    kwargs = serialized.get("kwargs") if isinstance(serialized, dict) else None
    if isinstance(kwargs, dict) and isinstance(kwargs.get("engine_options"), EngineOptions):
        kwargs["engine_options"] = kwargs["engine_options"].model_dump(exclude_defaults=True)
    return serialized


def reject_unknown_arguments(
    class_name: str, data: Mapping[str, Any], accepted: Iterable[str]
) -> None:
    """Raise TypeError naming constructor arguments the class does not take (a misspelt
    ``temprature`` would otherwise be dropped without a word)."""
    known = set(accepted)
    unknown = sorted(k for k in data if k not in known)
    if unknown:
        raise TypeError(
            f"{class_name} got unexpected argument(s) {unknown}. Generation fields, LangChain "
            f"fields and engine options are accepted: {', '.join(sorted(known))}"
        )


def check_model_dir(model_dir: str | Path) -> str:
    """The folder as a string, after checking it holds a model (``config.json``)."""
    if not str(model_dir):
        raise ModelFolderError(
            f"no model folder: pass model_dir=... or set {MODEL_DIR_ENV}; "
            "`dyngen fetch-demo-model` prints the demo one's"
        )
    folder = Path(model_dir).expanduser()
    if not (folder / "config.json").is_file():
        raise ModelFolderError(
            f"{str(folder)!r} is not a model folder (no config.json). Pass the folder of a "
            "Hugging Face Llama-family model; `dyngen fetch-demo-model` prints the demo one's"
        )
    return str(folder)


def engine_for(model_dir: str, options: EngineOptions) -> BackgroundGenerator:
    """The process-wide engine for this folder and options (loaded on first use)."""
    # Imported here: the engine pulls in torch, which constructing a model object does not need.
    from dyngen_core import shared_generator

    return shared_generator(model_dir, engine_options=options)


def model_name_for(model_dir: str, model_name: str | None, override: str | None) -> str:
    """The name reported as ``model_name``: a per-call ``model`` folder as given, else the
    ``model_name`` field, else the folder's name."""
    if override is not None:
        return override
    return model_name or Path(model_dir).name


# The generation fields both model classes declare (their identifying params list them).
GENERATION_FIELD_NAMES = ("max_tokens", "temperature", "top_p", "top_k", "min_p",
                          "repetition_penalty", "seed", "stop")


def identifying_params(model: Any) -> dict[str, Any]:
    """What identifies a ChatDynGen / DynGenLLM: folder, name, generation fields, engine."""
    return {"model_dir": model.model_dir, "model_name": model._model_name(None),
            **{name: getattr(model, name) for name in GENERATION_FIELD_NAMES},
            "engine_options": model.engine_options.model_dump()}


def langsmith_params(model: Any, model_type: str, stop: list[str] | None,
                     kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """LangSmith's tracing parameters for one call (provider, model, type, limits, stop)."""
    params: dict[str, Any] = {
        "ls_provider": "dyngen", "ls_model_name": model._model_name(kwargs.get("model")),
        "ls_model_type": model_type, "ls_max_tokens": kwargs.get("max_tokens", model.max_tokens)}
    temperature = kwargs.get("temperature", model.temperature)
    if temperature is not None:
        params["ls_temperature"] = temperature
    if stop or model.stop:
        params["ls_stop"] = stop or model.stop
    return params


def generation_fields(model: Any) -> dict[str, Any]:
    """The model object's generation fields, by name."""
    return {name: getattr(model, name) for name in GENERATION_FIELD_NAMES}
