"""The ``dyngen`` command line (`main`) and model conversion (`convert`)."""

from dyngen_core.cli.main import main

__all__ = ["main"]
