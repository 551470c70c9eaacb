"""Run a function on several CPU processes joined in one gloo group, for the tensor-parallel
tests: each rank is a fresh interpreter (multiprocessing "spawn"), the group meets on a free
local port, and a rank that is still running after the limit is killed and fails the test (a
collective that one rank never joins would otherwise block CI forever)."""

from __future__ import annotations

import datetime
import multiprocessing
import os
import socket
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

RankMain = Callable[[int, int, Any], None]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_ranks(main: RankMain, world_size: int, arg: Any, *, limit_s: float = 120.0,
              torchrun_env: bool = False) -> None:
    """Call ``main(rank, world_size, arg)`` on ``world_size`` processes joined in a gloo group
    (the default group; torch on one thread each). ``main`` must be a module-level function.
    torchrun_env: do not join the group; set the variables torchrun sets (RANK, WORLD_SIZE,
    LOCAL_RANK, MASTER_ADDR, MASTER_PORT) and let ``main`` join it (through Model.load).

    Raises AssertionError naming the ranks that failed (their tracebacks are on stderr) or
    that were still running after ``limit_s`` seconds (killed)."""
    context = multiprocessing.get_context("spawn")
    port = free_port()
    ranks = [context.Process(target=_rank_entry,
                             args=(main, rank, world_size, port, arg, torchrun_env))
             for rank in range(world_size)]
    for process in ranks:
        process.start()
    deadline = datetime.datetime.now() + datetime.timedelta(seconds=limit_s)
    for process in ranks:
        process.join(max(0.0, (deadline - datetime.datetime.now()).total_seconds()))
    hung = [rank for rank, p in enumerate(ranks) if p.is_alive()]
    for rank in hung:
        ranks[rank].kill()
        ranks[rank].join()
    assert not hung, f"ranks {hung} still ran after {limit_s} s (a collective hung); killed"
    failed = [rank for rank, p in enumerate(ranks) if p.exitcode != 0]
    assert not failed, f"ranks {failed} failed (exit codes {[ranks[r].exitcode for r in failed]})"


def _rank_entry(main: RankMain, rank: int, world_size: int, port: int, arg: Any,
                torchrun_env: bool) -> None:
    torch.set_num_threads(1)
    if torchrun_env:
        os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    else:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world_size, timeout=datetime.timedelta(seconds=60))
    try:
        main(rank, world_size, arg)
    except BaseException:
        traceback.print_exc()
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_in_child(main: Callable[[Any], None], arg: Any, *, limit_s: float = 120.0) -> None:
    """Call ``main(arg)`` in a fresh process (torch on one thread) that joins no group itself,
    for code that starts its own ranks; fails when it fails or is still running after
    ``limit_s`` seconds (then it and its own children are killed with it)."""
    context = multiprocessing.get_context("spawn")
    process = context.Process(target=_child_entry, args=(main, arg))
    process.start()
    process.join(limit_s)
    if process.is_alive():
        process.kill()
        process.join()
        raise AssertionError(f"the child still ran after {limit_s} s (a collective hung); killed")
    assert process.exitcode == 0, f"the child failed (exit code {process.exitcode})"


def _child_entry(main: Callable[[Any], None], arg: Any) -> None:
    torch.set_num_threads(1)
    try:
        main(arg)
    except BaseException:
        traceback.print_exc()
        raise
