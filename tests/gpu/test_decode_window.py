"""The decode key loop with page ids loaded ahead of its tiles (`DecodeOptions.page_window`,
`triton_decode_tiles.attend_key_windows`) against the sdpa reference and the per-tile loop:
contexts over several windows and a partial last one, tiles of a whole page and of half a
page, one split and several (a split starting inside a window), the in-kernel merge and step
write, half precision, q6 pages with and without a recent window, and a page size the tile
does not divide (the per-tile loop then). Runs on CUDA, or on the CPU under TRITON_INTERPRET=1
(small shapes)."""

from __future__ import annotations

import pytest
import torch

from tests.gpu.conftest import interpreter_mode
from tests.gpu.test_decode_merge import (
    ANY_BATCH,
    _case,
    _reference,
    _relative_error,
    _shape,
)

pytest.importorskip("triton")

from dyngen_core.kv.attention.triton.decode_options import DecodeOptions  # noqa: E402
from dyngen_core.kv.attention.triton.paged import TritonPagedBackend  # noqa: E402

pytestmark = pytest.mark.gpu


def _backend(page_window: int, splits: int, block_n: int, **options: object
             ) -> TritonPagedBackend:
    return TritonPagedBackend(block_n=block_n, max_splits=splits, programs_per_sm=4096,
                              cascade_min_saved_keys=None, in_kernel_max_seqs=ANY_BATCH,
                              decode_options=DecodeOptions(page_window=page_window),
                              **options)  # type: ignore[arg-type]


@pytest.mark.parametrize("page_window", [1, 2, 4])
@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("half_page_tiles", [False, True])
def test_window_matches_reference_and_old_loop(device: torch.device, page_window: int,
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
    backend = _backend(page_window, splits, block_n)
    assert backend._decode_splits(batch.num_seqs * 2, q.device) == splits
    assert backend.decode_options.window_for(batch.page_size, block_n, False) == page_window
    out = backend.attend_cached(0, q, storage, batch, scale)
    old = _backend(0, splits, block_n).attend_cached(0, q, storage, batch, scale)
    limit = 2e-5 if q.dtype == torch.float32 else 2e-2
    assert _relative_error(out, _reference(q, storage, contexts, tables, scale)) < limit
    assert _relative_error(out, old.float()) < (1e-6 if q.dtype == torch.float32 else 1e-2)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_window_half_precision(device: torch.device, dtype: torch.dtype) -> None:
    """fp16 and bf16 pages and queries (half dots) against the float32 reference."""
    if dtype == torch.bfloat16 and interpreter_mode():
        pytest.skip("Triton's interpreter has no bfloat16 (numpy)")
    storage, batch, q, contexts, tables = _case(device, dtype)
    block_n = int(_shape(device)["block_n"])  # type: ignore[call-overload]
    scale = q.shape[2] ** -0.5
    out = _backend(2, 4, block_n).attend_cached(0, q, storage, batch, scale)
    assert _relative_error(out, _reference(q, storage, contexts, tables, scale)) < 2e-2


@pytest.mark.parametrize("merge", [False, True])
def test_window_with_kernel_write(device: torch.device, merge: bool) -> None:
    """`attend` with the step's rows stored by the kernel (and the splits merged in it or
    not): the pages end as the storage's write leaves them, the output matches sdpa."""
    from tests.gpu.test_decode_step_write import _step_rows

    storage, batch, q, contexts, tables = _case(device)
    expected, _, _, _, _ = _case(device)
    k, v = _step_rows(len(contexts), q.shape[2], q.dtype, device)
    expected.write(0, k, v, batch.slot_mapping)
    block_n = int(_shape(device)["block_n"])  # type: ignore[call-overload]
    scale = q.shape[2] ** -0.5
    backend = _backend(2, 3, block_n, merge_in_kernel=merge, write_in_kernel=True)
    out = backend.attend(0, q, k, v, storage, batch, scale)
    assert torch.equal(storage.keys[0], expected.keys[0])
    assert torch.equal(storage.values[0], expected.values[0])
    limit = 2e-5 if q.dtype == torch.float32 else 2e-2
    assert _relative_error(out, _reference(q, expected, contexts, tables, scale)) < limit
    assert all(int(c.abs().sum()) == 0 for c in backend.split_counters.held(device))


@pytest.mark.parametrize("window", [0, 4])
def test_window_over_q6_pages(device: torch.device, window: int) -> None:
    """q6 pages (this kernel's quantized decodes) with the window of ``quant_page_window``,
    with and without a recent window of exact rows, against the sdpa backend."""
    from tests.gpu.test_quant_decode_triton import _outputs

    # A GPU dot needs 16 keys at least; the interpreter takes the smaller tile.
    block_n = 16 if device.type == "cuda" else 8
    backend = TritonPagedBackend(block_n=block_n, word_block_n=None, max_splits=3,
                                 programs_per_sm=4096,
                                 decode_options=DecodeOptions(quant_page_window=2))
    out, ref = _outputs("q6", window, 32, torch.float32, device, backend)
    torch.testing.assert_close(out, ref, rtol=2e-4, atol=2e-4)


def test_tile_wider_than_page_keeps_per_tile_loop(device: torch.device) -> None:
    """A tile the page size does not divide gets PAGE_WINDOW 0 (tiles straddle pages):
    still exact."""
    storage, batch, q, contexts, tables = _case(device)
    block_n = 2 * int(_shape(device)["page"])  # type: ignore[call-overload]
    backend = _backend(4, 3, block_n)
    assert backend.decode_options.window_for(batch.page_size, block_n, False) == 0
    if device.type == "cuda":
        pytest.skip("a 512-key tile over 256-slot pages needs more shared memory than a GPU "
                    "has; the fallback's choice is checked above, its loop under the interpreter")
    scale = q.shape[2] ** -0.5
    out = backend.attend_cached(0, q, storage, batch, scale)
    limit = 2e-5 if q.dtype == torch.float32 else 2e-2
    assert _relative_error(out, _reference(q, storage, contexts, tables, scale)) < limit


def test_options_are_checked() -> None:
    """Windows must be powers of two (the kernel's vector of page ids), stages positive."""
    with pytest.raises(ValueError, match="page_window must be 0 or a power of two"):
        DecodeOptions(page_window=3)
    with pytest.raises(ValueError, match="quant_page_window"):
        DecodeOptions(quant_page_window=-2)
    with pytest.raises(ValueError, match="stages"):
        DecodeOptions(stages=0)
    options = DecodeOptions(page_window=8, quant_page_window=2)
    assert options.window_for(256, 64, False) == 8
    assert options.window_for(256, 64, True) == 2
    assert options.window_for(256, 96, False) == 0
