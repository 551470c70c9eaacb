"""A bad option value gets one line naming it, never a traceback, and before any model loads:
sampling values, devices, the server's and the replicas' options, ports and batch sizes (the
CLI soak found each of these printing a traceback, and `--port 99999` serving on another
port)."""

from __future__ import annotations

from pathlib import Path

import pytest

from dyngen_core.cli.main import main
from tests.tiny_models import write_tiny_model

MISSING = "/nonexistent/model"  # never opened: the value fails first


@pytest.mark.parametrize(("argv", "names"), [
    (["generate", "hi", "--model", MISSING, "--temperature", "-1"], "temperature"),
    (["generate", "hi", "--model", MISSING, "--top-p", "2"], "top_p"),
    (["chat", "--model", MISSING, "--top-k", "-3"], "top_k"),
    (["serve", "--model", MISSING, "--max-batch-size", "0"], "max_batch_size"),
    (["serve", "--model", MISSING, "--cache-tokens", "5"], "cache_tokens"),
    (["serve", "--model", MISSING, "--max-n", "0"], "max_n"),
    (["serve", "--model", MISSING, "--replicas", "-1"], "replicas"),
    (["serve", "--model", MISSING, "--port", "99999"], "port"),
    (["serve", "--model", MISSING, "--port", "-1"], "port"),
])
def test_a_bad_value_is_one_line_naming_it(argv: list[str], names: str,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"dyngen {argv[0]}: error: ") and names in err, err
    assert err.count("\n") == 1 and "Traceback" not in err, err


@pytest.mark.parametrize("device", ["banana", "cuda"])
def test_a_device_this_machine_lacks_is_one_line(device: str, tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    import torch

    if device == "cuda" and torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    folder = write_tiny_model(tmp_path, arch="llama", seed=3)
    capsys.readouterr()  # the writer's progress bar
    assert main(["generate", "hi", "--model", str(folder), "--device", device]) == 1
    err = capsys.readouterr().err
    assert err.startswith("dyngen generate: error: device") and device in err, err
    assert "Traceback" not in err


@pytest.mark.parametrize(("argv", "option"), [
    (["bench", "--model", MISSING, "--batch-sizes", "1,x"], "--batch-sizes"),
    (["bench", "--model", MISSING, "--batch-sizes", "0"], "--batch-sizes"),
])
def test_argparse_refuses_batch_sizes_that_are_not_counts(argv: list[str], option: str,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert f"argument {option}:" in capsys.readouterr().err
