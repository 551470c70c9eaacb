"""`ops.graph_capture.capture` on CUDA: a garbage collection that would start inside a capture
and finalize a dropped graph (a dropped generator's graphs, which a reference cycle keeps until
the collector runs) waits until the capture has ended, so the capture succeeds."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from dyngen_core.ops.graph_capture import capture

pytestmark = pytest.mark.gpu


class _Cycle:
    """A captured graph that only a cyclic collection frees (it refers to itself)."""

    def __init__(self, graph: torch.cuda.CUDAGraph) -> None:
        self.graph = graph
        self.itself = self


def _captured_graph(device: torch.device) -> torch.cuda.CUDAGraph:
    x = torch.zeros(8, device=device)
    graph = torch.cuda.CUDAGraph()
    with capture(graph):
        x.add_(1)
    return graph


def test_a_collection_during_a_capture_waits_for_its_end(cuda_device) -> None:
    y = torch.zeros(8, device=cuda_device)
    graph = torch.cuda.CUDAGraph()
    thresholds = gc.get_threshold()
    gc.collect()  # the cycle below is then young: a collection of generation 0 would free it
    holder = [_Cycle(_captured_graph(cuda_device))]
    dropped = weakref.ref(holder[0])
    assert any(obj is holder[0] for obj in gc.get_objects(generation=0))
    try:
        with capture(graph):
            holder.clear()  # garbage from here on
            gc.set_threshold(1)  # any allocation would now start a collection
            for _ in range(4):
                _ = [[] for _ in range(64)]  # tracked objects: each counts
                y.add_(1)
            assert dropped() is not None  # not collected inside the capture
    finally:
        gc.set_threshold(*thresholds)
    gc.collect()
    assert dropped() is None
    graph.replay()
    torch.cuda.synchronize(cuda_device)
    assert y.tolist() == [4.0] * 8
