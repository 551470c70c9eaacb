"""``tensor_parallel`` through the public entry points: `shared_generator` (which the LangChain
and LlamaIndex adapters and ``dyngen serve`` use) starts a split engine whose greedy text equals
one process's, and closing the engine ends its worker and leaves the group; bad values are
refused, naming the option, before any process starts.

The split engine runs in a child process (its rank 0 joins a gloo group, which the test process
must not); a hang fails the test after the limit.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist
from pydantic import ValidationError

from dyngen_core import DynamicGenerator, EngineOptions, Job, SamplerSettings, shared_generator
from dyngen_core.cli.main import build_parser, main
from dyngen_core.serve.options import serve_options
from tests.tensor_parallel_ranks import run_in_child
from tests.tiny_models import TRAINING_TEXT

PROMPTS = [TRAINING_TEXT[:90], TRAINING_TEXT[:90] + " and", TRAINING_TEXT[300:340]]
ENGINE: dict[str, Any] = {"cache_tokens": 1024, "device": "cpu", "attention_backend": "sdpa",
                          "max_batch_size": 2}


def shared_texts(folder: Path, tensor_parallel: int) -> list[str]:
    """Greedy texts of PROMPTS from the shared engine of these options (page invariant
    checked once it is idle); the engine is closed after."""
    engine = shared_generator(folder, tensor_parallel=tensor_parallel, **ENGINE)
    try:
        tokenizer = engine.tokenizer
        handles = engine.submit_many([
            Job(input_ids=tokenizer.encode(p, add_bos=True), max_new_tokens=6,
                stop_conditions=[], gen_settings=SamplerSettings.greedy()) for p in PROMPTS])
        texts = [h.result(timeout=60)["full_completion"] for h in handles]
        engine.wait_idle(timeout=60)
        engine.generator.check_invariant()
        if tensor_parallel > 1:
            with pytest.raises(RuntimeError, match="one split engine at a time"):
                shared_generator(folder, tensor_parallel=tensor_parallel,
                                 **{**ENGINE, "cache_tokens": 2048})
        return texts
    finally:
        engine.close()


def child_main(job: tuple[Path, Path]) -> None:
    folder, out = job
    texts = shared_texts(folder, tensor_parallel=2)
    assert not dist.is_initialized()  # closing the engine closed the generator: group left
    out.write_text(json.dumps(texts), encoding="utf-8")


def test_tensor_parallel_shared_generator_matches_one_process(engine_model_dir: Path,
                                                              tmp_path: Path) -> None:
    out = tmp_path / "texts.json"
    run_in_child(child_main, (engine_model_dir, out), limit_s=150)
    assert json.loads(out.read_text(encoding="utf-8")) == shared_texts(engine_model_dir, 1)


@pytest.mark.parametrize("value", [0, -2])
def test_tensor_parallel_below_one_is_refused_by_name(engine_model_dir: Path,
                                                      value: int) -> None:
    with pytest.raises(ValidationError, match="tensor_parallel"):
        EngineOptions(tensor_parallel=value)
    with pytest.raises(ValidationError, match="tensor_parallel"):
        shared_generator(engine_model_dir, tensor_parallel=value, **ENGINE)
    with pytest.raises(ValueError, match=f"tensor_parallel={value}"):
        DynamicGenerator.from_model_dir(engine_model_dir, device="cpu", tensor_parallel=value)
    assert not dist.is_initialized()


@pytest.mark.parametrize("value", [3, 8])
def test_tensor_parallel_the_model_cannot_split_over_is_refused_before_spawning(
        engine_model_dir: Path, value: int) -> None:
    """The tiny model's 4 query heads split over neither 3 nor 8 ranks."""
    with pytest.raises(ValueError, match=f"num_attention_heads=4 does not split over "
                                         f"tensor_parallel={value}"):
        DynamicGenerator.from_model_dir(engine_model_dir, device="cpu", tensor_parallel=value)
    assert not dist.is_initialized()  # refused before joining a group or starting workers


def test_tensor_parallel_reaches_the_command_line(capsys: pytest.CaptureFixture[str]) -> None:
    parser = build_parser()
    for command in (["generate", "hi"], ["chat"], ["bench"]):
        assert parser.parse_args([*command, "--tensor-parallel", "2"]).tensor_parallel == 2
        assert parser.parse_args(command).tensor_parallel == 1
    args = parser.parse_args(["serve", "--model", "/m/Demo", "--tensor-parallel", "4"])
    assert serve_options(args, args.model).engine_options.tensor_parallel == 4
    for bad in ("0", "-1", "two"):
        with pytest.raises(SystemExit):
            parser.parse_args(["serve", "--tensor-parallel", bad])
        assert "--tensor-parallel" in capsys.readouterr().err


def test_the_command_line_refuses_a_split_the_model_cannot_take_in_one_line(
        engine_model_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    status = main(["generate", "hi", "--model", str(engine_model_dir), "--device", "cpu",
                   "--tensor-parallel", "3"])
    error = capsys.readouterr().err.strip().splitlines()
    assert status == 1 and len(error) == 1 and "Traceback" not in error[0]
    assert error[0].startswith("dyngen generate: error: ") and "tensor_parallel=3" in error[0]
    assert not dist.is_initialized()
