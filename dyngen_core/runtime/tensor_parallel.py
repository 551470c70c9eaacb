"""Driving a tensor-parallel model from one generator: rank 0 plans, every rank computes.

Rank 0 runs the whole generator (scheduler, sampler, speculative verification, text); its
runner is a `BroadcastRunner`, which sends each step's plan (page copies included) to the
other ranks before running it. The other ranks run `serve_tensor_parallel_worker`: a loop that
receives each plan and runs the same `ModelRunner` forward over their shard of the model and
cache, so every collective of the forward meets its partner. Only rank 0 gets logits and
samples; a decode input that is still on rank 0's device (an overlapped step's sampled token,
`overlap.TokenFeed`) reaches the other ranks inside the step's message on the CPU, and by a
device broadcast on a GPU (without waiting on the host).

Messages travel over the group's gloo ``control`` group (host memory): first the runner's
options (so that every rank builds the same runner and captures the same CUDA graphs), then
one step per message, then a stop. A step is one broadcast of a fixed-size int64 tensor: the
plan's words (`engine.plan_codec`), the fed targets and, when the sampled ids are on the CPU,
their values (a second broadcast carries the rest of a message longer than the tensor). On a
GPU the fed values follow as a device broadcast instead. A decode step thus costs one
collective on the host instead of three (``broadcast_object_list``'s two, around pickling,
then the fed ids'; BENCHMARKS.md, "Tensor-parallel plan broadcast").
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum

import torch
import torch.distributed as dist

from dyngen_core.engine.plan import StepPlan
from dyngen_core.engine.plan_codec import decode_plan, encode_plan
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


# Words in a message's first broadcast: a decode step of 64 jobs fits (8 KiB cost about what
# one word costs over gloo); a longer message sends the rest in a second broadcast.
FIRST_WORDS = 1024


class _Kind(IntEnum):
    STOP = 0
    STEP = 1


class _Feed(IntEnum):
    """Where a step's fed values are: none, in the message, or in a device broadcast."""

    NONE = 0
    INLINE = 1
    DEVICE = 2


# Message header: [total words, kind, feed mode, feed length].
_HEADER = 4


@dataclass(frozen=True)
class StepMessage:
    """One step for the other ranks: the plan, where its fed inputs go (``feed_targets``), and
    their values when they came in the message (``feed_values``; None with ``on_device``: a
    device broadcast of int64 follows)."""

    plan: StepPlan
    feed_targets: list[int] | None = None
    feed_values: list[int] | None = None
    on_device: bool = False


