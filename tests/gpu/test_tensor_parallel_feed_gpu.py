"""On a GPU, a tensor-parallel step's fed ids stay on the device: rank 0's `StepChannel` sends
the plan and targets on the host and the ids by a device broadcast, which the other rank
receives onto its device. Two processes share one GPU over gloo (which broadcasts CUDA tensors),
so this runs on a machine with a single GPU; NCCL itself needs one GPU per rank."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from dyngen_core.engine.plan import PENDING_TOKEN, SequenceSlice, StepPlan
from dyngen_core.model.parallel import TensorParallel
from dyngen_core.runtime.overlap import TokenFeed
from dyngen_core.runtime.tensor_parallel import StepChannel, _received_feed
from tests.tensor_parallel_ranks import run_ranks

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

PLAN = StepPlan([SequenceSlice(1, [PENDING_TOKEN], 40, [0], True),
                 SequenceSlice(2, [PENDING_TOKEN], 41, [1], True)])


def rank_main(rank: int, world_size: int, out: Path) -> None:
    world = dist.group.WORLD
    channel = StepChannel(TensorParallel(rank, world_size, world, world))
    device = torch.device("cuda", 0)
    if rank == 0:
        ids = torch.tensor([31, 32, 33], dtype=torch.int64, device=device)
        channel.send_step(PLAN, TokenFeed(ids, [0, 1], [2, 0]))
        channel.send_stop()
        return
    message = channel.receive()
    assert message is not None and message.on_device and message.feed_values is None
    feed = _received_feed(channel, message, device)  # what the worker loop feeds its runner
    assert feed is not None and channel.receive() is None
    out.write_text(json.dumps([message.plan == PLAN, feed.targets, feed.ids.tolist(),
                               feed.ids.device.type, feed.in_order]), encoding="utf-8")


def test_tensor_parallel_fed_ids_go_by_device_broadcast(tmp_path: Path) -> None:
    out = tmp_path / "received.json"
    run_ranks(rank_main, 2, out, limit_s=120)
    assert json.loads(out.read_text(encoding="utf-8")) == [True, [0, 1], [33, 31], "cuda", True]
