"""The quantized storage's decode-step write done by the q8/q4 decode kernel
(`QuantStorage.deferred_write`, `attend_word_decode(write=...)`, which `TritonPagedBackend`
takes for decode-only steps over q8/q4 pages) against the storage's own write launch before the
kernel: the same output bit for bit, and every storage tensor (codes, scales, head rows, window
rows and positions) identical afterwards, with no write launch left. With and without a recent
window; steps whose token opens a page (its head row) and sequences without a window slot; the
single tail in one launch and three tail parts in two. Runs on CUDA, or on the CPU under
TRITON_INTERPRET=1."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from dyngen_core.kv.attention.base import ForwardBatch
from dyngen_core.kv.quant.storage import QuantStorage
from tests.gpu.quant_setup import decode_step

pytestmark = pytest.mark.gpu

PAGE, WINDOW, HEADS, KV_HEADS, HEAD_DIM = 16, 4, 8, 2, 32
# (context after this step's token, has a window slot): 65 and 17 put the step's token at
# slot 0 of a new page (its head row is written), 33 has no window slot.
DECODES = {1: [(65, True)], 3: [(17, True), (33, False), (70, True)]}


def _backend(monkeypatch: pytest.MonkeyPatch, launches: int) -> Any:
    from tests.gpu.test_quant_decode_triton import _backend as backend

    return backend(monkeypatch, 4, programs_per_sm=64, launches=launches)


def _tensors(storage: QuantStorage) -> list[torch.Tensor]:
    pages = [*storage.layers[0].tensors(), storage.layers[0].head_rows]
    if storage.recent is None:
        return pages
    ring = storage.recent.layers[0]
    return [*pages, ring.positions, ring.rows[:, :-1]]  # the spare row: unkept rows, any order


def _step(mode: str, batch_size: int, dtype: torch.dtype, device: torch.device,
          window: int = WINDOW
          ) -> tuple[QuantStorage, ForwardBatch, torch.Tensor, torch.Tensor, torch.Tensor]:
    storage, batch, k, v = decode_step(mode, window, DECODES[batch_size], heads=HEADS,
                                       kv_heads=KV_HEADS, head_dim=HEAD_DIM, page=PAGE,
                                       dtype=dtype, device=device, seed=3, triton_write=True)
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(batch_size, HEADS, HEAD_DIM, generator=gen).to(device, dtype)
    return storage, batch, q, k, v


def _count_writes(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    from dyngen_core.kv.quant import storage as quant

    launches: list[int] = []
    for name in ("launch_quant_write", "write_window_triton"):
        original = getattr(quant, name)

        def counted(*args: Any, _original: Any = original, **keywords: Any) -> Any:
            launches.append(1)
            return _original(*args, **keywords)

        monkeypatch.setattr(quant, name, counted)
    return launches


@pytest.mark.parametrize("mode", ["q4", "q8"])
@pytest.mark.parametrize("batch_size", [1, 3])
@pytest.mark.parametrize("launches", [1, 2])
@pytest.mark.parametrize("window", [WINDOW, 0])
def test_kernel_write_matches_storage_write(device: torch.device,
                                            monkeypatch: pytest.MonkeyPatch, mode: str,
                                            batch_size: int, launches: int,
                                            window: int) -> None:
    """`attend` (the kernel writes) against the storage's write, then `attend_cached` over the
    written pages with the step's rows, then `write_recent`: what `attend` runs for batches
    the kernel does not write. Without a window the tail program reads the codes (and, at
    a page's first slot, the head row) it has just stored."""
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    scale = HEAD_DIM ** -0.5
    backend = _backend(monkeypatch, launches)
    plain, batch, q, k, v = _step(mode, batch_size, dtype, device, window)
    with monkeypatch.context() as patch:
        written = _count_writes(patch)
        plain.write(0, k, v, batch.slot_mapping, decode_window=batch.decode_window)
        expected = backend.attend_cached(0, q, plain, batch, scale, step_rows=(k, v))
        assert batch.token_seq_slots is not None
        plain.write_recent(0, k, v, batch.positions, batch.token_seq_slots)
    assert written == [1]
    fused, batch, q, k, v = _step(mode, batch_size, dtype, device, window)
    with monkeypatch.context() as patch:
        written = _count_writes(patch)
        out = _backend(patch, launches).attend(0, q, k, v, fused, batch, scale)
    assert not written, "the storage wrote although the kernel was to"
    assert torch.isfinite(out).all()
    assert torch.equal(out, expected)
    for index, (a, b) in enumerate(zip(_tensors(fused), _tensors(plain), strict=True)):
        assert torch.equal(a, b), index


def test_pages_the_kernel_does_not_read_keep_the_storage_write(
        device: torch.device, monkeypatch: pytest.MonkeyPatch) -> None:
    """q6 pages go to the general kernel, so the storage writes the step's rows before it
    (one write launch)."""
    storage, batch, k, v = decode_step("q6", 0, DECODES[3], heads=HEADS, kv_heads=KV_HEADS,
                                       head_dim=HEAD_DIM, page=PAGE, dtype=torch.float32,
                                       device=device, seed=3, triton_write=True)
    q = torch.randn(3, HEADS, HEAD_DIM).to(device)
    backend = _backend(monkeypatch, 2)
    with monkeypatch.context() as patch:
        launches = _count_writes(patch)
        backend.attend(0, q, k, v, storage, batch, HEAD_DIM ** -0.5)
    assert launches == [1]


def test_write_needs_the_window_and_its_rows(device: torch.device) -> None:
    """A write whose fresh rows are not the exact operands' is refused before any launch."""
    pytest.importorskip("triton")
    from dyngen_core.kv.attention.triton.decode import exact_operands
    from dyngen_core.kv.attention.triton.quant_decode import attend_word_decode

    storage, batch, k, v = decode_step("q4", WINDOW, DECODES[1], heads=HEADS,
                                       kv_heads=KV_HEADS, head_dim=HEAD_DIM, page=PAGE,
                                       dtype=torch.float32, device=device, seed=3,
                                       triton_write=True)
    exact = exact_operands(storage, 0, batch, (k, v))  # the storage's own rows, not the write's
    write = storage.deferred_write(0, k.clone(), v.clone(), batch.slot_mapping,
                                   batch.decode_window)
    assert write is not None and exact is not None
    q = torch.zeros(1, HEADS, HEAD_DIM, device=device)
    with pytest.raises(ValueError, match="deferred_write"):
        attend_word_decode(q, (), batch, exact, 1.0, key_bits=4, value_bits=4,
                           num_kv_heads=KV_HEADS, splits=1, write=write)


def test_write_and_exact_rows_need_the_same_window(device: torch.device) -> None:
    """A write without a window given exact rows with one (or the reverse) is refused before
    any launch."""
    pytest.importorskip("triton")
    from dyngen_core.kv.attention.triton.decode import exact_operands
    from dyngen_core.kv.attention.triton.quant_decode import attend_word_decode

    def step(window: int) -> tuple[QuantStorage, ForwardBatch, torch.Tensor, torch.Tensor]:
        return decode_step("q8", window, DECODES[1], heads=HEADS, kv_heads=KV_HEADS,
                           head_dim=HEAD_DIM, page=PAGE, dtype=torch.float32, device=device,
                           seed=3, triton_write=True)

    windowed, batch, k, v = step(WINDOW)
    plain, plain_batch, plain_k, plain_v = step(0)
    pairs = [(windowed, batch, k, v, plain, plain_batch, plain_k, plain_v),
             (plain, plain_batch, plain_k, plain_v, windowed, batch, k, v)]
    q = torch.zeros(1, HEADS, HEAD_DIM, device=device)
    for exact_storage, exact_batch, ek, ev, write_storage, write_batch, wk, wv in pairs:
        write = write_storage.deferred_write(0, wk, wv, write_batch.slot_mapping,
                                             write_batch.decode_window)
        exact = exact_operands(exact_storage, 0, exact_batch, (ek, ev))
        assert write is not None and exact is not None
        with pytest.raises(ValueError, match="window"):
            attend_word_decode(q, (), exact_batch, exact, 1.0, key_bits=8, value_bits=8,
                               num_kv_heads=KV_HEADS, splits=1, write=write)
