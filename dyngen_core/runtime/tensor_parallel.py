"""Driving a tensor-parallel model from one generator: rank 0 plans, every rank computes.

Rank 0 runs the whole generator (scheduler, sampler, speculative verification, text); its
runner is a `BroadcastRunner`, which sends each step's plan (page copies included) to the
other ranks before running it. The other ranks run `serve_tensor_parallel_worker`: a loop that
receives each plan and runs the same `ModelRunner` forward over their shard of the model and
cache, so every collective of the forward meets its partner. Only rank 0 gets logits and
samples; a decode input that is still on rank 0's device (an overlapped step's sampled token,
`overlap.TokenFeed`) reaches the other ranks by a device broadcast, without waiting on the
host.

Messages travel over the group's gloo ``control`` group (host memory): first the runner's
options (so that every rank builds the same runner and captures the same CUDA graphs), then
one `StepMessage` per step, then None to stop.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from dyngen_core.engine.plan import StepPlan
from dyngen_core.kv.attention import AttentionBackend, get_backend
from dyngen_core.kv.cache import Cache
from dyngen_core.model import Model
from dyngen_core.model.parallel import TensorParallel
from dyngen_core.runtime.overlap import TokenFeed
from dyngen_core.runtime.runner import ModelRunner


@dataclass(frozen=True)
class RunnerOptions:
    """What every rank's `ModelRunner` is built with (`ModelRunner`'s arguments; the attention
    backend by name)."""

    attention_backend: str
    cuda_graphs: bool
    max_batch_size: int
    compile_decode: bool
    skinny_matmul_rows: int | None

    def build(self, model: Model, cache: Cache) -> ModelRunner:
        """This rank's runner (the same on every rank)."""
        return ModelRunner(
            model, cache, get_backend(self.attention_backend, model.device),
            cuda_graphs=self.cuda_graphs, max_batch_size=self.max_batch_size,
            compile_decode=self.compile_decode, skinny_matmul_rows=self.skinny_matmul_rows)


@dataclass(frozen=True)
class StepMessage:
    """One step for the other ranks: the plan, and where its fed inputs go (``feed_targets``,
    None without a feed; the values follow as a device broadcast of ``feed_dtype``)."""

    plan: StepPlan
    feed_targets: list[int] | None = None
    feed_dtype: torch.dtype | None = None


class StepChannel:
    """Rank 0 -> every other rank, in order: host objects over the group's control group."""

    def __init__(self, parallel: TensorParallel) -> None:
        if parallel.size < 2:
            raise ValueError("a StepChannel joins two or more ranks; this model is not split")
        self.parallel = parallel
        self._source = 0 if parallel.control is None else dist.get_global_rank(parallel.control, 0)

    def send(self, message: object) -> None:
        """Rank 0: hand ``message`` to every other rank."""
        dist.broadcast_object_list([message], src=self._source, group=self.parallel.control)

    def receive(self) -> object:
        """Other ranks: the next message rank 0 sent (blocks until it comes)."""
        box: list[object] = [None]
        dist.broadcast_object_list(box, src=self._source, group=self.parallel.control)
        return box[0]

    def broadcast_tensor(self, tensor: torch.Tensor) -> None:
        """Rank 0's ``tensor`` into every other rank's ``tensor`` (same shape and dtype), over
        the device group (on CUDA, NCCL: no host wait)."""
        source = 0 if self.parallel.group is None else dist.get_global_rank(self.parallel.group, 0)
        dist.broadcast(tensor, src=source, group=self.parallel.group)