class StepChannel:
    """Rank 0 -> every other rank, in order, over the group's control group: the runner
    options once (an object), then steps and a stop (int64 tensors)."""

    def __init__(self, parallel: TensorParallel) -> None:
        if parallel.size < 2:
            raise ValueError("a StepChannel joins two or more ranks; this model is not split")
        self.parallel = parallel
        self._source = 0 if parallel.control is None else dist.get_global_rank(parallel.control, 0)
        self._first = torch.zeros(FIRST_WORDS, dtype=torch.int64)

    def send_options(self, options: RunnerOptions) -> None:
        """Rank 0: hand the runner options to every other rank."""
        dist.broadcast_object_list([options], src=self._source, group=self.parallel.control)

    def receive_options(self) -> object:
        """Other ranks: the options rank 0 sent (checked by the caller)."""
        box: list[object] = [None]
        dist.broadcast_object_list(box, src=self._source, group=self.parallel.control)
        return box[0]

    def send_step(self, plan: StepPlan, feed: TokenFeed | None) -> None:
        """Rank 0: send ``plan`` and its feed (values on the CPU go in the message; on a
        device, by a device broadcast after it)."""
        words = [0, _Kind.STEP.value, _Feed.NONE.value, 0]
        encode_plan(plan, words)
        values = None
        if feed is not None:
            values = _fed_values(feed)
            words[3] = len(feed.targets)
            words += feed.targets
            if values.device.type == "cpu":
                words[2] = _Feed.INLINE.value
                words += values.tolist()
                values = None
            else:
                words[2] = _Feed.DEVICE.value
        self._send_words(words)
        if values is not None:
            self.broadcast_tensor(values.to(torch.int64))

    def send_stop(self) -> None:
        """Rank 0: end the other ranks' loops."""
        self._send_words([0, _Kind.STOP.value, _Feed.NONE.value, 0])

    def receive(self) -> StepMessage | None:
        """Other ranks: the next step rank 0 sent (blocks until it comes), None for a stop. A
        step ``on_device`` is followed by its fed values' device broadcast, which the caller
        receives next (`broadcast_tensor`)."""
        words = self._receive_words()
        if words[1] == _Kind.STOP:
            return None
        if words[1] != _Kind.STEP:
            raise RuntimeError(f"rank 0 sent a message of kind {words[1]} where a step comes; "
                               "every rank must run the same dyngen version")
        plan, at = decode_plan(words, _HEADER)
        mode, count = words[2], words[3]
        if mode == _Feed.NONE:
            return StepMessage(plan)
        targets = words[at:at + count]
        if mode == _Feed.INLINE:
            return StepMessage(plan, targets, words[at + count:at + 2 * count])
        return StepMessage(plan, targets, None, on_device=True)

    def broadcast_tensor(self, tensor: torch.Tensor) -> None:
        """Rank 0's ``tensor`` into every other rank's ``tensor`` (same shape and dtype), over
        the device group (on CUDA, NCCL: no host wait)."""
        source = 0 if self.parallel.group is None else dist.get_global_rank(self.parallel.group, 0)
        dist.broadcast(tensor, src=source, group=self.parallel.group)

    def _send_words(self, words: list[int]) -> None:
        words[0] = len(words)
        head = min(len(words), FIRST_WORDS)
        self._first[:head] = torch.tensor(words[:head], dtype=torch.int64)
        self._broadcast(self._first)
        if len(words) > FIRST_WORDS:
            self._broadcast(torch.tensor(words[FIRST_WORDS:], dtype=torch.int64))

    def _receive_words(self) -> list[int]:
        self._broadcast(self._first)
        total = int(self._first[0])
        words: list[int] = self._first[:min(total, FIRST_WORDS)].tolist()
        if total > FIRST_WORDS:
            rest = torch.empty(total - FIRST_WORDS, dtype=torch.int64)
            self._broadcast(rest)
            words += rest.tolist()
        return words

    def _broadcast(self, tensor: torch.Tensor) -> None:
        dist.broadcast(tensor, src=self._source, group=self.parallel.control)


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
    refuses to run.

    A step that raises on rank 0 once its plan was sent leaves the other ranks inside that
    step's collectives: the group is out of step for good (``broken`` holds the error). Every
    later step then raises at once, naming it, instead of hanging until the group's timeout,
    and `close` sends nothing (the other ranks could not take it)."""

    def __init__(self, model: Model, cache: Cache, options: RunnerOptions) -> None:
        if not model.parallel.is_first:
            raise ValueError(
                f"rank {model.parallel.rank} runs serve_tensor_parallel_worker(model, cache); "
                "only rank 0 builds the DynamicGenerator"
            )
        self.channel = StepChannel(model.parallel)
        self.channel.send_options(options)  # before our runner: both ranks capture graphs together
        self.runner = options.build(model, cache)
        self.closed = False
        self.broken: BaseException | None = None

    @property
    def graph_captures(self) -> int:
        """`ModelRunner.graph_captures` of rank 0's runner."""
        return self.runner.graph_captures

    def short_prefill_lengths(self) -> tuple[int, ...]:
        """`ModelRunner.short_prefill_lengths` of rank 0's runner (every rank has the same
        shapes)."""
        return self.runner.short_prefill_lengths()

    def run(self, plan: StepPlan, feed: TokenFeed | None = None) -> torch.Tensor | None:
        if self.closed:
            raise RuntimeError("this generator was closed (its tensor-parallel workers have "
                               "stopped); build a new one")
        if self.broken is not None:
            raise RuntimeError(
                f"a step failed on rank 0 after the other ranks had started it "
                f"({self.broken!r}), so the tensor-parallel group is out of step and runs no "
                "more steps; close this generator and build a new one") from self.broken
        try:
            self.channel.send_step(plan, feed)
            return self.runner.run(plan, feed)
        except BaseException as exc:
            self.broken = exc
            raise

    def close(self) -> None:
        """Stop the other ranks' loops (once; a broken group is sent nothing)."""
        if not self.closed:
            self.closed = True
            if self.broken is None:
                self.channel.send_stop()


def serve_tensor_parallel_worker(model: Model, cache: Cache) -> int:
    """Run the steps rank 0's generator sends, over this rank's shard of ``model`` and
    ``cache`` (built as rank 0 built its own), until rank 0 closes it; returns the number of
    steps run. Raises ValueError on rank 0 or for a model that is not split."""
    parallel = model.parallel
    if parallel.size < 2 or parallel.is_first:
        raise ValueError("serve_tensor_parallel_worker runs on ranks 1 and up of a model "
                         "loaded with tensor_parallel > 1; rank 0 builds the generator")
    channel = StepChannel(parallel)
    options = channel.receive_options()
    if not isinstance(options, RunnerOptions):
        raise RuntimeError(f"rank 0 sent {type(options).__name__} where the runner options "
                           "come first; every rank must run the same dyngen version")
    runner = options.build(model, cache)
    steps = 0
    while (message := channel.receive()) is not None:
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
    """The feed of a received step: its values from the message, or from rank 0's device
    broadcast."""
    targets = message.feed_targets
    if targets is None:
        return None
    if message.on_device:
        values = torch.empty(len(targets), dtype=torch.int64, device=device)
        channel.broadcast_tensor(values)
    else:
        assert message.feed_values is not None
        values = torch.tensor(message.feed_values, dtype=torch.int64, device=device)
    rows = list(range(len(targets)))
    return TokenFeed(values, targets, rows, in_order=targets == rows)
