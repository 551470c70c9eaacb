"""The q8/q4 decode kernel's in-kernel split merge (`attend_word_decode` with ``counters``)
against its second-kernel merge (`combine_splits_kernel`) and the sdpa reference over the same
storage: with and without the recent window, page and tail programs in one launch or two,
several splits (some empty) merged in one load round or several, batches of 1 and 3; the
counters are back to zero after every launch. Runs on CUDA, or on the CPU under
TRITON_INTERPRET=1 (small shapes)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from dyngen_core.kv.attention.base import ForwardBatch
from dyngen_core.kv.attention.sdpa import SdpaBackend
from dyngen_core.kv.quant.storage import QuantStorage
from tests.gpu.quant_setup import decode_step

pytestmark = pytest.mark.gpu

PAGE, WINDOW, HEADS, KV_HEADS, HEAD_DIM = 16, 4, 8, 2, 32
# (context after this step's token, has a window slot) per sequence, by batch size.
DECODES = {1: [(70, True)], 3: [(17, True), (33, False), (70, True)]}


def _setup(mode: str, window: int, decodes: list[tuple[int, bool]], dtype: torch.dtype,
           device: torch.device, seed: int
           ) -> tuple[QuantStorage, ForwardBatch, torch.Tensor, torch.Tensor]:
    """`quant_setup.decode_step` of ``decodes`` at this file's shapes."""
    return decode_step(mode, window, decodes, heads=HEADS, kv_heads=KV_HEADS,
                       head_dim=HEAD_DIM, page=PAGE, dtype=dtype, device=device, seed=seed)


def _attend(backend: Any, mode: str, window: int, batch_size: int, dtype: torch.dtype,
            device: torch.device, seed: int = 0) -> torch.Tensor:
    """``backend``'s output for one decode step over a fresh storage."""
    decodes = DECODES[batch_size]
    gen = torch.Generator().manual_seed(seed + 1)
    q = torch.randn(len(decodes), HEADS, HEAD_DIM, generator=gen).to(device, dtype)
    storage, batch, k, v = _setup(mode, window, decodes, dtype, device, seed)
    return backend.attend(0, q, k, v, storage, batch, HEAD_DIM ** -0.5).float()


def _word_route(monkeypatch: pytest.MonkeyPatch, merged: bool, launches: int,
                merge_rows: int) -> list[bool]:
    """Route the backend's word decodes through `attend_word_decode` with ``launches`` and
    ``merge_rows``; its output is poisoned (NaN) before the kernels write it, and with
    ``merged`` the second-kernel merge must not run. Returns, per call, whether counters were
    passed."""
    from dyngen_core.kv.attention.triton import paged as triton_paged
    from dyngen_core.kv.attention.triton import quant as triton_quant

    seen: list[bool] = []
    attend_word_decode = triton_quant.attend_word_decode
    empty_like = torch.empty_like

    def poisoned(tensor: torch.Tensor, **options: Any) -> torch.Tensor:
        return empty_like(tensor, **options).fill_(float("nan"))

    def routed(*args: Any, **keywords: Any) -> torch.Tensor:
        seen.append(keywords["counters"] is not None)
        with monkeypatch.context() as patch:
            patch.setattr(triton_quant.torch, "empty_like", poisoned)
            return attend_word_decode(*args, **(keywords | {"launches": launches,
                                                            "merge_rows": merge_rows}))

    def no_combine(*args: Any) -> None:
        raise AssertionError("combine_splits_kernel ran although the kernel merged")

    monkeypatch.setattr(triton_paged, "attend_word_decode", routed)
    if merged:
        monkeypatch.setattr(triton_quant, "launch_combine", no_combine)
    return seen


def _backend(splits: int, merged: bool) -> Any:
    """The Triton backend at this file's tiles with ``splits`` parts (triton imported only
    when called)."""
    from dyngen_core.kv.attention.triton.paged import TritonPagedBackend  # needs triton
    from dyngen_core.kv.attention.triton.quant import WordKernelFlags

    return TritonPagedBackend(block_n=16, word_block_n=16, max_splits=splits,
                              programs_per_sm=64, merge_in_kernel=merged,
                              word_flags=WordKernelFlags(merge_in_kernel=merged))


