"""What sending each step's plan to the other tensor-parallel ranks costs, on the CPU (gloo).

Two parts, both over 2 spawned gloo ranks with torch on one thread each:

* ``channel``: rank 0 sends the same plan many times and rank 1 receives it into a `StepPlan`
  (what `serve_tensor_parallel_worker` does before each forward); the figure is rank 0's median
  time per message. ``object`` is how plans went before (``broadcast_object_list`` of the plan
  and its feed targets, then a tensor broadcast of the fed ids for a decode step fed from the
  step in flight); ``packed`` is `StepChannel` (one int64 tensor broadcast: plan words, targets
  and fed ids). ``floor`` is one broadcast of one int64, the least any message costs. Plans:
  decodes of 1, 8 and 64 jobs (2 pages each, fed in order) and one 2048-token prefill chunk.
* ``engine`` (``--engine``): a generator over a tiny random Llama (2 layers, hidden 64), split
  over 2 ranks by `DynamicGenerator.from_model_dir(tensor_parallel=2)` and in one process,
  greedy decoding of 8 prompts; ms per step for each, rank 0's time sending each step, and the
  difference. The tiny model makes the forward small, so the difference is mostly the step's
  trip and the forward's collectives.

    python benchmarks/tp_plan_broadcast.py [--reps 300] [--engine]

Timings on a small shared CPU mean something only when it is otherwise idle; the load average
is printed.
"""

from __future__ import annotations

import argparse
import datetime
import multiprocessing
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dyngen_core.engine.plan import PENDING_TOKEN, SequenceSlice, StepPlan  # noqa: E402
from dyngen_core.model.parallel import TensorParallel  # noqa: E402
from dyngen_core.runtime.generator import DynamicGenerator  # noqa: E402
from dyngen_core.runtime.overlap import TokenFeed  # noqa: E402
from dyngen_core.runtime.tensor_parallel import BroadcastRunner, StepChannel  # noqa: E402
from dyngen_core.runtime.workers import _free_port  # noqa: E402


def decode_plan_of(batch: int) -> StepPlan:
    return StepPlan([SequenceSlice(1000 + i, [PENDING_TOKEN], 300 + i, [2 * i, 2 * i + 1], True)
                     for i in range(batch)])


def prefill_plan() -> StepPlan:
    return StepPlan([SequenceSlice(9, list(range(2048)), 0, list(range(8)), True)])


CASES: dict[str, tuple[StepPlan, bool]] = {
    "decode 1": (decode_plan_of(1), True),
    "decode 8": (decode_plan_of(8), True),
    "decode 64": (decode_plan_of(64), True),
    "prefill 2048": (prefill_plan(), False),
}


def _send_object(channel: StepChannel, plan: StepPlan, feed: TokenFeed | None) -> None:
    """The former way: the plan and feed targets pickled, then the fed ids as a tensor."""
    targets = None if feed is None else feed.targets
    dist.broadcast_object_list([(plan, targets, torch.int64)], src=0)
    if feed is not None:
        channel.broadcast_tensor(feed.ids[:len(feed.targets)].contiguous())


def _receive_object(channel: StepChannel) -> None:
    box: list[object] = [None]
    dist.broadcast_object_list(box, src=0)
    _, targets, dtype = box[0]  # type: ignore[misc]
    if targets is not None:
        channel.broadcast_tensor(torch.empty(len(targets), dtype=dtype))


def _timed(step: Callable[[], None], reps: int) -> float:
    for _ in range(20):
        step()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def channel_rank(rank: int, port: int, reps: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2, timeout=datetime.timedelta(seconds=120))
    world = dist.group.WORLD
    channel = StepChannel(TensorParallel(rank, 2, world, world))
    one = torch.zeros(1, dtype=torch.int64)
    floor = _timed(lambda: dist.broadcast(one, src=0), reps)
    if rank == 0:
        print(f"floor (one int64 broadcast): {floor:.3f} ms")
    for name, (plan, fed) in CASES.items():
        ids = torch.arange(len(plan.slices), dtype=torch.int64)
        feed = TokenFeed(ids, list(range(len(ids))), list(range(len(ids))), in_order=True) \
            if fed else None
        if rank == 0:
            old = _timed(partial(_send_object, channel, plan, feed), reps)
            new = _timed(partial(channel.send_step, plan, feed), reps)
            print(f"{name:>13}: object {old:.3f} ms, packed {new:.3f} ms ({old / new:.1f}x)")
        else:
            _timed(partial(_receive_object, channel), reps)
            _timed(channel.receive, reps)
    dist.destroy_process_group()


def run_channel(reps: int) -> None:
    port = _free_port()
    context = multiprocessing.get_context("spawn")
    ranks = [context.Process(target=channel_rank, args=(r, port, reps)) for r in range(2)]
    for process in ranks:
        process.start()
    for process in ranks:
        process.join()


def run_engine(steps: int) -> None:
    from dyngen_core import SamplerSettings
    from tests.tiny_models import TRAINING_TEXT, write_tiny_model

    torch.set_num_threads(1)
    folder = write_tiny_model(tempfile.mkdtemp(prefix="tp_bench_"), arch="llama", seed=3)
    prompts = [TRAINING_TEXT[40 * i:40 * i + 60] for i in range(8)]
    greedy = SamplerSettings.greedy()
    per_step = {}
    for size in (1, 2):
        generator = DynamicGenerator.from_model_dir(
            folder, cache_tokens=4096, device="cpu", tensor_parallel=size,
            attention_backend="sdpa")
        sends = _time_sends(generator)
        try:
            generator.generate(prompts, max_new_tokens=4, add_bos=True, stop_conditions=[],
                               gen_settings=greedy)  # warm-up
            sends.clear()
            start = time.perf_counter()
            generator.generate(prompts, max_new_tokens=steps, add_bos=True,
                               stop_conditions=[], gen_settings=greedy)
            elapsed = time.perf_counter() - start
        finally:
            generator.close()
        per_step[size] = elapsed / steps * 1e3
        sent = f", of which {sum(sends) / len(sends) * 1e3:.2f} ms sending the step" \
            if sends else ""
        print(f"engine tensor_parallel={size}: {per_step[size]:.2f} ms per step{sent} "
              f"({steps} steps of 8 jobs, prefill included)")
    print(f"engine split - whole: {per_step[2] - per_step[1]:.2f} ms per step")


def _time_sends(generator: DynamicGenerator) -> list[float]:
    """The seconds each of rank 0's step sends takes, from now on (empty for one process)."""
    times: list[float] = []
    runner = generator._runner
    if not isinstance(runner, BroadcastRunner):
        return times
    channel = runner.channel
    send = channel.send_step

    def timed(*args: object) -> None:
        start = time.perf_counter()
        send(*args)
        times.append(time.perf_counter() - start)

    channel.send_step = timed  # type: ignore[method-assign]
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=300)
    parser.add_argument("--engine", action="store_true", help="also time a tiny generator")
    parser.add_argument("--steps", type=int, default=64, help="new tokens per engine run")
    args = parser.parse_args()
    print(f"load average {os.getloadavg()[0]:.2f}, torch {torch.__version__}")
    run_channel(args.reps)
    if args.engine:
        run_engine(args.steps)


if __name__ == "__main__":
    main()
