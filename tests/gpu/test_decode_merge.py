"""Decode attention whose splits are merged inside the attention kernel (small decode batches,
`decode.merges_in_kernel`, `merge.count_in_and_merge`) against an sdpa reference over the same
pages and the second-launch merge: split counts from 2 to more splits than key blocks, contexts
from one token to several pages, half precision, the paged kernel over quantized pages with
their recent window, the counters back at zero after every call, and (CUDA) one captured graph
replayed with new context lengths. Runs on CUDA, or on the CPU under TRITON_INTERPRET=1 (small
shapes)."""

from __future__ import annotations

import math
import random
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from dyngen_core.config import ModelConfig
from dyngen_core.engine.plan import SequenceSlice, StepPlan
from dyngen_core.kv.attention.base import ForwardBatch, build_forward_batch
from dyngen_core.kv.fp16 import FP16Storage
from tests.gpu.conftest import interpreter_mode

pytestmark = pytest.mark.gpu

HEADS, KV_HEADS = 8, 2

# Merge and write in the kernel at every batch size these tests use (the backend's rule stops
# at small batches).
ANY_BATCH = 1 << 20


def _shape(device: torch.device) -> dict[str, object]:
    """Small shapes under the interpreter; real ones on CUDA."""
    if device.type == "cuda":
        return {"page": 256, "head_dim": 128, "block_n": 64, "dtype": torch.bfloat16,
                "contexts": [1, 300, 1100, 5000, 64]}
    return {"page": 16, "head_dim": 32, "block_n": 16, "dtype": torch.float32,
            "contexts": [1, 5, 17, 40, 70]}


def _storage(device: torch.device, dtype: torch.dtype, page: int, head_dim: int,
             num_pages: int, seed: int = 0) -> FP16Storage:
    """One layer of random keys and values in every page."""
    config = ModelConfig(architecture="LlamaForCausalLM", vocab_size=32,
                         hidden_size=HEADS * head_dim, intermediate_size=64, num_layers=1,
                         num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=head_dim)
    storage = FP16Storage(config, num_pages, page, dtype, [device])
    gen = torch.Generator().manual_seed(seed)
    for cache in (storage.keys[0], storage.values[0]):
        cache.copy_((torch.randn(cache.shape, generator=gen) * 2).to(dtype))
    return storage


def _tables(contexts: list[int], page: int, num_pages: int, seed: int) -> list[list[int]]:
    order = list(range(num_pages))
    random.Random(seed).shuffle(order)
    tables, used = [], 0
    for ctx in contexts:
        count = math.ceil(ctx / page)
        tables.append(order[used:used + count])
        used += count
    return tables


def _decode_batch(contexts: list[int], tables: list[list[int]], page: int,
                  device: torch.device) -> ForwardBatch:
    slices = [SequenceSlice(i, [1], ctx - 1, table, True)
              for i, (ctx, table) in enumerate(zip(contexts, tables, strict=True))]
    return build_forward_batch(StepPlan(slices), page, device)


