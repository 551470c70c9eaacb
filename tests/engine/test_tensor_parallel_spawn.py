"""`DynamicGenerator.from_model_dir(..., tensor_parallel=2)` starts its own worker process, and
its greedy text equals one process's; `close` ends the worker and leaves the group.

The generator runs in a child process (it becomes rank 0 of a gloo group, which the test
process must not join); a hang fails the test after the limit.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch.distributed as dist

from dyngen_core import DynamicGenerator, SamplerSettings
from tests.tensor_parallel_ranks import run_in_child
from tests.tiny_models import TRAINING_TEXT

PROMPTS = [TRAINING_TEXT[:90], TRAINING_TEXT[:90] + " and", TRAINING_TEXT[300:340]]


def generate(folder: Path, tensor_parallel: int) -> list[str]:
    generator = DynamicGenerator.from_model_dir(
        folder, cache_tokens=1024, device="cpu", tensor_parallel=tensor_parallel,
        attention_backend="sdpa", max_batch_size=2)
    try:
        texts = generator.generate(PROMPTS, max_new_tokens=6, add_bos=True, stop_conditions=[],
                                   gen_settings=SamplerSettings.greedy())
        generator.check_invariant()
        return texts
    finally:
        generator.close()


def child_main(job: tuple[Path, Path]) -> None:
    folder, out = job
    texts = generate(folder, tensor_parallel=2)
    assert not dist.is_initialized()  # close() left the group
    out.write_text(json.dumps(texts), encoding="utf-8")


def test_tensor_parallel_from_model_dir_starts_its_workers(engine_model_dir: Path,
                                                           tmp_path: Path) -> None:
    out = tmp_path / "texts.json"
    run_in_child(child_main, (engine_model_dir, out), limit_s=150)
    assert json.loads(out.read_text(encoding="utf-8")) == generate(engine_model_dir, 1)
