"""The layers of DESIGN.md §3, enforced: which folder of dyngen_core may import which.

Read statically (every ``import`` and ``from ... import`` in every module, inside functions
too); imports under ``if TYPE_CHECKING:`` are exempt, since they never run. A second check
imports every module of the torch-free layers in a fresh interpreter where importing torch
raises, so an indirect torch import fails too.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "dyngen_core"
ROOT_MODULES = {"__init__", "__main__", "errors", "config"}
BASE = {"errors", "config"}

# What each part of dyngen_core may import (besides itself). runtime/ wires everything, cli/ is on
# top of it, and the root's public surface imports what it re-exports.
ALLOWED: dict[str, set[str]] = {
    "errors": set(),
    "config": {"errors"},
    "engine": BASE,
    "text": BASE | {"engine"},
    "ops": BASE,
    "kv": BASE | {"engine", "ops"},
    "model": BASE | {"engine", "ops", "kv"},
    "sampling": BASE | {"engine", "text", "ops"},
    "runtime": BASE | {"engine", "text", "ops", "kv", "model", "sampling"},
    "cli": BASE | {"engine", "text", "ops", "kv", "model", "sampling", "runtime", "serve"},
    "tools": BASE | {"text"},
    "constraints": BASE | {"text"},
    "__init__": {"*"},
    "__main__": {"cli"},
    # The server uses the public API only (checked like the adapters, in `layer_violations`).
    "serve": set(),
}
TORCH_FREE = ("engine", "text", "errors", "config", "tools", "constraints")
# Backend modules: the CUDA-graph capture works through the backend protocol only.
BACKEND_MODULES = ("dyngen_core.kv.attention.sdpa", "dyngen_core.kv.attention.flash",
                   "dyngen_core.kv.attention.triton")
# What the adapters may import: the package's public names and its public modules.
PUBLIC_MODULES = {"dyngen_core", "dyngen_core.errors", "dyngen_core.tools",
                  "dyngen_core.constraints"}
# The server's packages (the optional ``serve`` and ``replicas`` extras): only serve/ may import
# them, and of serve/ only the modules the command line reads without them (and the replicas'
# pure bookkeeping) are exempt from needing them.
SERVER_PACKAGES = ("fastapi", "uvicorn", "starlette", "ray")
SERVE_WITHOUT_SERVER = ("dyngen_core.serve", "dyngen_core.serve.options",
                        "dyngen_core.serve.replicas", "dyngen_core.serve.replicas.options",
                        "dyngen_core.serve.replicas.prefixes")


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def part_of(module: str) -> str:
    """The layer a dyngen_core module belongs to: its first folder, or the root module."""
    return module.split(".")[1] if module != "dyngen_core" else "__init__"


def imports(path: Path) -> Iterator[tuple[int, str]]:
    """(line, imported module) for every import in ``path`` that runs (TYPE_CHECKING blocks
    skipped); ``from pkg import name`` yields ``pkg.name`` (a submodule or a name in pkg)."""
    tree = ast.parse(path.read_text(), str(path))
    skipped: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skipped.update(id(n) for child in node.body for n in ast.walk(child))
    package = module_name(path) if path.name == "__init__.py" else module_name(path).rpartition(
        ".")[0]
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1]
                                + ([base] if base else []))
            for alias in node.names:
                yield node.lineno, f"{base}.{alias.name}"


def modules_of(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*.py") if "__pycache__" not in p.parts)


def layer_violations(package: Path) -> list[str]:
    """Every import in ``package`` that its layer may not make."""
    found = []
    for path in modules_of(package):
        me = part_of(module_name(path))
        allowed = ALLOWED.get(me)
        if allowed is None:
            found.append(f"{path}: {me!r} is not a known layer (add it to DESIGN.md §3 first)")
            continue
        for line, target in imports(path):
            if not target.startswith("dyngen_core."):
                if me in TORCH_FREE and target.split(".")[0] in ("torch", "triton"):
                    found.append(f"{path}:{line}: the torch-free {me}/ imports {target}")
                if me != "serve" and target.split(".")[0] in SERVER_PACKAGES:
                    found.append(f"{path}:{line}: only serve/ may import {target}")
                continue
            if me == "serve":
                if not (target.startswith("dyngen_core.serve.") or is_public(target)):
                    found.append(f"{path}:{line}: serve/ imports the internal {target}")
                continue
            layer = part_of(target)
            if layer != me and "*" not in allowed and layer not in allowed:
                found.append(f"{path}:{line}: {me}/ may not import {target}")
            if me == "runtime" and path.stem == "graphs" and target.startswith(BACKEND_MODULES):
                found.append(f"{path}:{line}: graphs imports the backend module {target}")
    return found


def is_public(target: str) -> bool:
    """Whether an imported name is dyngen's public API (a public module or a name in one)."""
    return target in PUBLIC_MODULES or target.rpartition(".")[0] in PUBLIC_MODULES


def adapter_violations(folders: list[Path]) -> list[str]:
    """Imports of dyngen_core internals from the adapters' packages."""
    found = []
    for folder in folders:
        for path in modules_of(folder):
            for line, target in imports(path):
                if target.startswith("dyngen_core") and not is_public(target):
                    found.append(f"{path}:{line}: an adapter imports {target}")
    return found


ADAPTERS = [REPO / "integrations/langchain/langchain_dyngen",
            REPO / "integrations/llamaindex/llama_index/llms/dyngen"]


def test_every_layer_imports_only_what_it_may() -> None:
    assert not layer_violations(PACKAGE), "\n".join(layer_violations(PACKAGE))


