"""The quantized caches' exact rows: page heads and each sequence's recent window.

The sdpa backend's reading rule (`attention.sdpa.extend_with_recent`) against a plain per-query
oracle, the window's own bookkeeping, and model-level consequences: a window covering the whole
context reproduces the unquantized cache, and decoding token by token sees what one prefill
sees.
"""

from __future__ import annotations

import math
import random
from pathlib import Path

import pytest
import torch

from dyngen_core import Model
from dyngen_core.config import ModelConfig
from dyngen_core.engine.plan import SequenceSlice, StepPlan
from dyngen_core.kv.attention.base import ForwardBatch, build_forward_batch
from dyngen_core.kv.attention.sdpa import SdpaBackend
from dyngen_core.kv.cache import make_storage
from dyngen_core.kv.quant.storage import QuantStorage
from dyngen_core.kv.quant.window import RecentWindow
from dyngen_core.kv.storage import KVStorage
from tests.tiny_models import write_tiny_model

PAGE, WINDOW = 16, 4
HEADS, KV_HEADS, DIM = 4, 2, 32
# (query tokens this step, context after it, has a slot) per sequence.
CASES = {
    "decodes": [(1, 21, True), (1, 17, True), (1, 33, False), (1, 2, True), (1, 1, True)],
    "chunks": [(9, 40, True), (3, 19, True), (20, 20, True), (6, 30, False)],
    "mixed": [(1, 35, True), (12, 50, True), (1, 16, False), (2, 18, True)],
}


def _config() -> ModelConfig:
    return ModelConfig(architecture="LlamaForCausalLM", vocab_size=32,
                       hidden_size=HEADS * DIM, intermediate_size=64, num_layers=1,
                       num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=DIM)


def _exact_rows(ctx: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(ctx, KV_HEADS, DIM, generator=gen) * 2,
            torch.randn(ctx, KV_HEADS, DIM, generator=gen))


