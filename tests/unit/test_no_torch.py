"""The control plane imports without torch (DESIGN.md §3): every control-plane module is imported
in a fresh interpreter in which importing torch raises ImportError."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

CONTROL_PLANE = [
    "dyngen_core.config",
    "dyngen_core.engine.plan",
    "dyngen_core.errors",
    "dyngen_core.engine.pages",
    "dyngen_core.engine.pages",
    "dyngen_core.engine.defrag",
    "dyngen_core.engine.scheduler",
    "dyngen_core.engine",
    "dyngen_core.engine.sequence",
    "dyngen_core.engine.prefix",
    "dyngen_core.engine.bookkeeping",
    "dyngen_core.engine.settings",
    "dyngen_core.engine.job",
    "dyngen_core.engine.results",
    "dyngen_core.text.stop",
    "dyngen_core.text.detokenize",
    "dyngen_core.text.tokenizer",
    "dyngen_core.spec.ngram",
]

BLOCK_TORCH = """
import importlib, importlib.abc, sys

class BlockTorch(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ImportError(f"torch is blocked in this test (imported as {name!r})")
        return None

sys.meta_path.insert(0, BlockTorch())
for name in sys.argv[1:]:
    try:
        importlib.import_module(name)
    except ImportError as exc:
        print("FAIL", name, "->", exc)
    else:
        print("ok", name)
assert not any(m == "torch" or m.startswith("torch.") for m in sys.modules)
"""


def existing_modules() -> list[str]:
    found = []
    for name in CONTROL_PLANE:
        try:
            if importlib.util.find_spec(name) is not None:
                found.append(name)
        except ModuleNotFoundError:  # a parent package not written yet
            continue
    return found


def import_blocking_torch(modules: list[str]) -> list[str]:
    """Import ``modules`` in a fresh interpreter without torch; its output lines."""
    result = subprocess.run([sys.executable, "-c", BLOCK_TORCH, *modules], cwd=REPO,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout.splitlines()


def test_blocker_really_blocks_torch() -> None:
    assert import_blocking_torch(["torch"]) == [
        "FAIL torch -> torch is blocked in this test (imported as 'torch')"]


def test_control_plane_imports_without_torch() -> None:
    modules = existing_modules()
    assert "dyngen_core.engine.scheduler" in modules and "dyngen_core.engine.pages" in modules
    lines = import_blocking_torch(modules)
    failures = [line for line in lines if not line.startswith("ok ")]
    assert not failures, "control-plane modules that need torch:\n" + "\n".join(failures)
    assert len(lines) == len(modules)