def test_adapters_import_only_the_public_api() -> None:
    assert not adapter_violations(ADAPTERS), "\n".join(adapter_violations(ADAPTERS))


def test_root_holds_only_the_public_surface() -> None:
    root = {p.stem for p in PACKAGE.glob("*.py")} - {m.split(".")[1] for m in PUBLIC_MODULES
                                                     if m.count(".") == 1}
    assert root <= ROOT_MODULES, f"root modules beyond the public surface: {root - ROOT_MODULES}"


@pytest.mark.parametrize("case", ["upward", "torch", "graphs", "adapter", "server-package",
                                  "serve-internal"])
def test_the_rules_catch_a_broken_layer(tmp_path: Path, case: str) -> None:
    """Each rule fails on a tree that breaks it (so the checks above can fail)."""
    fake = tmp_path / "dyngen_core"
    text = {
        "upward": ("kv/cache.py", "from dyngen_core.runtime.generator import DynamicGenerator\n"),
        "torch": ("engine/pages.py", "def f():\n    import torch\n"),
        "graphs": ("runtime/graphs.py", "from dyngen_core.kv.attention.triton import paged\n"),
        "adapter": ("../adapter/mod.py", "from dyngen_core.engine.job import Job\n"),
        "server-package": ("runtime/runner.py", "from fastapi import FastAPI\n"),
        "serve-internal": ("serve/jobs.py", "from dyngen_core import Job\n"
                                            "from dyngen_core.tools import ToolSpec\n"
                                            "from dyngen_core.engine.job import Job\n"),
    }[case]
    target = (fake / text[0]).resolve()
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(text[1])
    global REPO
    saved, REPO = REPO, tmp_path
    try:
        found = (adapter_violations([tmp_path / "adapter"]) if case == "adapter"
                 else layer_violations(fake))
    finally:
        REPO = saved
    assert len(found) == 1, found


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


def import_blocking_torch(modules: list[str]) -> list[str]:
    """Import ``modules`` in a fresh interpreter without torch; its output lines."""
    result = subprocess.run([sys.executable, "-c", BLOCK_TORCH, *modules], cwd=REPO,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout.splitlines()


def test_blocker_really_blocks_torch() -> None:
    assert import_blocking_torch(["torch"]) == [
        "FAIL torch -> torch is blocked in this test (imported as 'torch')"]


def test_torch_free_layers_import_without_torch() -> None:
    modules = [module_name(p) for layer in ("engine", "text") for p in
               modules_of(PACKAGE / layer)] + ["dyngen_core.errors", "dyngen_core.config",
                                               "dyngen_core.tools", "dyngen_core.constraints"]
    assert "dyngen_core.engine.scheduler" in modules and "dyngen_core.text.stop" in modules
    lines = import_blocking_torch(modules)
    failures = [line for line in lines if not line.startswith("ok ")]
    assert not failures, "torch-free modules that need torch:\n" + "\n".join(failures)
    assert len(lines) == len(modules)


BLOCK_TRITON = """
import importlib, importlib.abc, importlib.util, pkgutil, sys

class BlockTriton(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "triton" or name.startswith("triton."):
            raise ImportError(f"triton is blocked in this test (imported as {name!r})")
        return None

sys.meta_path.insert(0, BlockTriton())
import dyngen_core
# Without the optional serve (replicas) extra, serve/'s server (Ray) modules are checked by the
# test below.
has_server = importlib.util.find_spec("fastapi") is not None
has_ray = importlib.util.find_spec("ray") is not None
for module in pkgutil.walk_packages(dyngen_core.__path__, "dyngen_core."):
    skipped = ((not has_server and module.name.startswith("dyngen_core.serve."))
               or (not has_ray and module.name.startswith("dyngen_core.serve.replicas.")))
    if module.name != "dyngen_core.__main__" and not skipped:
        try:
            importlib.import_module(module.name)
        except ImportError as exc:
            print("FAIL", module.name, "->", exc)
"""


def test_every_module_imports_without_triton() -> None:
    """Triton is never required (CI has none): kernel modules take it from
    `ops.triton_support`, which stands in for it when it is not installed."""
    result = subprocess.run([sys.executable, "-c", BLOCK_TRITON], cwd=REPO,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert not result.stdout.strip(), result.stdout


BLOCK_SERVER = """
import importlib, importlib.abc, pkgutil, sys

class BlockServer(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("fastapi", "uvicorn", "starlette", "ray"):
            raise ImportError(f"the server packages are blocked in this test ({name!r})")
        return None

sys.meta_path.insert(0, BlockServer())
import dyngen_core
from dyngen_core.cli.main import build_parser
for module in pkgutil.walk_packages(dyngen_core.__path__, "dyngen_core."):
    needs_server = module.name.startswith("dyngen_core.serve.") and module.name not in sys.argv
    if module.name != "dyngen_core.__main__" and not needs_server:
        try:
            importlib.import_module(module.name)
        except ImportError as exc:
            print("FAIL", module.name, "->", exc)
build_parser().parse_args(["serve", "--model", "m", "--api-key", "k", "--replicas", "2"])
"""


def test_the_core_imports_without_the_server_packages() -> None:
    """dyngen_core works without the ``serve`` and ``replicas`` extras: no module outside
    serve/ needs FastAPI, uvicorn or Ray, and the command line (``serve --replicas``
    included) builds without them."""
    result = subprocess.run([sys.executable, "-c", BLOCK_SERVER, *SERVE_WITHOUT_SERVER],
                            cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert not result.stdout.strip(), result.stdout
