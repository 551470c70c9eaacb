"""`DynamicGenerator.from_model_dir(..., tensor_parallel=2)` starts its own worker process, and
its greedy text equals one process's; `close` ends the worker and leaves the group.

The generator runs in a child process (it becomes rank 0 of a gloo group, which the test
process must not join); a hang fails the test after the limit.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

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


def fault_child_main(job: tuple[Path, Path]) -> None:
    """Rank 0's forward raises once after its plan went to rank 1 (which is then inside that
    step's collectives): that step's jobs fail, later jobs fail at once naming the fault
    (not after the group's timeout), and close kills the worker."""
    folder, out = job
    generator = DynamicGenerator.from_model_dir(folder, cache_tokens=1024, device="cpu",
                                                tensor_parallel=2, attention_backend="sdpa",
                                                overlap_steps=False)
    workers = generator._workers
    assert workers is not None
    inner = generator._runner.runner  # rank 0's own runner, after the broadcast
    run, calls = inner.run, [0]

    def failing_run(plan: Any, feed: Any = None) -> Any:
        calls[0] += 1
        if calls[0] == 3:
            raise RuntimeError("injected rank-0 fault")
        return run(plan, feed)

    inner.run = failing_run
    _, first = generator.generate(PROMPTS[:2], max_new_tokens=6, stop_conditions=[],
                                  gen_settings=SamplerSettings.greedy(),
                                  return_last_results=True)
    _, later = generator.generate(PROMPTS[2], max_new_tokens=6, stop_conditions=[],
                                  gen_settings=SamplerSettings.greedy(),
                                  return_last_results=True)
    generator.close()
    out.write_text(json.dumps({
        "first": [str(r["error"]) for r in first],
        "later": str(later["error"]),
        "alive": [p.is_alive() for p in workers.processes],
        "group": dist.is_initialized()}), encoding="utf-8")


def test_a_rank_0_fault_mid_step_fails_later_jobs_fast(engine_model_dir: Path,
                                                        tmp_path: Path) -> None:
    out = tmp_path / "fault.json"
    run_in_child(fault_child_main, (engine_model_dir, out), limit_s=150)
    got = json.loads(out.read_text(encoding="utf-8"))
    assert all("injected rank-0 fault" in error for error in got["first"]), got
    assert "out of step" in got["later"] and "injected rank-0 fault" in got["later"], got
    assert got["alive"] == [False] and not got["group"], got
