"""Tensor-parallel worker processes that dyngen starts itself (no torchrun).

`TensorParallelWorkers.start` spawns ranks 1 .. N-1 (fresh interpreters, multiprocessing
"spawn"), each of which joins the group, loads its shard of the model, builds its cache and
serves rank 0's steps (`tensor_parallel.serve_tensor_parallel_worker`); this process joins the
group as rank 0. The group meets on a free port of 127.0.0.1 (one host). `stop` waits for the
workers after the generator has sent them the end of the steps, and leaves the group.
"""

from __future__ import annotations

import datetime
import multiprocessing
import os
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from multiprocessing.process import BaseProcess
from pathlib import Path

import torch
import torch.distributed as dist

from dyngen_core.config import ModelConfig
from dyngen_core.kv.cache import Cache
from dyngen_core.model import Model
from dyngen_core.model.model import resolve_device
from dyngen_core.model.parallel import backend_for, check_tensor_parallel
from dyngen_core.runtime.tensor_parallel import serve_tensor_parallel_worker

# How long a rank waits for the others to join the group or answer a collective.
GROUP_TIMEOUT = datetime.timedelta(minutes=10)


@dataclass(frozen=True)
class WorkerSpec:
    """What every worker loads: the model folder, its device and dtype options (as given to
    `Model.load`), and the cache's tokens and mode (as rank 0's cache)."""

    model_dir: Path
    device: str | torch.device | None
    dtype: str | torch.dtype | None
    cache_tokens: int
    cache_mode: str


class TensorParallelWorkers:
    """Ranks 1 .. size-1 of a tensor-parallel group, running in processes of their own."""

    def __init__(self, processes: list[BaseProcess]) -> None:
        self.processes = processes

    @classmethod
    def start(cls, size: int, spec: WorkerSpec) -> TensorParallelWorkers:
        """Spawn the workers and join the group as rank 0 (the default process group of this
        process). Raises ValueError for ``size < 2`` and RuntimeError when a group already
        exists in this process."""
        if size < 2:
            raise ValueError(f"tensor_parallel={size}: workers are for 2 or more ranks")
        if dist.is_initialized():
            raise RuntimeError("this process already belongs to a torch.distributed group; "
                               "load the model with Model.load(..., tensor_parallel=N) in each "
                               "rank and build the generator on rank 0 instead")
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
        port = _free_port()
        context = multiprocessing.get_context("spawn")
        processes: list[BaseProcess] = [
            context.Process(target=_worker_main, args=(rank, size, port, spec), daemon=True)
            for rank in range(1, size)
        ]
        for process in processes:
            process.start()
        dist.init_process_group(_backend(spec), init_method=f"tcp://127.0.0.1:{port}",
                                rank=0, world_size=size, timeout=GROUP_TIMEOUT)
        return cls(processes)

    def kill(self) -> None:
        """End the workers at once (rank 0 failed before it could stop them) and leave the
        group."""
        for process in self.processes:
            if process.is_alive():
                process.kill()
            process.join()
        if dist.is_initialized():
            dist.destroy_process_group()

    def stop(self, timeout_s: float = 60.0) -> None:
        """Wait for the workers to end (the generator has told them to), kill any still
        running after ``timeout_s``, and leave the group. Raises RuntimeError naming the
        workers that failed or had to be killed."""
        for process in self.processes:
            process.join(timeout_s)
        stuck = [p for p in self.processes if p.is_alive()]
        for process in stuck:
            process.kill()
            process.join()
        if dist.is_initialized():
            dist.destroy_process_group()
        failed = [rank for rank, p in enumerate(self.processes, start=1) if p.exitcode != 0]
        if failed:
            raise RuntimeError(f"tensor-parallel worker rank(s) {failed} failed or hung "
                               "(their errors are on stderr)")


@contextmanager
def workers_for(size: int, spec: WorkerSpec) -> Iterator[TensorParallelWorkers | None]:
    """The workers of a model split over ``size`` ranks, for the body that loads rank 0's
    part and builds its generator: None for ``size == 1``; else, once `check_tensor_parallel`
    has accepted ``size`` for the model of ``spec`` (ValueError naming tensor_parallel before
    any process starts), ranks 1 .. size-1 started and this process joined as rank 0. If the
    body raises, the workers are killed and the group left. The caller stops them later
    (`TensorParallelWorkers.stop`)."""
    if size == 1:
        yield None
        return
    check_tensor_parallel(size, ModelConfig.from_model_dir(spec.model_dir),
                          resolve_device(spec.device))
    workers = TensorParallelWorkers.start(size, spec)
    try:
        yield workers
    except BaseException:
        workers.kill()
        raise


def _backend(spec: WorkerSpec) -> str:
    return backend_for(resolve_device(spec.device))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _worker_main(rank: int, size: int, port: int, spec: WorkerSpec) -> None:
    """One worker: join the group, load this rank's shard and cache, serve until stopped."""
    if resolve_device(spec.device).type == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // size))
    dist.init_process_group(_backend(spec), init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=size, timeout=GROUP_TIMEOUT)
    try:
        model = Model.load(spec.model_dir, device=spec.device, dtype=spec.dtype,
                           tensor_parallel=size)
        serve_tensor_parallel_worker(model, Cache(model, max_tokens=spec.cache_tokens,
                                                  mode=spec.cache_mode))
    finally:
        dist.destroy_process_group()
