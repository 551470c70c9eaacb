"""On a GPU, a tensor-parallel step's fed ids stay on the device: rank 0's `StepChannel` sends
the plan and targets on the host and the ids by a device broadcast, which the other rank
receives onto its device. Two processes share one GPU over gloo (which broadcasts CUDA tensors),
so this runs on a machine with a single GPU; NCCL itself needs one GPU per rank."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.gpu.tensor_parallel_feed_rank import rank_main
from tests.tensor_parallel_ranks import run_ranks

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_tensor_parallel_fed_ids_go_by_device_broadcast(tmp_path: Path) -> None:
    out = tmp_path / "received.json"
    run_ranks(rank_main, 2, out, limit_s=120)
    assert json.loads(out.read_text(encoding="utf-8")) == [True, [0, 1], [33, 31], "cuda", True]
