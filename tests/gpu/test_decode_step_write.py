"""The decode step's key/value write inside the attention kernel (small decode batches over
float pages, `decode.StepWrite`): the pages afterwards hold exactly what the storage's own
write stores, and the output matches the sdpa reference over those pages, for one split and
several (more than key blocks, merged in the kernel), from strided key/value views (a fused
projection's), and (CUDA) through a captured graph replayed with new lengths and slots. Runs on
CUDA, or on the CPU under TRITON_INTERPRET=1 (small shapes)."""

from __future__ import annotations

import math

import pytest
import torch

from tests.gpu.conftest import interpreter_mode
from tests.gpu.test_decode_merge import (
    HEADS,
    KV_HEADS,
    _backend,
    _case,
    _decode_batch,
    _reference,
    _relative_error,
    _shape,
    _storage,
    _tables,
)

pytestmark = pytest.mark.gpu

def _step_rows(tokens: int, head_dim: int, dtype: torch.dtype, device: torch.device,
               seed: int = 7) -> tuple[torch.Tensor, torch.Tensor]:
    """Key and value rows as strided views of one fused [T, (H + 2 Hkv), D] projection."""
    gen = torch.Generator().manual_seed(seed)
    fused = torch.randn(tokens, HEADS + 2 * KV_HEADS, head_dim, generator=gen).to(device, dtype)
    return fused[:, HEADS:HEADS + KV_HEADS], fused[:, HEADS + KV_HEADS:]


@pytest.mark.parametrize("splits", [1, 3, 12])
def test_kernel_write_matches_storage_write(device: torch.device,
                                            monkeypatch: pytest.MonkeyPatch,
                                            splits: int) -> None:
    storage, batch, q, contexts, tables = _case(device)
    expected, _, _, _, _ = _case(device)
    k, v = _step_rows(len(contexts), q.shape[2], q.dtype, device)
    expected.write(0, k, v, batch.slot_mapping)
    assert not torch.equal(storage.keys[0], expected.keys[0])  # the write changes the pages
    block_n = int(_shape(device)["block_n"])  # type: ignore[call-overload]
    scale = q.shape[2] ** -0.5
    out = _backend(monkeypatch, splits, block_n).attend(0, q, k, v, storage, batch, scale)
    assert torch.equal(storage.keys[0], expected.keys[0])
    assert torch.equal(storage.values[0], expected.values[0])
    limit = 2e-5 if q.dtype == torch.float32 else 2e-2
    assert _relative_error(out, _reference(q, expected, contexts, tables, scale)) < limit


def test_prefill_batches_still_write_through_storage(device: torch.device,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """A batch that is not decode-only keeps the storage's write (before attention)."""
    from dyngen_core.engine.plan import SequenceSlice, StepPlan
    from dyngen_core.kv.attention.base import build_forward_batch

    storage, _, _, contexts, tables = _case(device)
    expected, _, _, _, _ = _case(device)
    page = storage.page_size
    slices = [SequenceSlice(0, [1, 1], contexts[2] - 2, tables[2], True),
              SequenceSlice(1, [1], contexts[3] - 1, tables[3], True)]
    batch = build_forward_batch(StepPlan(slices), page, device)
    dtype = storage.dtype
    k, v = _step_rows(3, storage.keys[0].shape[3], dtype, device)
    q = torch.randn(3, HEADS, storage.keys[0].shape[3]).to(device, dtype)
    expected.write(0, k, v, batch.slot_mapping)
    block_n = int(_shape(device)["block_n"])  # type: ignore[call-overload]
    _backend(monkeypatch, 2, block_n).attend(0, q, k, v, storage, batch, q.shape[2] ** -0.5)
    assert torch.equal(storage.keys[0], expected.keys[0])
    assert torch.equal(storage.values[0], expected.values[0])


def test_graph_replays_write_and_attend(cuda_device: torch.device,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """One capture of attend (write in the kernel, merge in the kernel), replayed with other
    lengths, page tables and slots: the rows land at the new slots, the output matches."""
    if interpreter_mode():
        pytest.skip("CUDA graphs need CUDA")
    page, head_dim, dtype = 256, 128, torch.bfloat16
    runs = [[300, 5000, 1], [4000, 2, 777]]
    width = max(math.ceil(c / page) for run in runs for c in run)
    num_pages = 3 * width + 2
    storage = _storage(cuda_device, dtype, page, head_dim, num_pages)
    batch = _decode_batch([width * page] * 3, _tables([width * page] * 3, page, num_pages, 5),
                          page, cuda_device)
    q = torch.randn(3, HEADS, head_dim, device=cuda_device).to(dtype)
    k, v = _step_rows(3, head_dim, dtype, cuda_device)
    backend = _backend(monkeypatch, 32, 64)
    scale = head_dim ** -0.5
    backend.attend(0, q, k, v, storage, batch, scale)  # warm-up: compiles, allocates counters
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = backend.attend(0, q, k, v, storage, batch, scale)
    for seed, contexts in enumerate(runs):
        tables = _tables(contexts, page, num_pages, seed=seed)
        slots = [t[(c - 1) // page] * page + (c - 1) % page
                 for t, c in zip(tables, contexts, strict=True)]
        batch.page_table.copy_(torch.tensor([t + [0] * (width - len(t)) for t in tables],
                                            dtype=torch.int32))
        batch.context_lens.copy_(torch.tensor(contexts, dtype=torch.int32))
        batch.slot_mapping.copy_(torch.tensor(slots))
        graph.replay()
        torch.cuda.synchronize()
        where = torch.tensor(slots, device=cuda_device)
        assert torch.equal(storage.keys[0].flatten(0, 1)[where], k)
        assert torch.equal(storage.values[0].flatten(0, 1)[where], v)
        assert _relative_error(out, _reference(q, storage, contexts, tables, scale)) < 2e-2
