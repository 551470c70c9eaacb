"""How many recent windows a quantized cache keeps, and what they cost.

A q6/q4 cache keeps the last positions of each running sequence unquantized, beside its pages.
The runner asks for ``max_batch_size`` windows; the storage keeps at most one per page (every
sequence of a step writes into a page of its own, so no more can run at once) and never more
than fit in the bytes of the unquantized cache of the same ``max_tokens``. `nbytes` counts
them, no quantized cache outweighs the "fp16" one, and a sequence left without a window still
reads its whole context, from the pages.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dyngen_core import Cache, Model
from dyngen_core.config import ModelConfig
from dyngen_core.engine.plan import SequenceSlice, StepPlan
from dyngen_core.kv.attention.sdpa import SdpaBackend
from dyngen_core.kv.cache import make_storage
from dyngen_core.kv.quant.storage import DEFAULT_RECENT_WINDOW, QuantStorage
from dyngen_core.runtime.runner import ModelRunner
from tests.tiny_models import write_tiny_model

MODES = ("q8", "q6", "q4")
BATCH_SIZES = (1, 8, 64, 256)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Model:
    """head_dim 32 (hidden 128), the smallest the quantized modes take."""
    folder = write_tiny_model(tmp_path_factory.mktemp("sizing"), seed=5, hidden_size=128)
    return Model.load(Path(folder), device="cpu")


def _window_bytes(model: Model, slots: int, window: int) -> int:
    """Bytes of ``slots`` windows of ``window`` rows (and the spare row) over every layer: a
    key and value row per kv head in the model dtype, and one int32 position, per row."""
    if slots == 0:
        return 0
    config = model.config
    element = torch.empty((), dtype=model.dtype).element_size()
    per_row = 2 * config.num_kv_heads * config.head_dim * element + 4
    return config.num_layers * (slots * window + 1) * per_row


@pytest.mark.parametrize("page_size", [16, 256])
@pytest.mark.parametrize("mode", MODES)
def test_a_quantized_cache_never_outweighs_fp16_and_counts_its_windows(
        tiny: Model, mode: str, page_size: int) -> None:
    max_tokens = 4096
    sixteen_bit = Cache(tiny, max_tokens=max_tokens, page_size=page_size)
    cache = Cache(tiny, max_tokens=max_tokens, mode=mode, page_size=page_size)
    storage = cache.storage
    assert isinstance(storage, QuantStorage)
    assert storage.unquantized_nbytes() == sixteen_bit.nbytes()
    window = DEFAULT_RECENT_WINDOW[mode]
    for batch in BATCH_SIZES:
        runner = ModelRunner(tiny, cache, SdpaBackend(), cuda_graphs=False,
                             max_batch_size=batch)
        slots = runner.slots.capacity if runner.slots is not None else 0
        if window == 0:
            assert slots == 0
        elif page_size == 256:  # big pages: the page count binds before the bytes do
            assert slots == min(batch, cache.num_pages)
        else:  # 16-row windows over 16-slot pages: the bytes bind
            assert 1 <= slots <= min(batch, cache.num_pages)
        assert cache.nbytes() == storage.page_nbytes() + _window_bytes(tiny, slots, window)
        assert cache.nbytes() <= sixteen_bit.nbytes(), (mode, page_size, batch)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("page_size", [16, 64, 256])
@pytest.mark.parametrize("mode", MODES)
def test_the_demo_shape_stays_within_fp16(dtype: torch.dtype, page_size: int,
                                          mode: str) -> None:
    """The demo model's kv shape (3 kv heads of 64; two layers stand for its 30, every layer
    being alike), windows of 16 and 64 rows asked for 256 sequences."""
    config = ModelConfig(architecture="LlamaForCausalLM", vocab_size=32, hidden_size=576,
                         intermediate_size=64, num_layers=2, num_heads=9, num_kv_heads=3,
                         head_dim=64)
    num_pages = 4096 // page_size
    devices = [torch.device("cpu")] * 2
    sixteen_bit = make_storage("fp16", config, num_pages, page_size, dtype, devices)
    for window in (16, 64):
        storage = QuantStorage(config, num_pages, page_size, dtype, devices, mode,
                               recent_window=window)
        slots = storage.reserve_sequences(256)
        assert 1 <= slots <= num_pages
        assert storage.window_nbytes() > 0
        assert storage.nbytes() == storage.page_nbytes() + storage.window_nbytes()
        assert storage.nbytes() <= sixteen_bit.nbytes(), (window, slots)
        # One window more would have crossed the line (or there is one per page already).
        per_row = 2 * 3 * 64 * torch.empty((), dtype=dtype).element_size() + 4
        one_more = storage.nbytes() + 2 * window * per_row
        assert slots == num_pages or one_more > sixteen_bit.nbytes()


def test_windows_are_kept_for_one_sequence_per_page(tiny: Model) -> None:
    cache = Cache(tiny, max_tokens=1024, mode="q4")  # 4 pages of 256
    runner = ModelRunner(tiny, cache, SdpaBackend(), cuda_graphs=False, max_batch_size=256)
    assert runner.slots is not None and runner.slots.capacity == cache.num_pages == 4
    storage = cache.storage
    assert isinstance(storage, QuantStorage) and storage.recent is not None
    assert storage.recent.slots == 4
    off = Cache(tiny, max_tokens=1024, mode="q4", recent_window=0)
    assert ModelRunner(tiny, off, SdpaBackend(), cuda_graphs=False).slots is None


A_IDS = [5, 9, 2, 31, 8, 8, 17, 3, 22, 40, 6, 1, 13, 27, 19, 4, 11, 30, 2, 7, 45]
B_IDS = [12, 3, 3, 41, 7, 28, 9, 16, 2, 35, 20, 11, 6, 44, 1, 18, 25, 9, 30, 5, 14]
PAGE = 16


def _token_by_token(model: Model, recent_window: int | None, jobs: dict[int, list[int]],
                    max_batch_size: int) -> dict[int, torch.Tensor]:
    """Each job's logits at every position, every job fed one token per step, all jobs in
    every step (in ``jobs`` order), through a runner over a fresh 8-page q4 cache."""
    cache = Cache(model, max_tokens=8 * PAGE, mode="q4", page_size=PAGE,
                  recent_window=recent_window)
    runner = ModelRunner(model, cache, SdpaBackend(), cuda_graphs=False,
                         max_batch_size=max_batch_size)
    tables = {job: [2 * i, 2 * i + 1] for i, job in enumerate(jobs)}
    rows: dict[int, list[torch.Tensor]] = {job: [] for job in jobs}
    for pos in range(len(next(iter(jobs.values())))):
        plan = StepPlan([SequenceSlice(job, [ids[pos]], pos, tables[job], True)
                         for job, ids in jobs.items()])
        logits = runner.run(plan)
        assert logits is not None
        for job, row in zip(jobs, logits, strict=True):
            rows[job].append(row)
    return {job: torch.stack(r) for job, r in rows.items()}


def test_a_sequence_without_a_window_reads_its_context_from_the_pages(tiny: Model) -> None:
    """With one window slot, job 1 holds it and job 2 runs without: job 1 sees what it sees
    alone, and job 2 what a one-row window gives (its decode queries then read only their own
    row exactly, every earlier key from the pages), not what its own window would."""
    together = _token_by_token(tiny, None, {1: A_IDS, 2: B_IDS}, max_batch_size=1)
    alone = _token_by_token(tiny, None, {1: A_IDS}, max_batch_size=1)
    torch.testing.assert_close(together[1], alone[1], rtol=1e-5, atol=1e-5)
    pages_only = _token_by_token(tiny, 1, {2: B_IDS}, max_batch_size=1)
    torch.testing.assert_close(together[2], pages_only[2], rtol=1e-5, atol=1e-5)
    windowed = _token_by_token(tiny, None, {2: B_IDS}, max_batch_size=1)
    assert (windowed[2] - together[2]).abs().max() > 1e-3  # the window would have counted
