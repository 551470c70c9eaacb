"""The exceptions dyngen raises. Every message names what was wrong and what to do about it."""

from __future__ import annotations


class DynGenError(Exception):
    """Base class of every dyngen error."""


class ModelFolderError(DynGenError, FileNotFoundError):
    """The model folder, or a file in it, is missing, unreadable or invalid (a config.json
    value of the wrong type or out of range, a checkpoint that disagrees with it)."""


class UnsupportedArchitectureError(DynGenError, ValueError):
    """config.json names an architecture dyngen does not implement."""


class WeightsError(DynGenError, ValueError):
    """A safetensors file is corrupt, or a tensor is missing, unexpected or wrongly shaped."""


class TokenizerError(DynGenError, ValueError):
    """tokenizer.json / tokenizer_config.json are missing or unusable, or a template failed."""


class JobTooLargeError(DynGenError, ValueError):
    """A job can never fit in the cache, however empty it is."""


class JobError(DynGenError, ValueError):
    """A job's arguments are invalid."""


class ConversionError(DynGenError, ValueError):
    """A GGUF file cannot be converted."""


class EngineStoppedError(DynGenError, RuntimeError):
    """A `BackgroundGenerator` no longer runs jobs: it was closed, or its engine thread stopped
    on an error (then chained as ``__cause__``). `shared_generator` gives a new engine."""
