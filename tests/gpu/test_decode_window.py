"""The decode key loop with page ids loaded ahead of its tiles (`decode.PAGE_WINDOW`,
`key_loop.attend_key_windows`) against the sdpa reference and the per-tile loop: contexts over
several windows and a partial last one, tiles of a whole page and of half a page, one split and
several (a split starting inside a window), the in-kernel merge and step write, half precision,
q6 pages (the per-tile loop) with and without a recent window, and a page size the tile does not
divide (the per-tile loop then). Runs on CUDA, or on the CPU under TRITON_INTERPRET=1 (small
shapes)."""

from __future__ import annotations

import pytest
import torch

from tests.gpu.conftest import interpreter_mode
from tests.gpu.test_decode_merge import (
    _backend,
    _case,
    _reference,
    _relative_error,
    _shape,
    _splits,
)

pytest.importorskip("triton")

from dyngen_core.kv.attention.triton import decode  # noqa: E402
from dyngen_core.kv.attention.triton.paged import TritonPagedBackend  # noqa: E402

pytestmark = pytest.mark.gpu


def _windowed(monkeypatch: pytest.MonkeyPatch, page_window: int, splits: int, block_n: int,
              in_kernel_seqs: int = 1 << 20) -> TritonPagedBackend:
    """`test_decode_merge._backend` with page ids loaded ``page_window`` pages ahead."""
    monkeypatch.setattr(decode, "PAGE_WINDOW", page_window)
    return _backend(monkeypatch, splits, block_n, in_kernel_seqs)


@pytest.mark.parametrize("page_window", [1, 2, 4])
@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("half_page_tiles", [False, True])
def test_window_matches_reference_and_old_loop(device: torch.device,
                                               monkeypatch: pytest.MonkeyPatch, page_window: int,
                                               splits: int, half_page_tiles: bool) -> None:
    """float32 on the CPU (exact dots): same tiles in the same order as the per-tile loop,
    so the outputs agree to rounding, and with sdpa. The longest context (5 pages on the
    CPU, 20 on CUDA) spans several windows with a partial last one; 3 splits start inside
    windows."""
    storage, batch, q, contexts, tables = _case(device)
    block_n = int(_shape(device)["block_n"])  # type: ignore[call-overload]
    if half_page_tiles:
        block_n //= 2
    scale = q.shape[2] ** -0.5
    backend = _windowed(monkeypatch, page_window, splits, block_n)
    assert _splits(batch, q.device) == splits
    assert decode.decode_page_window(batch.page_size, False) == page_window
    out = backend.attend_cached(0, q, storage, batch, scale)
    old = _windowed(monkeypatch, 0, splits, block_n).attend_cached(0, q, storage, batch, scale)
    limit = 2e-5 if q.dtype == torch.float32 else 2e-2
    assert _relative_error(out, _reference(q, storage, contexts, tables, scale)) < limit
    assert _relative_error(out, old.float()) < (1e-6 if q.dtype == torch.float32 else 1e-2)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_window_half_precision(device: torch.device, monkeypatch: pytest.MonkeyPatch,
                               dtype: torch.dtype) -> None:
    """fp16 and bf16 pages and queries (half dots) against the float32 reference."""
    if dtype == torch.bfloat16 and interpreter_mode():
        pytest.skip("Triton's interpreter has no bfloat16 (numpy)")
    storage, batch, q, contexts, tables = _case(device, dtype)
    block_n = int(_shape(device)["block_n"])  # type: ignore[call-overload]
    scale = q.shape[2] ** -0.5
    out = _windowed(monkeypatch, 2, 4, block_n).attend_cached(0, q, storage, batch, scale)
    assert _relative_error(out, _reference(q, storage, contexts, tables, scale)) < 2e-2


def test_window_with_kernel_write(device: torch.device, monkeypatch: pytest.MonkeyPatch) -> None:
    """`attend` with the step's rows stored by the kernel (and the splits merged in it): the
    pages end as the storage's write leaves them, the output matches sdpa."""
    from tests.gpu.test_decode_step_write import _step_rows

    storage, batch, q, contexts, tables = _case(device)
    expected, _, _, _, _ = _case(device)
    k, v = _step_rows(len(contexts), q.shape[2], q.dtype, device)
    expected.write(0, k, v, batch.slot_mapping)
    block_n = int(_shape(device)["block_n"])  # type: ignore[call-overload]
    scale = q.shape[2] ** -0.5
    backend = _windowed(monkeypatch, 2, 3, block_n)
    out = backend.attend(0, q, k, v, storage, batch, scale)
    assert torch.equal(storage.keys[0], expected.keys[0])
    assert torch.equal(storage.values[0], expected.values[0])
    limit = 2e-5 if q.dtype == torch.float32 else 2e-2
    assert _relative_error(out, _reference(q, expected, contexts, tables, scale)) < limit
    assert all(int(c.abs().sum()) == 0 for c in backend.split_counters.held(device))


@pytest.mark.parametrize("window", [0, 4])
def test_q6_pages_keep_the_per_tile_loop(device: torch.device, monkeypatch: pytest.MonkeyPatch,
                                         window: int) -> None:
    """q6 pages (this kernel's quantized decodes: their tiles load their page ids), with and
    without a recent window of exact rows, against the sdpa backend."""
    from tests.gpu.test_quant_decode_triton import _outputs

    # A GPU dot needs 16 keys at least; the interpreter takes the smaller tile.
    block_n = 16 if device.type == "cuda" else 8
    assert decode.decode_page_window(16 * block_n, True) == 0
    backend = _windowed(monkeypatch, 2, 3, block_n)
    out, ref = _outputs("q6", window, 32, torch.float32, device, backend)
    torch.testing.assert_close(out, ref, rtol=2e-4, atol=2e-4)


def test_tile_wider_than_page_keeps_per_tile_loop(device: torch.device,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """A tile the page size does not divide gets PAGE_WINDOW 0 (tiles straddle pages):
    still exact."""
    storage, batch, q, contexts, tables = _case(device)
    block_n = 2 * int(_shape(device)["page"])  # type: ignore[call-overload]
    backend = _windowed(monkeypatch, 4, 3, block_n)
    assert decode.decode_page_window(batch.page_size, False) == 0
    if device.type == "cuda":
        pytest.skip("a 512-key tile over 256-slot pages needs more shared memory than a GPU "
                    "has; the fallback's choice is checked above, its loop under the interpreter")
    scale = q.shape[2] ** -0.5
    out = backend.attend_cached(0, q, storage, batch, scale)
    limit = 2e-5 if q.dtype == torch.float32 else 2e-2
    assert _relative_error(out, _reference(q, storage, contexts, tables, scale)) < limit



def test_page_window_rule(monkeypatch: pytest.MonkeyPatch) -> None:
    """Float pages the tile divides load `PAGE_WINDOW` page ids ahead; quantized pages, and
    pages the tile does not divide, keep the per-tile loop."""
    monkeypatch.setattr(decode, "BLOCK_N", 64)
    assert decode.decode_page_window(256, False) == decode.PAGE_WINDOW
    assert decode.decode_page_window(256, True) == 0
    assert decode.decode_page_window(96, False) == 0