def _reference(q: torch.Tensor, storage: FP16Storage, contexts: list[int],
               tables: list[list[int]], scale: float) -> torch.Tensor:
    """Per sequence: its keys gathered through its page table, then torch's sdpa (GQA)."""
    page = storage.page_size
    outs = []
    for row, (ctx, table) in enumerate(zip(contexts, tables, strict=True)):
        slots = torch.tensor([table[p // page] * page + p % page for p in range(ctx)],
                             device=q.device)
        keys = storage.keys[0].flatten(0, 1)[slots].float().transpose(0, 1)
        values = storage.values[0].flatten(0, 1)[slots].float().transpose(0, 1)
        query = q[row].float()[:, None, :]
        outs.append(F.scaled_dot_product_attention(query, keys, values, scale=scale,
                                                   enable_gqa=True)[:, 0])
    return torch.stack(outs)


def _backend(monkeypatch: pytest.MonkeyPatch, splits: int, block_n: int,
             in_kernel_seqs: int = ANY_BATCH) -> Any:
    """A backend without cascades whose decodes split ``splits`` ways over ``block_n``-key
    tiles and merge (and write) in the kernel up to ``in_kernel_seqs`` sequences."""
    from dyngen_core.kv.attention.triton import decode  # needs triton
    from dyngen_core.kv.attention.triton.paged import TritonPagedBackend

    monkeypatch.setattr(decode, "BLOCK_N", block_n)
    monkeypatch.setattr(decode, "MAX_SPLITS", splits)
    monkeypatch.setattr(decode, "PROGRAMS_PER_SM", 4096)
    monkeypatch.setattr(decode, "IN_KERNEL_MAX_SEQS", in_kernel_seqs)
    return TritonPagedBackend(cascade_min_saved_keys=None)


def _splits(batch: ForwardBatch, device: torch.device) -> int:
    from dyngen_core.kv.attention.triton.decode import decode_splits

    return decode_splits(batch.num_seqs * KV_HEADS, device)


def _case(device: torch.device, dtype: torch.dtype | None = None, seed: int = 0
          ) -> tuple[FP16Storage, ForwardBatch, torch.Tensor, list[int], list[list[int]]]:
    shape = _shape(device)
    page, head_dim = int(shape["page"]), int(shape["head_dim"])  # type: ignore[call-overload]
    contexts: list[int] = shape["contexts"]  # type: ignore[assignment]
    dtype = dtype or shape["dtype"]  # type: ignore[assignment]
    num_pages = sum(math.ceil(c / page) for c in contexts) + 2
    storage = _storage(device, dtype, page, head_dim, num_pages, seed)  # type: ignore[arg-type]
    tables = _tables(contexts, page, num_pages, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    q = torch.randn(len(contexts), HEADS, head_dim, generator=gen).to(device, dtype)
    return storage, _decode_batch(contexts, tables, page, device), q, contexts, tables


def _relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref).norm() / ref.norm())


@pytest.mark.parametrize("splits", [2, 5, 12, 32])
def test_merge_matches_reference(device: torch.device, monkeypatch: pytest.MonkeyPatch,
                                 splits: int) -> None:
    """Exact dots (float32 on the CPU): the in-kernel merge agrees with sdpa and with the
    two-launch merge, also with more splits than a context has key blocks (12 on the CPU's
    at most 5 blocks; 32 on CUDA)."""
    if splits > 12 and interpreter_mode():
        pytest.skip("slow under the interpreter; 12 splits already outnumber the key blocks")
    storage, batch, q, contexts, tables = _case(device)
    block_n = int(_shape(device)["block_n"])  # type: ignore[call-overload]
    scale = q.shape[2] ** -0.5
    ref = _reference(q, storage, contexts, tables, scale)
    backend = _backend(monkeypatch, splits, block_n)
    assert _splits(batch, q.device) == splits
    merged = backend.attend_cached(0, q, storage, batch, scale)
    assert backend.split_counters.held(q.device), "the merge took no counters"
    two_launch = _backend(monkeypatch, splits, block_n, in_kernel_seqs=0).attend_cached(
        0, q, storage, batch, scale)
    limit = 2e-5 if q.dtype == torch.float32 else 2e-2
    assert _relative_error(merged, ref) < limit
    assert _relative_error(merged, two_launch.float()) < limit


def test_counters_zero_after_every_call(device: torch.device,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Every call leaves the counters at zero, so a second call (a graph replay's case) merges
    again: a counter left behind would leave outputs unwritten."""
    storage, batch, q, contexts, tables = _case(device)
    block_n = int(_shape(device)["block_n"])  # type: ignore[call-overload]
    backend = _backend(monkeypatch, 4, block_n)
    scale = q.shape[2] ** -0.5
    first = backend.attend_cached(0, q, storage, batch, scale)
    held = backend.split_counters.held(q.device)
    assert len(held) == 1 and held[0].numel() >= batch.num_seqs * KV_HEADS
    assert int(held[0].abs().sum()) == 0
    second = backend.attend_cached(0, q, storage, batch, scale)
    torch.testing.assert_close(second, first, rtol=0, atol=0)
    assert int(held[0].abs().sum()) == 0


def test_half_precision(device: torch.device, monkeypatch: pytest.MonkeyPatch) -> None:
    """float16 pages and queries (tf32/half dots) against the float32 reference."""
    storage, batch, q, contexts, tables = _case(device, torch.float16)
    block_n = int(_shape(device)["block_n"])  # type: ignore[call-overload]
    scale = q.shape[2] ** -0.5
    out = _backend(monkeypatch, 8, block_n).attend_cached(0, q, storage, batch, scale)
    assert _relative_error(out, _reference(q, storage, contexts, tables, scale)) < 2e-2


@pytest.mark.parametrize("mode", ["q8", "q4"])
def test_quantized_pages_with_window(device: torch.device, monkeypatch: pytest.MonkeyPatch,
                                     mode: str) -> None:
    """The paged kernel over quantized pages with a recent window (its exact rows are read
    by the last split, which the merge always reads) agrees with the sdpa backend."""
    from dyngen_core.kv.attention.triton import paged
    from tests.gpu.test_quant_decode_triton import WINDOW, _outputs

    monkeypatch.setattr(paged, "word_decode_fits", lambda *args: False)
    backend = _backend(monkeypatch, 4, 16)
    out, ref = _outputs(mode, WINDOW, 32, torch.float32, device, backend)
    torch.testing.assert_close(out, ref, rtol=2e-4, atol=2e-4)
    assert all(int(c.abs().sum()) == 0 for c in backend.split_counters.held(device))


def test_counters_grow_and_keep_older_buffers(device: torch.device) -> None:
    """A larger batch gets a larger buffer; earlier ones stay alive (graphs hold them)."""
    from dyngen_core.kv.attention.triton.merge import SplitCounters

    counters = SplitCounters()
    small = counters.for_launch(device, 3)
    assert counters.for_launch(device, 3) is small
    large = counters.for_launch(device, small.numel() + 1)
    assert large.numel() > small.numel()
    assert counters.held(device) == [small, large]
    assert counters.for_launch(device, 2) is large


def test_graph_replays_with_new_context_lengths(cuda_device: torch.device,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """One capture (after an eager warm-up, as the runner does) replayed twice with other
    context lengths and page tables: each replay matches the reference."""
    if interpreter_mode():
        pytest.skip("CUDA graphs need CUDA")
    page, head_dim, dtype = 256, 128, torch.bfloat16
    runs = [[300, 5000, 1], [4000, 2, 777]]
    width = max(math.ceil(c / page) for run in runs for c in run)
    num_pages = 3 * width + 2
    storage = _storage(cuda_device, dtype, page, head_dim, num_pages)
    static_tables = _tables([width * page] * 3, page, num_pages, seed=5)
    batch = _decode_batch([width * page] * 3, static_tables, page, cuda_device)
    q = torch.randn(3, HEADS, head_dim, device=cuda_device).to(dtype)
    backend = _backend(monkeypatch, 32, 64)
    scale = head_dim ** -0.5
    backend.attend_cached(0, q, storage, batch, scale)  # warm-up: compiles, allocates counters
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = backend.attend_cached(0, q, storage, batch, scale)
    for seed, contexts in enumerate(runs):
        tables = _tables(contexts, page, num_pages, seed=seed)
        padded = [t + [0] * (width - len(t)) for t in tables]
        batch.page_table.copy_(torch.tensor(padded, dtype=torch.int32))
        batch.context_lens.copy_(torch.tensor(contexts, dtype=torch.int32))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert _relative_error(out, _reference(q, storage, contexts, tables, scale)) < 2e-2
        assert int(backend.split_counters.held(cuda_device)[0].abs().sum()) == 0


def test_larger_batches_keep_two_launches(device: torch.device,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Above `decode.IN_KERNEL_MAX_SEQS` sequences a decode merges in a second launch (no
    counters are taken) and gives the same attention."""
    storage, batch, q, contexts, tables = _case(device)
    block_n = int(_shape(device)["block_n"])  # type: ignore[call-overload]
    scale = q.shape[2] ** -0.5
    backend = _backend(monkeypatch, 4, block_n, in_kernel_seqs=batch.num_seqs - 1)
    out = backend.attend_cached(0, q, storage, batch, scale)
    assert backend.split_counters.held(q.device) == []
    ref = _reference(q, storage, contexts, tables, scale)
    assert _relative_error(out, ref) < (2e-5 if q.dtype == torch.float32 else 2e-2)
