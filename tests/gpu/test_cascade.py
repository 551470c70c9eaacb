"""Shared-prefix ("cascade") decode attention against the plain Triton kernel and sdpa.

Each case builds page tables the way prefix dedup does (groups of decodes whose tables begin
with the same page ids, then pages of their own), fills every page with random keys and values,
and runs one decode step through `TritonPagedBackend` with the cascade, without it, and through
`SdpaBackend`. The step's own keys/values are the ones already in the cache at each sequence's
slot, so the three runs see identical pages even where members end inside a shared page. The
cascade's launch settings are `cascade_path`'s module constants, patched per test.
"""

from __future__ import annotations

import importlib.util
import random
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import pytest
import torch

from dyngen_core.config import ModelConfig
from dyngen_core.engine.plan import SequenceSlice, StepPlan
from dyngen_core.kv.attention.base import build_forward_batch
from dyngen_core.kv.attention.sdpa import SdpaBackend
from dyngen_core.kv.fp16 import FP16Storage
from tests.gpu.conftest import interpreter_mode

if TYPE_CHECKING:
    from dyngen_core.kv.attention.triton.paged import TritonPagedBackend

pytestmark = pytest.mark.gpu
PAGE = 16  # small pages keep the interpreter fast; CUDA runs the same logic


@dataclass(frozen=True)
class Layout:
    """groups: per group (shared pages, each member's context length); loners: context
    lengths of sequences in no group (the first shares its first page with nobody)."""

    groups: list[tuple[int, list[int]]]
    loners: list[int]


def _backend(cascade: bool, **options: int) -> TritonPagedBackend:
    """The Triton backend with or without the cascade (``options``: the decode geometry,
    `conftest.DECODE_GEOMETRY`, patched for the test)."""
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed")
    from dyngen_core.kv.attention.triton.paged import TritonPagedBackend
    from tests.gpu.conftest import DECODE_GEOMETRY, decode_geometry

    decode_geometry(**{key: options.pop(key) for key in DECODE_GEOMETRY if key in options})
    return TritonPagedBackend(cascade_min_saved_keys=0 if cascade else None, **options)


def _settings(monkeypatch: pytest.MonkeyPatch, **constants: Any) -> Any:
    """`cascade_path` with ``constants`` (its launch settings) patched for the test."""
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed")
    from dyngen_core.kv.attention.triton import cascade_path

    for name, value in constants.items():
        assert hasattr(cascade_path, name), name
        monkeypatch.setattr(cascade_path, name, value)
    return cascade_path


