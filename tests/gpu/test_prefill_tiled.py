"""The tiled prefill kernel (`attention.triton.prefill`) against the sdpa reference over the
same pages: mixed batches of several sequences whose chunks start at nonzero positions over
cached context (and from position 0), query lengths 1..300 (so tiles straddle the causal
diagonal, key blocks and pages), GQA groups 1/3/4/8, head_dim 64/128 (and 96, padded), bf16,
fp16 and float32, several tile shapes (the module constants patched), and an output buffer
poisoned with NaN so an unwritten row fails. Runs on CUDA, or on the CPU under
TRITON_INTERPRET=1 (small shapes)."""

from __future__ import annotations

import importlib.util
import math
import random
from typing import Any

import pytest
import torch

from dyngen_core.config import ModelConfig
from dyngen_core.engine.plan import SequenceSlice, StepPlan
from dyngen_core.kv.attention.base import ForwardBatch, build_forward_batch
from dyngen_core.kv.attention.sdpa import SdpaBackend
from dyngen_core.kv.fp16 import FP16Storage

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                 reason="triton is not installed")]


def _setup(lens: list[tuple[int, int]], heads: int, kv_heads: int, head_dim: int,
           page_size: int, dtype: torch.dtype, device: torch.device, seed: int = 0,
           ) -> tuple[FP16Storage, ForwardBatch, torch.Tensor, torch.Tensor, torch.Tensor]:
    """lens: (query tokens this step, context after it) per sequence. Pages are shuffled; the
    cached context is written; returns the step's q, k, v (k, v not yet written)."""
    gen = torch.Generator().manual_seed(seed)
    config = ModelConfig(architecture="LlamaForCausalLM", vocab_size=32,
                         hidden_size=heads * head_dim, intermediate_size=64, num_layers=1,
                         num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim)
    counts = [math.ceil(ctx / page_size) for _, ctx in lens]
    num_pages = sum(counts) + 2
    storage = FP16Storage(config, num_pages, page_size, dtype, [device])
    order = list(range(1, num_pages))
    random.Random(seed).shuffle(order)
    slices, used = [], 0
    for job, ((qlen, ctx), count) in enumerate(zip(lens, counts, strict=True)):
        table, used = order[used:used + count], used + count
        cached = ctx - qlen
        if cached:
            where = torch.tensor([table[p // page_size] * page_size + p % page_size
                                  for p in range(cached)], device=device)
            keys, values = (torch.randn(cached, kv_heads, head_dim, generator=gen)
                            .to(device, dtype) for _ in range(2))
            storage.write(0, keys, values, where)
        slices.append(SequenceSlice(job_id=job, token_ids=[1] * qlen, start_pos=cached,
                                    page_table=table, sample=True))
    batch = build_forward_batch(StepPlan(slices=slices), page_size, device)
    q, k, v = (torch.randn(batch.num_tokens, n, head_dim, generator=gen).to(device, dtype)
               for n in (heads, kv_heads, kv_heads))
    return storage, batch, q * 2, k, v


def _tiled(monkeypatch: pytest.MonkeyPatch, **constants: int) -> Any:
    """A `TiledPrefill` with `prefill`'s constants of these (lower-case) names set."""
    from dyngen_core.kv.attention.triton import prefill

    for name, value in constants.items():
        monkeypatch.setattr(prefill, name.upper(), value)
    return prefill.TiledPrefill()


def _check(lens: list[tuple[int, int]], heads: int, kv_heads: int, head_dim: int,
           page_size: int, dtype: torch.dtype, device: torch.device,
           monkeypatch: pytest.MonkeyPatch, **constants: int) -> None:
    storage, batch, q, k, v = _setup(lens, heads, kv_heads, head_dim, page_size, dtype, device)
    scale = head_dim ** -0.5
    ref = SdpaBackend().attend(0, q, k, v, storage, batch, scale).float()  # writes k, v
    out = torch.full_like(q, float("nan"))
    if _small(device):  # pages of 16 slots
        constants = {"block_n": 16, "float32_block_n": 16, **constants}
    tiled = _tiled(monkeypatch, **constants)
    tiled.attend(q, storage.keys[0], storage.values[0], batch, scale, out)
    assert torch.isfinite(out).all(), "rows left unwritten (or NaN)"
    error = float((out.float() - ref).norm() / ref.norm())
    assert error < (2e-3 if dtype == torch.float32 else 1.5e-2), error


def _small(device: torch.device) -> bool:
    return device.type != "cuda"


def _mixed(device: torch.device) -> list[tuple[int, int]]:
    """Chunks over cached context, a chunk from position 0, decodes, lengths to 300."""
    if _small(device):
        return [(37, 60), (1, 9), (20, 20), (5, 70), (16, 33), (3, 3)]
    return [(300, 1000), (1, 77), (130, 130), (45, 600), (64, 320), (2, 300), (257, 513)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("groups", [(8, 8), (8, 2), (8, 1), (6, 2)])
def test_tiled_prefill_matches_sdpa(device: torch.device, monkeypatch: pytest.MonkeyPatch,
                                    dtype: torch.dtype, groups: tuple[int, int]) -> None:
    """GQA groups 1, 4, 8 and 3 (padded to 4) in every dtype."""
    if _small(device) and dtype == torch.bfloat16:
        pytest.skip("Triton 3.6's interpreter garbles bfloat16 (the paged kernel's output too)")
    main_dtype = torch.float32 if _small(device) else torch.bfloat16
    if dtype != main_dtype and groups != (8, 2):
        pytest.skip("one layout is enough for the other dtypes (each layout compiles anew)")
    # float32 dots run without tensor cores: a smaller head keeps their compile short.
    head_dim = 32 if _small(device) else (64 if dtype == torch.float32 else 128)
    page_size = 16 if _small(device) else 256
    _check(_mixed(device), *groups, head_dim, page_size, dtype, device, monkeypatch)


@pytest.mark.parametrize("head_dim", [64, 96])
def test_tiled_prefill_head_dims(device: torch.device, monkeypatch: pytest.MonkeyPatch,
                                 head_dim: int) -> None:
    """Head dims of a power of two and one padded to the next (128: the other tests)."""
    dtype = torch.float32 if _small(device) else torch.bfloat16
    page_size = 16 if _small(device) else 256
    _check(_mixed(device), 8, 2, head_dim, page_size, dtype, device, monkeypatch)


@pytest.mark.parametrize("options", [
    {"heads_per_tile": 1}, {"heads_per_tile": 2, "block_n": 16},
    {"rows": 64, "min_rows": 32, "block_n": 128, "stages": 3},
    {"short_query": 0}, {"short_query": 100},
    {"float32_rows": 32, "float32_block_n": 16},
])
def test_tiled_prefill_tile_shapes(device: torch.device, monkeypatch: pytest.MonkeyPatch,
                                   options: dict[str, int]) -> None:
    """Other tiles: one head per tile (tokens only), tiles splitting a group, key steps
    smaller and larger (on CUDA) than the default, a small float32 tile, the short chunks
    in the long chunks' launch or more chunks in the short launch."""
    if _small(device):
        options = {**options, "block_n": 16}
    small_float = _small(device) or "float32_rows" in options
    dtype = torch.float32 if small_float else torch.bfloat16
    page_size = 16 if _small(device) else 256
    head_dim = 32 if _small(device) else (64 if small_float else 128)
    _check(_mixed(device), 8, 2, head_dim, page_size, dtype, device, monkeypatch, **options)


@pytest.mark.parametrize("longest", ["question", "tiny"])
def test_short_chunks_over_a_long_prefix(device: torch.device, monkeypatch: pytest.MonkeyPatch,
                                         longest: str) -> None:
    """Short chunks over a long cached context (the shared-document question shape): a
    longest chunk filling most of a tile's tokens, and one taking the short tile."""
    if _small(device):
        lens = [(15, 90), (5, 85), (12, 40)] if longest == "question" else [(7, 90), (3, 40)]
        options = {"float32_rows": 128}
    else:
        lens = ([(30, 8060), (17, 4000)] * 3 if longest == "question"
                else [(9, 8039), (16, 700), (2, 300)])
        options = {}
    dtype = torch.float32 if _small(device) else torch.bfloat16
    _check(lens, 8, 2, 32 if _small(device) else 128, 16 if _small(device) else 256, dtype,
           device, monkeypatch, **options)


def _tiled_launches(batch: ForwardBatch) -> list[object]:
    """The tiled path's launches kept in the batch's memo."""
    return [v for k, v in batch.memo.items() if isinstance(k, tuple) and k[0] == "tiled_prefill"]


def test_backend_takes_the_tiled_path_and_agrees(device: torch.device,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Through `TritonPagedBackend.attend`: the tiled path runs (its block table is built) and
    agrees with the reference and with the paged kernel, which takes batches whose longest
    query is below `prefill.MIN_QUERY`."""
    from dyngen_core.kv.attention.triton import prefill
    from dyngen_core.kv.attention.triton.paged import TritonPagedBackend

    dtype = torch.float32 if _small(device) else torch.bfloat16
    page_size = 16 if _small(device) else 256
    storage, batch, q, k, v = _setup(_mixed(device), 8, 2, 32 if _small(device) else 128,
                                     page_size, dtype, device)
    ref = SdpaBackend().attend(0, q, k, v, storage, batch, 0.2).float()
    if _small(device):
        monkeypatch.setattr(prefill, "FLOAT32_BLOCK_N", 16)
    tiled = TritonPagedBackend()
    out = tiled.attend(0, q, k, v, storage, batch, 0.2).float()
    assert _tiled_launches(batch)
    batch.memo.clear()
    monkeypatch.setattr(prefill, "MIN_QUERY", 1 << 20)
    paged = TritonPagedBackend()
    paged_out = paged.attend(0, q, k, v, storage, batch, 0.2)
    assert not _tiled_launches(batch)
    tolerance = 2e-3 if dtype == torch.float32 else 1.5e-2
    assert float((out - ref).norm() / ref.norm()) < tolerance
    assert float((paged_out.float() - ref).norm() / ref.norm()) < tolerance


def test_launches_split_short_chunks_and_order_blocks() -> None:
    """A batch with long and short chunks takes two launches, the short one a smaller tile;
    each lists its query blocks by keys read, most first, every query token once."""
    from dyngen_core.kv.attention.triton.prefill import TiledPrefill

    _, batch, *_ = _setup([(40, 40), (3, 200), (1, 5), (3, 50), (70, 90)], 4, 1, 16, 16,
                          torch.float32, torch.device("cpu"))
    long, short = TiledPrefill().launches(batch, torch.bfloat16, 4, torch.device("cpu"))
    assert (long.tile.block_q, long.tile.heads_per_tile, long.tile.warps) == (32, 4, 8)
    assert (short.tile.block_q, short.tile.heads_per_tile, short.tile.warps) == (4, 4, 4)
    assert list(zip(long.seq.tolist(), long.first.tolist(), strict=True)) == [
        (4, 64), (4, 32), (4, 0), (0, 32), (0, 0)]
    assert list(zip(short.seq.tolist(), short.first.tolist(), strict=True)) == [
        (1, 0), (3, 0), (2, 0)]
    assert long.seq.dtype == long.first.dtype == torch.int32
