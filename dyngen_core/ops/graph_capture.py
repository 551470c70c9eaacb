"""How the engine captures a CUDA graph (`capture`): the one place the decode, verify and draw
graphs enter torch's capture, so each capture runs under the same two guards.

- ``thread_local`` capture mode: a lazy capture on the engine's thread neither fails on another
  thread's unrelated CUDA call (an embedding model beside the engine's background thread) nor
  fails that call.
- Python's cyclic garbage collector is paused for the capture. torch no longer collects before
  a capture, so a collection may start inside one (any Python allocation can start it) and
  finalize a dropped generator's graphs: destroying a CUDA graph is not permitted in a
  capturing thread and invalidates the capture. The collector resumes, as it was, afterwards.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from torch.cuda import _POOL_HANDLE


@contextmanager
def collector_paused() -> Iterator[None]:
    """Pause Python's cyclic garbage collector for the block; afterwards it is enabled again
    only if it was enabled before (a caller's own ``gc.disable()`` is kept)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


@contextmanager
def capture(graph: torch.cuda.CUDAGraph,
            pool: _POOL_HANDLE | None = None) -> Iterator[None]:
    """Capture the CUDA work of the block into ``graph``.

    Args:
        graph: an empty `torch.cuda.CUDAGraph` to record into.
        pool: the memory pool of graphs this one shares memory with (``graph.pool()`` of an
            earlier capture), or None for a fresh pool. Graphs sharing a pool must never run
            concurrently.
    """
    with collector_paused(), torch.cuda.graph(graph, pool=pool,
                                              capture_error_mode="thread_local"):
        yield