def build_runner(model: Model, cache: Cache, attention_backend: str | AttentionBackend, *,
                 cuda_graphs: bool, max_batch_size: int, compile_decode: bool,
                 skinny_matmul_rows: int | None) -> ModelRunner | BroadcastRunner:
    """A generator's runner for its target model: a `ModelRunner`, or for a split model, rank
    0's `BroadcastRunner` (which needs the attention backend by name, to build the same one on
    every rank: ValueError otherwise)."""
    if model.parallel.size == 1:
        return ModelRunner(
            model, cache, get_backend(attention_backend, model.device), cuda_graphs=cuda_graphs,
            max_batch_size=max_batch_size, compile_decode=compile_decode,
            skinny_matmul_rows=skinny_matmul_rows,
        )
    if not isinstance(attention_backend, str):
        raise ValueError("a tensor-parallel model takes the attention backend by name "
                         "(\"auto\", \"sdpa\", \"triton\", \"flash\"): every rank builds its own")
    options = RunnerOptions(attention_backend, cuda_graphs, max_batch_size, compile_decode,
                            skinny_matmul_rows)
    return BroadcastRunner(model, cache, options)


class BroadcastRunner:
    """Rank 0's runner of a split model: sends every plan to the other ranks, then runs it
    (`ModelRunner.run`'s contract). `close` stops the other ranks' loops; a closed runner
    refuses to run."""

    def __init__(self, model: Model, cache: Cache, options: RunnerOptions) -> None:
        if not model.parallel.is_first:
            raise ValueError(
                f"rank {model.parallel.rank} runs serve_tensor_parallel_worker(model, cache); "
                "only rank 0 builds the DynamicGenerator"
            )
        self.channel = StepChannel(model.parallel)
        self.channel.send(options)  # before our runner: both ranks capture graphs together
        self.runner = options.build(model, cache)
        self.closed = False

    def run(self, plan: StepPlan, feed: TokenFeed | None = None) -> torch.Tensor | None:
        if self.closed:
            raise RuntimeError("this generator was closed (its tensor-parallel workers have "
                               "stopped); build a new one")
        if feed is None:
            self.channel.send(StepMessage(plan))
        else:
            values = _fed_values(feed)
            self.channel.send(StepMessage(plan, feed.targets, values.dtype))
            self.channel.broadcast_tensor(values)
        return self.runner.run(plan, feed)

    def close(self) -> None:
        """Stop the other ranks' loops (once)."""
        if not self.closed:
            self.closed = True
            self.channel.send(None)


def serve_tensor_parallel_worker(model: Model, cache: Cache) -> int:
    """Run the steps rank 0's generator sends, over this rank's shard of ``model`` and
    ``cache`` (built as rank 0 built its own), until rank 0 closes it; returns the number of
    steps run. Raises ValueError on rank 0 or for a model that is not split."""
    parallel = model.parallel
    if parallel.size < 2 or parallel.is_first:
        raise ValueError("serve_tensor_parallel_worker runs on ranks 1 and up of a model "
                         "loaded with tensor_parallel > 1; rank 0 builds the generator")
    channel = StepChannel(parallel)
    options = channel.receive()
    if not isinstance(options, RunnerOptions):
        raise RuntimeError(f"rank 0 sent {type(options).__name__} where the runner options "
                           "come first; every rank must run the same dyngen version")
    runner = options.build(model, cache)
    steps = 0
    while (message := channel.receive()) is not None:
        if not isinstance(message, StepMessage):
            raise RuntimeError(f"rank 0 sent {type(message).__name__} where a step comes")
        runner.run(message.plan, _received_feed(channel, message, model.device))
        steps += 1
    return steps


def _fed_values(feed: TokenFeed) -> torch.Tensor:
    """The sampled ids ``feed`` puts into its targets, in target order (on the device)."""
    if feed.in_order:
        return feed.ids[:len(feed.targets)].contiguous()
    rows = torch.tensor(feed.rows, dtype=torch.int64).to(feed.ids.device, non_blocking=True)
    return feed.ids.index_select(0, rows)


def _received_feed(channel: StepChannel, message: StepMessage,
                   device: torch.device) -> TokenFeed | None:
    """The feed of a received step, its values taken from rank 0's broadcast."""
    targets = message.feed_targets
    if targets is None or message.feed_dtype is None:
        return None
    values = torch.empty(len(targets), dtype=message.feed_dtype, device=device)
    channel.broadcast_tensor(values)
    rows = list(range(len(targets)))
    return TokenFeed(values, targets, rows, in_order=targets == rows)