def _setup(case: str, kind: type[QuantStorage] = QuantStorage
           ) -> tuple[QuantStorage, ForwardBatch, list[tuple[torch.Tensor, ...]]]:
    """Earlier context of every sequence written (pages, then window rows as a real run
    would) into a ``kind`` storage, and the step's batch; the exact keys/values of every
    position per sequence."""
    storage = kind(_config(), 32, PAGE, torch.float32, ["cpu"], "q4", recent_window=WINDOW)
    storage.reserve_sequences(8)
    order = list(range(32))
    random.Random(case).shuffle(order)
    slices, slots, rows, used = [], [], [], 0
    for index, (qlen, ctx, has_slot) in enumerate(CASES[case]):
        table, used = order[used:used + math.ceil(ctx / PAGE)], used + math.ceil(ctx / PAGE)
        keys, values = _exact_rows(ctx, seed=index)
        slot = index if has_slot else -1
        for pos in range(ctx - qlen):  # one token per step, as decoding writes them
            where = torch.tensor([table[pos // PAGE] * PAGE + pos % PAGE])
            storage.write(0, keys[pos:pos + 1], values[pos:pos + 1], where)
            storage.write_recent(0, keys[pos:pos + 1], values[pos:pos + 1],
                                 torch.tensor([pos]), torch.tensor([slot]))
        slices.append(SequenceSlice(index, [1] * qlen, ctx - qlen, table, True))
        slots.append(slot)
        rows.append((keys, values))
    batch = build_forward_batch(StepPlan(slices), PAGE, "cpu", seq_slots=slots)
    return storage, batch, rows


def _oracle(storage: QuantStorage, batch: ForwardBatch, rows: list[tuple[torch.Tensor, ...]],
            q: torch.Tensor, has_slot: list[bool]) -> torch.Tensor:
    """Query at p reads key j exactly iff p - WINDOW < j <= p and the exact row is at hand
    (written in this step, or an earlier step's row the window still holds)."""
    out = torch.empty_like(q)
    start = 0
    for seq, (keys, values) in enumerate(rows):
        qlen, ctx = batch.query_lens_host[seq], batch.context_lens_host[seq]
        table = batch.page_table[seq:seq + 1, :math.ceil(ctx / PAGE)]
        page_keys, page_values = (t[0, :ctx] for t in storage.gather(0, table))
        first = ctx - qlen
        for i in range(qlen):
            p = first + i
            j = torch.arange(p + 1)
            held = (j >= first) | ((j >= first - WINDOW) & has_slot[seq])
            exact = (j > p - WINDOW) & held
            k = torch.where(exact[:, None, None], keys[:p + 1], page_keys[:p + 1])
            v = torch.where(exact[:, None, None], values[:p + 1], page_values[:p + 1])
            for head in range(HEADS):
                kv = head // (HEADS // KV_HEADS)
                weights = (q[start + i, head] @ k[:, kv].T * DIM ** -0.5).softmax(-1)
                out[start + i, head] = weights @ v[:, kv]
        start += qlen
    return out


@pytest.mark.parametrize("case", sorted(CASES))
def test_sdpa_reads_the_window_by_the_rule(case: str) -> None:
    storage, batch, rows = _setup(case)
    gen = torch.Generator().manual_seed(7)
    q = torch.randn(batch.num_tokens, HEADS, DIM, generator=gen)
    step_k = torch.cat([k[c - n:c] for (k, _), (n, c, _) in zip(rows, CASES[case], strict=True)])
    step_v = torch.cat([v[c - n:c] for (_, v), (n, c, _) in zip(rows, CASES[case], strict=True)])
    ours = SdpaBackend().attend(0, q, step_k, step_v, storage, batch, DIM ** -0.5)
    expected = _oracle(storage, batch, rows, q, [s for _, _, s in CASES[case]])
    torch.testing.assert_close(ours, expected, rtol=1e-4, atol=1e-4)
    without = _oracle(storage, batch, rows, q, [False] * len(rows))
    if any(s and n < WINDOW for n, _, s in CASES[case]):
        assert not torch.allclose(ours, without, atol=1e-3)  # the window rows did count


def _write(window: RecentWindow, keys: torch.Tensor, values: torch.Tensor,
           positions: torch.Tensor, slots: torch.Tensor) -> None:
    """Layer 0 of ``window`` takes rows [T, kv_heads, head_dim] of tokens at ``positions`` of
    the sequences in ``slots``, as the storage writes them."""
    index = window.index(positions, slots, torch.device("cpu"))
    window.write_rows(0, torch.stack((keys, values)), index)


def test_window_rows_carry_their_positions() -> None:
    window = RecentWindow(4, 2, KV_HEADS, DIM, torch.float32, [torch.device("cpu")])
    keys, values = _exact_rows(10, seed=3)
    _write(window, keys, values, torch.arange(10), torch.tensor([1] * 9 + [-1]))
    got_k, got_v, positions = window.gather(0, torch.tensor([1, 0, -1]))
    assert positions.tolist() == [[8, 5, 6, 7], [-1] * 4, [-1] * 4]  # 9 had no slot
    torch.testing.assert_close(got_k[0, 0], keys[8])
    torch.testing.assert_close(got_v[0, 1], values[5])
    window.clear([1])
    assert window.gather(0, torch.tensor([1]))[2].tolist() == [[-1] * 4]


def test_page_copies_carry_the_head_row() -> None:
    from dyngen_core.engine.plan import PageCopy

    storage = QuantStorage(_config(), 4, PAGE, torch.float32, ["cpu"], "q4")
    keys, values = _exact_rows(PAGE, seed=5)
    storage.write(0, keys, values, torch.arange(PAGE) + PAGE)  # page 1
    storage.copy_pages([PageCopy(src=1, dst=3, num_slots=5)])
    got, _ = storage.gather(0, torch.tensor([[3]]))
    torch.testing.assert_close(got[0, 0], keys[0])  # exact, not a 4-bit round trip


def _logits(model: Model, storage: KVStorage, ids: list[int], chunks: list[int],
            slot: int = 0) -> torch.Tensor:
    """Logits of every position of ``ids``, fed in chunks of the given sizes."""
    outputs, start = [], 0
    for size in chunks:
        plan = StepPlan([SequenceSlice(0, ids[start:start + size], start, [0, 1], True)])
        batch = build_forward_batch(plan, PAGE, "cpu", seq_slots=[slot])
        batch.logits_indices = torch.arange(size)
        outputs.append(model.forward(batch, storage, SdpaBackend()))
        start += size
    return torch.cat(outputs)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Model:
    folder = write_tiny_model(tmp_path_factory.mktemp("recent"), seed=4, hidden_size=128)
    return Model.load(Path(folder), device="cpu")


def _storage(model: Model, mode: str, window: int = WINDOW) -> KVStorage:
    """Pages 0 and 1 hold the sequence; the others make room for the two windows (a window
    never takes more than an unquantized storage of the same pages would)."""
    if mode == "fp16":
        storage = make_storage("fp16", model.config, 8, PAGE, model.dtype, model.layer_devices)
    else:
        storage = QuantStorage(model.config, 8, PAGE, model.dtype, model.layer_devices, mode,
                               recent_window=window)
    assert storage.reserve_sequences(2) == (0 if mode == "fp16" else 2)
    return storage


IDS = [5, 9, 2, 31, 8, 8, 17, 3, 22, 40, 6, 1, 13, 27, 19, 4, 11, 30, 2, 7, 45]


def test_a_window_over_the_whole_context_is_the_unquantized_cache(tiny: Model) -> None:
    exact = _logits(tiny, _storage(tiny, "fp16"), IDS, [7, 6, 1, 1, 6])
    covered = _logits(tiny, _storage(tiny, "q4", window=32), IDS, [7, 6, 1, 1, 6])
    narrow = _logits(tiny, _storage(tiny, "q4", window=2), IDS, [7, 6, 1, 1, 6])
    torch.testing.assert_close(covered, exact, rtol=1e-4, atol=1e-4)
    assert (narrow - exact).abs().max() > 1e-3


def test_decoding_token_by_token_sees_what_one_prefill_sees(tiny: Model) -> None:
    prefill = _logits(tiny, _storage(tiny, "q4"), IDS, [len(IDS)])
    decode = _logits(tiny, _storage(tiny, "q4"), IDS, [1] * len(IDS))
    no_slot = _logits(tiny, _storage(tiny, "q4"), IDS, [1] * len(IDS), slot=-1)
    agreement = (decode - prefill).abs().max()
    assert agreement < 0.1 * (no_slot - prefill).abs().max()


def test_a_chunk_longer_than_the_window_keeps_its_last_rows() -> None:
    """Only the newest ``window`` rows of each sequence are written, so no two tokens of one
    write land on the same row (CUDA's index_copy_ would keep an arbitrary one)."""
    window = RecentWindow(4, 2, KV_HEADS, DIM, torch.float32, [torch.device("cpu")])
    keys, values = _exact_rows(10, seed=9)
    slots = torch.tensor([0] * 7 + [1] * 3)
    positions = torch.tensor([*range(7), *range(3)])
    _write(window, keys, values, positions, slots)
    layer = window.layers[0]
    assert layer.positions[:8].tolist() == [4, 5, 6, 3, 0, 1, 2, -1]
    # The dropped rows went to the spare row (the CPU keeps the last of them there).
    torch.testing.assert_close(layer.keys[-1], keys[2])
    torch.testing.assert_close(layer.keys[0], keys[4])
    torch.testing.assert_close(layer.keys[4:7], keys[7:10])


def test_cache_chooses_the_window(tiny: Model) -> None:
    from dyngen_core import Cache

    assert Cache(tiny, max_tokens=64, mode="q4", page_size=PAGE).storage.recent_window == 16
    assert Cache(tiny, max_tokens=64, mode="q8", page_size=PAGE).storage.recent_window == 0
    off = Cache(tiny, max_tokens=64, mode="q4", page_size=PAGE, recent_window=0).storage
    off.reserve_sequences(4)
    assert isinstance(off, QuantStorage) and off.recent is None
    wide = Cache(tiny, max_tokens=64, mode="q8", page_size=PAGE, recent_window=32).storage
    wide.reserve_sequences(4)
    assert isinstance(wide, QuantStorage) and wide.recent is not None
    assert wide.recent.window == 32
    with pytest.raises(ValueError, match="quantized modes"):
        Cache(tiny, max_tokens=64, page_size=PAGE, recent_window=8)
    with pytest.raises(ValueError, match=">= 0"):
        Cache(tiny, max_tokens=64, mode="q4", page_size=PAGE, recent_window=-1)


def test_the_runner_assigns_slots_only_where_storage_keeps_windows(tiny: Model) -> None:
    from dyngen_core import Cache
    from dyngen_core.runtime.runner import ModelRunner

    def runner(mode: str) -> ModelRunner:
        cache = Cache(tiny, max_tokens=128, mode=mode, page_size=PAGE)
        return ModelRunner(tiny, cache, SdpaBackend(), cuda_graphs=False, max_batch_size=4)

    assert runner("fp16").slots is None and runner("q8").slots is None
    windowed = runner("q4")
    assert windowed.slots is not None and windowed.slots.capacity == 4
    plan = StepPlan([SequenceSlice(7, IDS[:5], 0, [0], True)])
    assert windowed.run(plan) is not None
    storage = windowed.cache.storage
    assert isinstance(storage, QuantStorage)
    held = storage.gather_recent(0, torch.tensor(windowed.slots.assign([7])[0]))
    assert held is not None and held[2].max().item() == 4  # job 7's window holds positions 0-4
