"""`sampling.draw.DrawGraphs` parts that need no GPU: the row buckets a graph reads (never past the
logits' storage) and the sampler's refusal of graphs where they cannot run."""

from __future__ import annotations

import pytest
import torch

from dyngen_core.sampling.draw import ROW_BUCKET, _bucket, _rows_held
from dyngen_core.sampling.sampler import Sampler


def test_buckets_round_up_within_the_storage() -> None:
    buffer = torch.zeros(100, 50)
    assert _rows_held(buffer[:7]) == 100
    assert _bucket(buffer[:7]) == ROW_BUCKET
    assert _bucket(buffer[:33]) == 2 * ROW_BUCKET
    assert _bucket(buffer[:99]) == 100  # capped at the rows the storage holds
    assert _bucket(buffer[60:95]) == 40  # from the view's offset on
    assert _bucket(buffer[:5, :20]) == ROW_BUCKET  # a column view reads the same rows
    assert _rows_held(buffer[:, 10:]) == 100
    assert _rows_held(torch.zeros(3, 50)[:, :10]) == 3


def test_graphs_need_cuda_and_the_fused_draw() -> None:
    with pytest.raises(ValueError, match="draw_graphs=True needs a CUDA device"):
        Sampler(64, "cpu", draw_graphs=True)
    assert Sampler(64, "cpu").draw_graphs is None