def _merged_and_combined(monkeypatch: pytest.MonkeyPatch, device: torch.device, mode: str,
                         window: int, launches: int, batch_size: int, splits: int,
                         merge_rows: int, dtype: torch.dtype
                         ) -> tuple[torch.Tensor, torch.Tensor, Any]:
    """(in-kernel merge output, second-kernel merge output, the merging backend)."""
    outputs = []
    for merged in (True, False):
        with monkeypatch.context() as patch:
            seen = _word_route(patch, merged, launches, merge_rows)
            backend = _backend(splits, merged)
            outputs.append((_attend(backend, mode, window, batch_size, dtype, device),
                            backend))
        assert seen == [merged]
    (merged_out, merging), (combined_out, _) = outputs
    assert torch.isfinite(merged_out).all() and torch.isfinite(combined_out).all()
    return merged_out, combined_out, merging


def _assert_counters_zeroed(backend: Any, device: torch.device) -> None:
    held = backend.split_counters.held(device)
    assert held, "the merge took no counters"
    assert all(int(buffer.abs().sum()) == 0 for buffer in held)


@pytest.mark.parametrize("mode", ["q4", "q8"])
@pytest.mark.parametrize("window", [0, WINDOW])
@pytest.mark.parametrize("launches", [1, 2])
@pytest.mark.parametrize(("batch_size", "splits", "merge_rows"), [(1, 8, 8), (3, 3, 64)])
def test_merge_in_kernel_matches_combine_and_sdpa(
        device: torch.device, monkeypatch: pytest.MonkeyPatch, mode: str, window: int,
        launches: int, batch_size: int, splits: int, merge_rows: int) -> None:
    """float32: the in-kernel merge equals the second kernel's and the reference. Batch 1:
    8 splits of 69 keys (16-key blocks: 4 splits empty) merged 2 partials a round (5 rounds
    of 9); batch 3: 3 splits, every partial in one round, a sequence without a window slot."""
    merged, combined, backend = _merged_and_combined(
        monkeypatch, device, mode, window, launches, batch_size, splits, merge_rows,
        torch.float32)
    reference = _attend(SdpaBackend(), mode, window, batch_size, torch.float32, device)
    torch.testing.assert_close(merged, combined, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(merged, reference, rtol=2e-4, atol=2e-4)
    _assert_counters_zeroed(backend, device)


@pytest.mark.parametrize("launches", [1, 2])
def test_merge_in_kernel_one_split(device: torch.device, monkeypatch: pytest.MonkeyPatch,
                                   launches: int) -> None:
    """One page split: the merge still folds the tail's partial in (2 partials)."""
    merged, combined, backend = _merged_and_combined(
        monkeypatch, device, "q4", WINDOW, launches, 3, 1, 64, torch.float32)
    torch.testing.assert_close(merged, combined, rtol=1e-5, atol=1e-5)
    _assert_counters_zeroed(backend, device)


def test_merge_in_kernel_half_precision(device: torch.device,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """float16 queries: the merged output is stored in the query dtype, as the combine's."""
    merged, combined, backend = _merged_and_combined(
        monkeypatch, device, "q8", WINDOW, 1, 3, 3, 64, torch.float16)
    assert float((merged - combined).norm() / combined.norm()) < 2e-3
    _assert_counters_zeroed(backend, device)


def test_word_counters_follow_the_backend_rule() -> None:
    """Counters for batches up to ``max_seqs`` sequences with the merge on (enough for every
    sequence and KV head, zeroed), else None; whatever the split count."""
    pytest.importorskip("triton")
    from dyngen_core.kv.attention.triton.decode_merge import SplitCounters
    from dyngen_core.kv.attention.triton.quant import word_counters

    counters = SplitCounters()
    cpu = torch.device("cpu")
    small, large = SimpleNamespace(num_seqs=3), SimpleNamespace(num_seqs=5)
    taken = word_counters(counters, small, 8, cpu, True, 4)  # type: ignore[arg-type]
    assert taken is not None and taken.numel() >= 24 and int(taken.abs().sum()) == 0
    assert word_counters(counters, large, 8, cpu, True, 4) is None  # type: ignore[arg-type]
    assert word_counters(counters, small, 8, cpu, False, 4) is None  # type: ignore[arg-type]


def test_too_few_counters_are_refused(device: torch.device) -> None:
    """Counters fewer than the (sequence, KV head) pairs are refused before any launch."""
    pytest.importorskip("triton")
    from dyngen_core.kv.attention.triton.quant import attend_word_decode

    q = torch.zeros(3, HEADS, HEAD_DIM, device=device)
    batch = SimpleNamespace(num_seqs=3)
    with pytest.raises(ValueError, match="SplitCounters.for_launch"):
        attend_word_decode(q, (), batch, None, 1.0, key_bits=4,  # type: ignore[arg-type]
                           value_bits=4, num_kv_heads=KV_HEADS, block_n=16, splits=1,
                           warps=4, counters=torch.zeros(5, dtype=torch.int32, device=device))
