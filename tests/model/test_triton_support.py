"""`triton_support`: where optional Triton kernels run by default, the errors of asking for them
where they cannot run, the device context of a launch, and the kernel modules without triton."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dyngen_core.ops.triton_support import (
    launch_device,
    require_triton,
    triton_by_default,
)


def test_cpu_never_runs_triton_by_default() -> None:
    assert not triton_by_default(torch.device("cpu"))


def test_asking_on_the_cpu_without_the_interpreter_names_the_option(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    expected = "needs a CUDA device" if importlib.util.find_spec("triton") else "needs triton"
    with pytest.raises(ValueError, match=f"fused_ops=True {expected}"):
        require_triton(torch.device("cpu"), "fused_ops")


def test_launch_device_keeps_the_current_device_off_cuda() -> None:
    """A CPU tensor's launch (the interpreter) enters no CUDA device context."""
    with launch_device(torch.device("cpu")) as entered:
        assert entered is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_launch_device_switches_only_to_another_gpu() -> None:
    current = torch.device("cuda", torch.cuda.current_device())
    with launch_device(current) as entered:
        assert entered is None  # already current: no switch
    if torch.cuda.device_count() > 1:
        other = torch.device("cuda", 1 - current.index)  # type: ignore[operator]
        with launch_device(other):
            assert torch.cuda.current_device() == other.index



def test_kernel_modules_import_without_triton() -> None:
    """Where triton is not installed the modules holding kernels still import (their torch
    twins run), and launching one of their kernels raises, naming the reason."""
    code = ("import sys\n"
            "sys.modules['triton'] = None\n"
            "from dyngen_core.kv.attention import sdpa\n"
            "from dyngen_core.kv import fp16\n"
            "from dyngen_core.ops import fused_ops, skinny_matmul\n"
            "try:\n"
            "    fused_ops.silu_mul_kernel[(1,)]()\n"
            "except RuntimeError as error:\n"
            "    print(error)\n")
    repo = Path(__file__).resolve().parents[2]
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            cwd=repo, timeout=300, check=False)
    assert result.returncode == 0, result.stderr
    assert "silu_mul_kernel cannot launch: triton is not installed" in result.stdout
