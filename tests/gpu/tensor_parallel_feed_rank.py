"""The ranks of `test_tensor_parallel_feed_gpu` (a module of its own, imported by its full
name, so that the spawned ranks can import the function they run)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed as dist

from dyngen_core.engine.plan import PENDING_TOKEN, SequenceSlice, StepPlan
from dyngen_core.model.parallel import TensorParallel
from dyngen_core.runtime.overlap import TokenFeed
from dyngen_core.runtime.tensor_parallel import StepChannel, _received_feed

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