def _slices(layout: Layout, seed: int, page: int = PAGE) -> tuple[list[SequenceSlice], int]:
    """Decode slices with dedup-shaped page tables over shuffled page ids; and the page count."""
    tables: list[tuple[list[int], int]] = []
    next_page = 0

    def take(count: int) -> list[int]:
        nonlocal next_page
        next_page += count
        return list(range(next_page - count, next_page))

    for shared_pages, contexts in layout.groups:
        shared = take(shared_pages)
        for ctx in contexts:
            assert ctx >= shared_pages * page, "a member must see its whole prefix"
            tables.append((shared + take(-(-ctx // page) - shared_pages), ctx))
    for ctx in layout.loners:
        tables.append((take(-(-ctx // page)), ctx))
    ids = list(range(1, next_page + 1))  # page 0 stays unused, as in the real pool
    random.Random(seed).shuffle(ids)
    order = list(range(len(tables)))
    random.Random(seed + 1).shuffle(order)  # members of a group need not be adjacent
    slices = [SequenceSlice(job_id=i, token_ids=[1], start_pos=tables[j][1] - 1,
                            page_table=[ids[p] for p in tables[j][0]], sample=True)
              for i, j in enumerate(order)]
    return slices, next_page + 1


def _run(layout: Layout, heads: tuple[int, int, int], dtype: torch.dtype, device: torch.device,
         seed: int = 0, page: int = PAGE, **options: int) -> dict[str, torch.Tensor]:
    num_heads, num_kv_heads, head_dim = heads
    config = ModelConfig(architecture="LlamaForCausalLM", vocab_size=32,
                         hidden_size=num_heads * head_dim, intermediate_size=64, num_layers=1,
                         num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim)
    slices, num_pages = _slices(layout, seed, page)
    storage = FP16Storage(config, num_pages, page, dtype, [device])
    gen = torch.Generator().manual_seed(seed)
    for pages in (storage.keys[0], storage.values[0]):
        pages.copy_(torch.randn(pages.shape, generator=gen).to(dtype))
    batch = build_forward_batch(StepPlan(slices=slices), page, device)
    q = torch.randn(batch.num_tokens, num_heads, head_dim, generator=gen).to(device, dtype)
    # The step's keys/values are what the cache already holds at each slot: rewriting them is a
    # no-op, so members whose current slot lies in a shared page agree on its contents.
    k = storage.keys[0].view(-1, num_kv_heads, head_dim)[batch.slot_mapping].clone()
    v = storage.values[0].view(-1, num_kv_heads, head_dim)[batch.slot_mapping].clone()
    scale = head_dim ** -0.5
    cascade = _backend(True, **options)
    assert cascade.cascade.plan(batch, storage), "the case must exercise the cascade"
    graph_tables = cascade.graph_tables(storage, num_heads, num_kv_heads, len(slices))
    assert graph_tables is not None and graph_tables.stage(StepPlan(slices=slices)) is not None
    return {
        "cascade": cascade.attend(0, q, k, v, storage, batch, scale).float(),
        "plain": _backend(False, **options).attend(0, q, k, v, storage, batch, scale).float(),
        "sdpa": SdpaBackend().attend(0, q, k, v, storage, batch, scale).float(),
    }


def _relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert torch.isfinite(out).all(), "output holds NaN or inf"
    return float((out - ref).norm() / ref.norm())


def _check(outs: dict[str, torch.Tensor], dtype: torch.dtype) -> None:
    tolerance = 2e-3 if dtype == torch.float32 else 2e-2
    assert _relative_error(outs["cascade"], outs["sdpa"]) < tolerance
    assert _relative_error(outs["cascade"], outs["plain"]) < tolerance
    # Row by row too: one wrong query row must not hide in the norm of the whole batch.
    rows = (outs["cascade"] - outs["sdpa"]).flatten(1).norm(dim=1)
    assert float(rows.max() / outs["sdpa"].flatten(1).norm(dim=1).min()) < 10 * tolerance


MIXED = Layout(
    # Group A: 3 shared pages, 5 members (two row blocks of 4 members at GQA 4 with 16 rows),
    # one ending exactly at the prefix (its own keys: none) and one just past it.
    groups=[(3, [3 * PAGE, 3 * PAGE + 1, 3 * PAGE + 7, 4 * PAGE + 3, 6 * PAGE]),
            # Group B: 1 shared page, 2 members.
            (1, [PAGE + 9, 2 * PAGE + 2])],
    loners=[5, 2 * PAGE + 11],
)


def test_cascade_matches_plain_and_sdpa_fp32_gqa(device: torch.device,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    _settings(monkeypatch, PREFIX_ROWS=16)
    outs = _run(MIXED, (8, 2, 32), torch.float32, device, block_n=16)
    _check(outs, torch.float32)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cascade_half_precision(device: torch.device, dtype: torch.dtype) -> None:
    if dtype == torch.bfloat16 and interpreter_mode():
        pytest.skip("Triton 3.6's interpreter miscomputes tl.dot on bfloat16 (a 16x16 product "
                    "is off by ~1e10; the plain kernel fails the same way): CUDA only")
    layout = Layout(groups=[(2, [2 * PAGE + 3, 2 * PAGE + 12, 3 * PAGE])], loners=[PAGE + 1])
    outs = _run(layout, (4, 2, 32), dtype, device, seed=1)
    _check(outs, dtype)


@pytest.mark.parametrize("heads", [(4, 4, 16), (6, 2, 24)])
def test_cascade_head_layouts(device: torch.device, monkeypatch: pytest.MonkeyPatch,
                              heads: tuple[int, int, int]) -> None:
    """MHA (one row per member and head) and a group of 3 heads with a head_dim of 24 (both
    padded to powers of two inside the kernels)."""
    _settings(monkeypatch, PREFIX_ROWS=16)
    layout = Layout(groups=[(2, [2 * PAGE + 1, 2 * PAGE + 5, 3 * PAGE + 4])], loners=[3])
    outs = _run(layout, heads, torch.float32, device, seed=2)
    _check(outs, torch.float32)


def test_cascade_long_prefix_split_many_ways(device: torch.device,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """Prefix and own keys split along the context (several programs per group and sequence),
    with members ending exactly at the prefix (their own keys: none, so their rows rest on
    the prefix partials alone) next to a long sequence in no group; the own-keys pass merges
    by its last split program."""
    cascade_path = _settings(monkeypatch)
    splits: list[tuple[int, int]] = []
    own_keys = cascade_path.attend_own_keys

    def spy(*args: Any, **kwargs: Any) -> torch.Tensor:
        splits.append((kwargs["splits"], args[4][1].shape[2]))
        return own_keys(*args, **kwargs)

    monkeypatch.setattr(cascade_path, "attend_own_keys", spy)
    layout = Layout(groups=[(9, [9 * PAGE, 9 * PAGE, 9 * PAGE + 40])], loners=[5 * PAGE + 3])
    monkeypatch.setattr(cascade_path, "PREFIX_PROGRAMS_PER_SM", 64)
    many = _run(layout, (4, 2, 16), torch.float32, device, seed=3, block_n=16,
                programs_per_sm=64)
    _check(many, torch.float32)
    one = _run(layout, (4, 2, 16), torch.float32, device, seed=3, block_n=16, max_splits=1)
    _check(one, torch.float32)
    assert splits == [(2, 3), (1, 1)]  # own keys, prefix splits of each cascade run
    assert _relative_error(many["cascade"], one["cascade"]) < 1e-4


@pytest.mark.parametrize(("most", "block", "splits", "keys", "window"), [
    (None, 1, 3, None, 0), (None, 2, 3, 32, 0), (1, 4, 1, None, 0), (1, 4, 1, 32, 0),
    # Page ids loaded ahead: 2 a window over three splits, 4 over the loner's 13 pages.
    (None, 2, 3, None, 2), (1, 4, 1, None, 4)])
def test_own_keys_splits_and_counters(device: torch.device, monkeypatch: pytest.MonkeyPatch,
                                      most: int | None, block: int, splits: int,
                                      keys: int | None, window: int) -> None:
    """The own-keys pass split three ways (its last program merging three own partials and
    the prefix's, ``block`` partials a round) or never split, at the backend's tile or its own
    (``keys``), with a page id per key or per tile (``window``), against sdpa and the default
    settings; the split counters are back to zero after the launch."""
    cascade_path = _settings(monkeypatch)
    # The loner's 201 own keys make three splits of at least 4 tiles of 16 keys.
    layout = Layout(groups=[(4, [4 * PAGE + 45, 4 * PAGE, 5 * PAGE + 2]),
                            (1, [PAGE + 40, 2 * PAGE + 3])],
                    loners=[12 * PAGE + 9])
    options = {"block_n": 16, "programs_per_sm": 64, "max_splits": 3}
    monkeypatch.setattr(cascade_path, "PREFIX_PROGRAMS_PER_SM", 64)
    default = _run(layout, (8, 2, 32), torch.float32, device, seed=8, **options)
    launches: list[tuple[int, torch.Tensor | None]] = []
    own_keys = cascade_path.attend_own_keys

    def spy(*args: Any, **kwargs: Any) -> torch.Tensor:
        out = own_keys(*args, **kwargs)
        launches.append((kwargs["splits"], kwargs["counters"]))
        return out

    monkeypatch.setattr(cascade_path, "attend_own_keys", spy)
    _settings(monkeypatch, OWN_MAX_SPLITS=most, MERGE_SPLIT_BLOCK=block, OWN_BLOCK_N=keys,
              OWN_WINDOW=window)
    outs = _run(layout, (8, 2, 32), torch.float32, device, seed=8, **options)
    _check(outs, torch.float32)
    assert [count for count, _ in launches] == [splits]
    counters = launches[0][1]
    assert (counters is None) == (splits == 1)
    assert counters is None or int(counters.abs().sum()) == 0
    assert _relative_error(outs["cascade"], default["cascade"]) < 1e-4


@pytest.mark.parametrize(("constants", "heads", "tiles", "block_n"), [
    # Tiles of 16 keys in pages of 32: two tiles a page, the second at slot 16.
    ({"PREFIX_BLOCK_N": 16}, (8, 2, 32), True, 16),
    # A 64-key tile wanted: halved to the page (32), one tile a page.
    ({}, (8, 2, 32), True, 32),
    # A padded head (24 of 32 columns) and a group of 3 heads padded to 4 rows.
    ({"PREFIX_BLOCK_N": 16}, (6, 2, 24), True, 16),
    # No tile of at least 16 keys divides a page of 32 at 8 wanted: the general kernel, at
    # the backend's own tile (8 keys is below the 16 a GPU dot needs).
    ({"PREFIX_BLOCK_N": 8}, (8, 2, 32), False, 64),
])
def test_prefix_kernels(device: torch.device, monkeypatch: pytest.MonkeyPatch,
                        constants: dict[str, Any], heads: tuple[int, int, int], tiles: bool,
                        block_n: int) -> None:
    """Both prefix kernels (and the rule choosing between them) against plain and sdpa, over
    prefixes of several tiles a page split many ways (chunks of whole tiles, some splits
    empty), 128 rows a program (a block of 32 members at GQA 4 holds two groups' worth of
    rows, most of them past the group's end)."""
    cascade_path = _settings(monkeypatch, PREFIX_ROWS=128, PREFIX_PROGRAMS_PER_SM=64,
                             **constants)
    launches: list[tuple[bool, int]] = []
    attend = cascade_path.attend_prefixes

    def spy(*args: Any, **kwargs: Any) -> Any:
        launch = args[-1]
        launches.append((launch.tiles, launch.block_n))
        return attend(*args, **kwargs)

    monkeypatch.setattr(cascade_path, "attend_prefixes", spy)
    page = 32
    layout = Layout(groups=[(3, [3 * page, 3 * page + 1, 4 * page + 5, 3 * page + 17]),
                            (1, [page + 2, 2 * page])], loners=[page + 7])
    outs = _run(layout, heads, torch.float32, device, seed=7, page=page, programs_per_sm=64)
    _check(outs, torch.float32)
    assert launches == [(tiles, block_n)]


def test_no_sharing_plans_no_cascade(device: torch.device) -> None:
    """A batch without shared pages, a batch with neither host page tables nor graph tables, a
    quantized cache and a batch with a prefill chunk never take the cascade."""
    backend = _backend(True)
    slices, num_pages = _slices(Layout(groups=[], loners=[PAGE + 1, 3 * PAGE, 2]), seed=4)
    config = ModelConfig(architecture="LlamaForCausalLM", vocab_size=32, hidden_size=64,
                         intermediate_size=64, num_layers=1, num_heads=2, num_kv_heads=1,
                         head_dim=32)
    storage = FP16Storage(config, num_pages, PAGE, torch.float32, [device])
    batch = build_forward_batch(StepPlan(slices=slices), PAGE, device)
    assert not backend.cascade.plan(batch, storage)
    shared, num_pages = _slices(Layout(groups=[(1, [PAGE + 1, PAGE + 2])], loners=[]), seed=5)
    storage = FP16Storage(config, num_pages, PAGE, torch.float32, [device])
    batch = build_forward_batch(StepPlan(slices=shared), PAGE, device)
    assert backend.cascade.plan(batch, storage)
    batch.page_tables_host = None
    assert not backend.cascade.plan(batch, storage)  # graphs pass no host tables
    from dyngen_core.kv.quant.storage import QuantStorage

    quant = QuantStorage(config, num_pages, PAGE, torch.float32, [device], mode="q8")
    assert backend.graph_tables(quant, 2, 1, 8) is None
    assert _backend(False).graph_tables(storage, 2, 1, 8) is None
    graph_tables = backend.graph_tables(storage, 2, 1, 8)
    assert graph_tables is not None
    assert graph_tables.stage(StepPlan(slices=shared)) is not None
    prefill = [*shared, SequenceSlice(job_id=9, token_ids=[1, 2], start_pos=0, page_table=[0],
                                      sample=True)]
    assert graph_tables.stage(StepPlan(slices=prefill)) is None


def test_graph_tables_fixed_grid_with_padding_rows(device: torch.device,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """The launch a CUDA graph captures: tables staged into a fixed region larger than the
    batch (`GraphCascade`), a bucket with padding rows (copies of the last sequence, in no
    group), fewer prefix programs than row blocks (each loops over blocks), and split counts
    from the bucket alone. Rows of the batch must equal sdpa's."""
    import numpy as np

    _settings(monkeypatch, PREFIX_ROWS=16)
    backend = _backend(True, block_n=16)
    # Three groups of two (one row block each at 4 members a block) and a loner: 7 sequences
    # in a bucket of 8, whose 2 prefix programs take the 3 blocks in turn.
    layout = Layout(groups=[(2, [2 * PAGE + 1, 3 * PAGE]), (1, [PAGE + 3, 2 * PAGE + 9]),
                            (3, [3 * PAGE + 2, 4 * PAGE])], loners=[2 * PAGE + 5])
    heads = (8, 2, 32)
    slices, num_pages = _slices(layout, seed=6)
    config = ModelConfig(architecture="LlamaForCausalLM", vocab_size=32, hidden_size=256,
                         intermediate_size=64, num_layers=1, num_heads=8, num_kv_heads=2,
                         head_dim=32)
    storage = FP16Storage(config, num_pages, PAGE, torch.float32, [device])
    gen = torch.Generator().manual_seed(6)
    for pages in (storage.keys[0], storage.values[0]):
        pages.copy_(torch.randn(pages.shape, generator=gen))
    bucket, real = 8, len(slices)
    static = backend.cascade.graph_tables(storage, heads[0], heads[1], capacity=12)
    assert static is not None and static.layout.members_per_block == 4
    plan = static.plan(StepPlan(slices=slices))
    assert plan is not None and len(plan.groups) == 3
    region = np.full(static.size, 12345, dtype=np.int32)  # stale entries must not be read
    writer = static.stage(StepPlan(slices=slices))
    assert writer is not None
    writer(region)
    padded = StepPlan(slices=[*slices, slices[-1]])
    batch = build_forward_batch(padded, PAGE, device)
    batch.page_tables_host = None  # as in a graph: the tables are all it has
    tables = static.views(torch.from_numpy(region).to(device), bucket)
    batch.graph_tables = tables
    assert tables.grid_blocks == 2
    q = torch.randn(bucket, heads[0], heads[2], generator=gen).to(device)
    q[real] = q[real - 1]  # the padding row repeats the last sequence
    k = storage.keys[0].view(-1, heads[1], heads[2])[batch.slot_mapping].clone()
    v = storage.values[0].view(-1, heads[1], heads[2])[batch.slot_mapping].clone()
    scale = heads[2] ** -0.5
    out = backend.attend(0, q, k, v, storage, batch, scale).float()
    plain = build_forward_batch(StepPlan(slices=slices), PAGE, device)
    ref = SdpaBackend().attend(0, q[:real], k[:real], v[:real], storage, plain, scale).float()
    _check({"cascade": out[:real], "plain": ref, "sdpa": ref}, torch.float32)
    # The padding row attends as its original does (its logits are dropped, but never NaN).
    assert _relative_error(out[real], out[real - 1]) < 1e-4
