"""A decode-only step's recent-window write folded into the quantized storage's page write
(`write(..., decode_window=...)`: one Triton launch, `quant_write_kernel` with WINDOW > 0)
against the two launches of a write without the decode window (`write`, then `write_recent`:
`window_write_kernel`).

Storage level: every tensor starts with the same poison in both storages, and several decode
steps (sequence slots with and without a window, one out of range, a padded duplicate row as
CUDA-graph buckets make, positions wrapping the window) must leave codes, scales, head rows,
window rows and window positions identical, with the window written by `write` itself and no
window launch left for `write_recent`. Attention level: a decode step through
`TritonPagedBackend.attend` and `SdpaBackend.attend` gives the same output and storage with
the fold as without. On CUDA, also captured in a CUDA graph.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from dyngen_core.config import ModelConfig  # noqa: E402
from dyngen_core.kv.quant import storage as quant  # noqa: E402
from dyngen_core.kv.quant.storage import QuantStorage  # noqa: E402
from tests.model.test_decode_window_fold_cpu import UnfoldedStorage  # noqa: E402

pytestmark = pytest.mark.gpu

PAGES, PAGE, LAYERS, WINDOW, SEQS, HEADS, DIM = 8, 16, 2, 4, 3, 2, 64
# One decode step: (sequence slot, first position); the step at index i adds i to positions.
# Slot 3 is just out of range (SEQS = 3), -1 has no window; the last row pads as graph
# buckets do: the row before it again, data included (two different rows for one slot would
# race on a GPU, where programs store in no fixed order).
TOKENS = [(0, 9), (2, 3), (-1, 20), (3, 2), (1, 30), (1, 30)]


def _storage(fold: bool, device: torch.device, seed: int = 0) -> QuantStorage:
    """A q4 storage, windows reserved, key offsets set, every tensor poisoned from ``seed``."""
    config = ModelConfig(architecture="LlamaForCausalLM", vocab_size=32,
                         hidden_size=HEADS * DIM, intermediate_size=64, num_layers=LAYERS,
                         num_heads=HEADS, num_kv_heads=HEADS, head_dim=DIM)
    kind = QuantStorage if fold else UnfoldedStorage
    storage = kind(config, PAGES, PAGE, torch.bfloat16, [device] * LAYERS, "q4",
                   recent_window=WINDOW, triton_write=True)
    gen = torch.Generator().manual_seed(seed)
    storage.set_key_offsets([torch.randn(HEADS, DIM, generator=gen) for _ in range(LAYERS)])
    storage.reserve_sequences(SEQS)
    for tensor in _tensors(storage):
        if tensor.dtype == torch.int32:  # window positions: values a reader could believe
            tensor.copy_(torch.randint(-1, 40, tensor.shape, generator=gen))
        elif tensor.is_floating_point():
            tensor.copy_(torch.randn(tensor.shape, generator=gen))
        else:
            tensor.view(torch.uint8).copy_(torch.randint(0, 256, tensor.view(torch.uint8).shape,
                                                         generator=gen, dtype=torch.uint8))
    return storage


def _tensors(storage: QuantStorage) -> list[torch.Tensor]:
    assert storage.recent is not None
    return [t for layer, ring in zip(storage.layers, storage.recent.layers, strict=True)
            for t in (*layer.tensors(), layer.head_rows, ring.rows, ring.positions)]


def _assert_same(a: QuantStorage, b: QuantStorage) -> None:
    """Every tensor equal, except the spare window row, which absorbs the unkept tokens' rows
    in launch order (its position, -1, must match)."""
    spare = SEQS * WINDOW
    for index, (x, y) in enumerate(zip(_tensors(a), _tensors(b), strict=True)):
        if x.dim() == 4 and x.shape[1] == spare + 1:  # window rows [2, rows, heads, dim]
            x, y = x[:, :spare], y[:, :spare]
        assert torch.equal(x, y), index


def _step(step: int, device: torch.device) -> dict[str, torch.Tensor]:
    """Rows, slots, positions and sequence slots of decode step ``step``; the padding row
    repeats the row before it (the same inputs, hence the same keys and values)."""
    gen = torch.Generator().manual_seed(100 + step)
    count = len(TOKENS)
    key = torch.randn(count, HEADS, DIM, generator=gen) * 3
    qkv = torch.randn(count, 3 * HEADS * DIM, generator=gen)
    key[-1], qkv[-1] = key[-2], qkv[-2]
    positions = torch.tensor([p + step for _, p in TOKENS])
    seq_slots = torch.tensor([s for s, _ in TOKENS], dtype=torch.int32)
    sequence = torch.tensor([3, 0, 4, 5, 1, 1])  # each token's own run of pages
    slots = sequence * 2 * PAGE + positions  # two pages per sequence: crosses a page head
    return {"key": key.to(torch.bfloat16).to(device),
            "value": qkv.to(torch.bfloat16).to(device)[:, 2 * HEADS * DIM:].view(
                count, HEADS, DIM),
            "slots": slots.to(device), "positions": positions.to(device),
            "seq_slots": seq_slots.to(device)}


def _write(storage: QuantStorage, rows: dict[str, torch.Tensor]) -> None:
    """One decode step of every layer as the backends run it."""
    key, value = rows["key"], rows["value"]
    for layer in range(LAYERS):
        storage.write(layer, key, value, rows["slots"],
                      decode_window=(rows["positions"], rows["seq_slots"]))
        storage.exact_rows(layer, key, value)
        storage.write_recent(layer, key, value, rows["positions"], rows["seq_slots"])


def test_fold_matches_two_launches(device: torch.device, monkeypatch: pytest.MonkeyPatch) -> None:
    """One program per token and KV head, each storing its head's window rows."""
    folded, plain = _storage(True, device), _storage(False, device)
    _assert_same(folded, plain)
    launches = []
    original = quant.write_window_triton

    def counted(*args: object, **kwargs: object) -> None:
        launches.append(1)
        original(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(quant, "write_window_triton", counted)
    for step in range(2 * WINDOW + 1):  # positions wrap the window twice
        rows = _step(step, device)
        _write(plain, rows)
        assert len(launches) == LAYERS  # the storage without the fold: one per layer
        launches.clear()
        _write(folded, rows)
        assert not launches  # the fold leaves write_recent nothing to launch
        _assert_same(folded, plain)
    assert folded.recent is not None
    held = folded.recent.layers[1].positions[: SEQS * WINDOW].view(SEQS, WINDOW)
    last = 2 * WINDOW
    assert sorted(held[0].tolist()) == list(range(9 + last - WINDOW + 1, 9 + last + 1))
    assert sorted(held[1].tolist()) == list(range(30 + last - WINDOW + 1, 30 + last + 1))


def test_fold_writes_the_window_before_attention(device: torch.device) -> None:
    """`write` alone stores the window (what lets attention run after it); without
    ``decode_window`` it leaves the window to `write_recent`."""
    rows = _step(0, device)
    for window in (True, False):
        storage = _storage(True, device)
        assert storage.recent is not None
        before = storage.recent.layers[0].positions.clone()
        given = (rows["positions"], rows["seq_slots"]) if window else None
        storage.write(0, rows["key"], rows["value"], rows["slots"], decode_window=given)
        after = storage.recent.layers[0].positions
        if window:
            assert after[0 * WINDOW + 9 % WINDOW] == 9
            assert after[2 * WINDOW + 3 % WINDOW] == 3
            assert after[1 * WINDOW + 30 % WINDOW] == 30
            assert after[SEQS * WINDOW] == -1
        else:
            assert torch.equal(after, before)


def test_write_recent_of_other_tensors_still_writes(device: torch.device) -> None:
    """The skip is for the very tensors `write` was given: other position tensors (or a later
    layer's write in between) get the window write, which repeats the same rows."""
    folded, plain = _storage(True, device), _storage(False, device)
    rows = _step(1, device)
    key, value = rows["key"], rows["value"]
    folded.write(0, key, value, rows["slots"], decode_window=(rows["positions"],
                                                               rows["seq_slots"]))
    plain.write(0, key, value, rows["slots"])
    moved = rows["positions"] + WINDOW  # another position tensor: written, not skipped
    for storage in (folded, plain):
        storage.write_recent(0, key, value, moved, rows["seq_slots"])
    _assert_same(folded, plain)


@pytest.mark.parametrize("backend_name", ["triton", "sdpa"])
def test_attend_same_with_and_without_fold(device: torch.device,
                                           monkeypatch: pytest.MonkeyPatch,
                                           backend_name: str) -> None:
    from dyngen_core.kv.attention.sdpa import SdpaBackend
    from tests.gpu.test_recent_window_triton import DIM as ATT_DIM
    from tests.gpu.test_recent_window_triton import HEADS as ATT_HEADS
    from tests.gpu.test_recent_window_triton import _setup, triton_backend

    outputs, storages = [], []
    for fold in (False, True):
        storage, batch, k, v = _setup("decodes", "q4", device, True,
                                      QuantStorage if fold else UnfoldedStorage)
        assert batch.decode_window is not None
        if backend_name == "triton":
            backend: object = triton_backend(monkeypatch)
        else:
            backend = SdpaBackend()
        q = torch.randn(batch.num_tokens, ATT_HEADS, ATT_DIM,
                        generator=torch.Generator().manual_seed(5)).to(device)
        outputs.append(backend.attend(0, q, k, v, storage, batch,  # type: ignore[attr-defined]
                                      ATT_DIM ** -0.5))
        storages.append(storage)
    torch.testing.assert_close(outputs[1], outputs[0], rtol=0, atol=0)
    windows = [s.recent for s in storages]
    assert windows[0] is not None and windows[1] is not None
    spare = windows[0].slots * windows[0].window
    assert torch.equal(windows[1].layers[0].positions, windows[0].layers[0].positions)
    assert torch.equal(windows[1].layers[0].rows[:, :spare], windows[0].layers[0].rows[:, :spare])
    for new, old in zip(storages[1].layers[0].tensors(), storages[0].layers[0].tensors(),
                        strict=True):
        assert torch.equal(new, old)


def test_fold_in_cuda_graph(cuda_device: torch.device) -> None:
    """The folded write captured once and replayed with new rows, slots and positions: the
    same storage as the two launches run eagerly."""
    folded, plain = _storage(True, cuda_device), _storage(False, cuda_device)
    static = _step(0, cuda_device)
    static["value"] = static["value"].contiguous()
    _write(folded, static)  # compile outside the capture
    _write(plain, static)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        _write(folded, static)
    for step in range(1, WINDOW + 2):
        rows = _step(step, cuda_device)
        for name, tensor in rows.items():
            static[name].copy_(tensor)
        graph.replay()
        _write(plain, rows)
        torch.cuda.synchronize()
        _assert_same(folded, plain)
