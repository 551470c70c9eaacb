"""The one-launch Triton write of the quantized storage (`quant.write`) against its torch twin
(the CPU path) and the codec both follow (`quant.format`).

Oracle: the butterfly arithmetic in torch (the signs, the butterfly of
`format.walsh_hadamard`, the float32 1/sqrt(32), then `format.quantize_rotated`), which the
kernel must match bit for bit: codes, scales, exact rows, head rows. Against the torch twin (the
torch codec on a matrix-product rotation) codes may differ by one step on
rounding boundaries and exact rows by one step of the compute dtype; the test bounds both.
Every tensor starts poisoned (random bytes), so a store to the wrong place, or a missing one,
shows: rows outside the step's slots must keep the poison. Covers q8/q6/q4, key offsets on and
off, head shapes that are not powers of two, strided value rows (the fused qkv layout), slots
on page heads, slots outside the pages, and the recent window (sequences without a slot, a slot
out of range, a chunk longer than the window). On CUDA, also captured in a CUDA graph.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from dyngen_core.config import ModelConfig  # noqa: E402
from dyngen_core.kv.quant.format import (  # noqa: E402
    inv_sqrt,
    quantize_rotated,
    rotation_signs,
    walsh_hadamard,
)
from dyngen_core.kv.quant.storage import QuantStorage  # noqa: E402
from dyngen_core.kv.quant.window import RecentWindow  # noqa: E402

pytestmark = pytest.mark.gpu

PAGES, PAGE, LAYERS, WINDOW, SEQS = 6, 16, 2, 4, 3


def _pair(mode: str, heads: int, dim: int, dtype: torch.dtype, offsets: bool,
          device: torch.device) -> tuple[QuantStorage, QuantStorage]:
    """(Triton-written, torch-written) storages with the same poison in every tensor."""
    config = ModelConfig(architecture="LlamaForCausalLM", vocab_size=32,
                         hidden_size=heads * dim, intermediate_size=64, num_layers=LAYERS,
                         num_heads=heads, num_kv_heads=heads, head_dim=dim)
    pair = tuple(QuantStorage(config, PAGES, PAGE, dtype, [device] * LAYERS, mode,
                              recent_window=WINDOW, triton_write=triton)
                 for triton in (True, False))
    gen = torch.Generator().manual_seed(heads * dim)
    means = [torch.randn(heads, dim, generator=gen) * 2 for _ in range(LAYERS)]
    for storage in pair:
        storage.set_key_offsets(means if offsets else None)
        storage.reserve_sequences(SEQS)
    for index, tensor in enumerate(_tensors(pair[0])):
        poison = torch.randint(0, 256, (tensor.numel() * tensor.element_size(),), generator=gen,
                               dtype=torch.uint8)
        if tensor.dtype == torch.int32:  # window positions: values a reader could believe
            poison = torch.randint(-1, 64, (tensor.numel(),), generator=gen,
                                   dtype=torch.int32).view(torch.uint8)
        if tensor.is_floating_point():  # finite floats, so equality checks stay meaningful
            poison = torch.randn(tensor.shape, generator=gen).to(tensor.dtype).view(torch.uint8)
        for storage in pair:
            target = _tensors(storage)[index].view(torch.uint8)  # the pages: head-major views
            target.copy_(poison.view(target.shape))
    return pair[0], pair[1]


def _tensors(storage: QuantStorage) -> list[torch.Tensor]:
    assert storage.recent is not None
    return [t for layer, ring in zip(storage.layers, storage.recent.layers, strict=True)
            for t in (*layer.tensors(), layer.head_rows, ring.rows, ring.positions)]


def _rows(tokens: int, heads: int, dim: int, dtype: torch.dtype, device: torch.device,
          seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys with outlier channels, and values as a strided view of a fused qkv output."""
    gen = torch.Generator().manual_seed(seed)
    keys = torch.randn(tokens, heads, dim, generator=gen) * torch.exp(
        torch.randn(heads, dim, generator=gen))
    keys[:, :, 3] += 8.0
    keys[::5] = 0.0  # all-zero rows: scale 0
    qkv = torch.randn(tokens, 3 * heads * dim, generator=gen)
    value = qkv.to(dtype).to(device)[:, 2 * heads * dim:].view(tokens, heads, dim)
    return keys.to(dtype).to(device), value


def _oracle(storage: QuantStorage, layer: int, key: torch.Tensor, value: torch.Tensor
            ) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
    """Exact rows [2, T, H, D] and (codes, scales) of keys and values as the butterfly
    computes them."""
    stored = storage._prepare_rows(layer, key, value).stored
    assert stored is not None
    signs = rotation_signs(32).to(stored.device)
    blocks = stored.to(torch.float32).reshape(-1, 32) * signs
    rotated = (walsh_hadamard(blocks, 32) * inv_sqrt(32)).reshape(stored.shape)
    coded = [quantize_rotated(rotated[i], fmt)
             for i, fmt in enumerate((storage.key_format, storage.value_format))]
    return rotated.to(storage.dtype), coded


def _check_layer(fast: QuantStorage, before: list[torch.Tensor], layer: int,
                 key: torch.Tensor, value: torch.Tensor, slots: torch.Tensor) -> None:
    """``fast``'s layer holds exactly the oracle's rows at ``slots`` (codes, scales, head rows
    of page-opening slots) and the poison in ``before`` everywhere else."""
    exact, coded = _oracle(fast, layer, key, value)
    assert torch.equal(fast.exact_rows(layer, key, value)[0], exact[0])
    assert torch.equal(fast.exact_rows(layer, key, value)[1], exact[1])
    pages = fast.layers[layer]
    inside = (slots >= 0) & (slots < PAGES * PAGE)
    kept = slots[inside].to(torch.int64)
    for tensor, old, new in zip(pages.tensors(), before[:4],
                                (coded[0][0], coded[0][1], coded[1][0], coded[1][1]),
                                strict=True):
        want = old.clone()
        want[kept // PAGE, kept % PAGE] = new[inside.to(new.device)]
        assert torch.equal(tensor, want)
    want_heads = before[4].clone()
    opens = inside & (slots % PAGE == 0)
    for half in range(2):
        want_heads[half, (slots[opens] // PAGE).to(torch.int64)] = exact[half][opens]
    assert torch.equal(pages.head_rows, want_heads)


@pytest.mark.parametrize(("mode", "heads", "dim", "dtype", "offsets"), [
    ("q4", 2, 128, torch.bfloat16, True),
    ("q6", 3, 64, torch.bfloat16, True),
    ("q6", 3, 96, torch.float16, True),
    ("q8", 3, 64, torch.float16, False),
    ("q4", 1, 32, torch.float32, False),
])
def test_write_matches_butterfly_arithmetic(device: torch.device, mode: str, heads: int,
                                            dim: int, dtype: torch.dtype,
                                            offsets: bool) -> None:
    """One program per token and KV head; 96 dims: 3 groups padded to 4 rows a program."""
    fast, _ = _pair(mode, heads, dim, dtype, offsets, device)
    # Page heads (0, 16, 48), mid-page slots, the last slot, and one outside the pages.
    slots = torch.tensor([0, 5, 16, 33, 48, 95, 7, -1, PAGES * PAGE, 17], device=device)
    for layer in range(LAYERS):
        key, value = _rows(slots.shape[0], heads, dim, dtype, device, seed=layer)
        before = [t.clone() for t in _tensors(fast)[7 * layer: 7 * layer + 5]]
        fast.write(layer, key, value, slots)
        _check_layer(fast, before, layer, key, value, slots)


@pytest.mark.parametrize("mode", ["q4", "q6", "q8"])
def test_write_close_to_torch_twin(device: torch.device, mode: str) -> None:
    """Where the torch twin writes (slots inside the pages), the two agree: codes to one step on
    at most a few rounding boundaries, scales to one fp16 step, exact rows to one bf16 step at
    their group's largest value (float32 rounding of the rotation is relative to the group)."""
    fast, twin = _pair(mode, 2, 64, torch.bfloat16, True, device)
    slots = torch.arange(0, PAGES * PAGE, 7, device=device)
    key, value = _rows(slots.shape[0], 2, 64, torch.bfloat16, device, seed=9)
    for storage in (fast, twin):
        storage.write(1, key, value, slots)
    for new_half, old_half in zip(fast.exact_rows(1, key, value), twin.exact_rows(1, key, value),
                                  strict=True):
        old_float = old_half.float()
        groups = old_float.reshape(*old_float.shape[:-1], -1, 32)
        largest = groups.abs().amax(dim=-1, keepdim=True).expand_as(groups)
        step = torch.ldexp(torch.ones_like(largest), torch.frexp(largest).exponent - 8)
        diff = (new_half.float() - old_float).abs().reshape(groups.shape)
        assert (diff <= step).all()  # one bf16 step at the group's largest value
    for new_t, old_t in zip(fast.layers[1].tensors(), twin.layers[1].tensors(), strict=True):
        if new_t.dtype == torch.float16:
            assert torch.allclose(new_t.float(), old_t.float(), rtol=2e-3, atol=0.0)
        else:
            assert (new_t != old_t).float().mean() <= 2e-3
    heads = slots[slots % PAGE == 0] // PAGE
    assert torch.allclose(fast.layers[1].head_rows[:, heads].float(),
                          twin.layers[1].head_rows[:, heads].float(), rtol=2 ** -7, atol=0.0)


def test_recent_window_matches_old_rule(device: torch.device) -> None:
    """The window rows and positions the kernel stores are those `RecentWindow.write_rows`
    stores at `RecentWindow.index` for the same exact rows: sequences without a slot (-1) or
    with one out of range, and a 7-token chunk of sequence 1 (only its last WINDOW kept)."""
    fast, _ = _pair("q4", 2, 64, torch.bfloat16, True, device)
    seq_slots = torch.tensor([0, 1, 1, 1, 1, 1, 1, 1, -1, 2, 5], dtype=torch.int32)
    positions = torch.tensor([9, 3, 4, 5, 6, 7, 8, 9, 0, 31, 2], dtype=torch.int32)
    slots = torch.arange(seq_slots.shape[0], device=device) * 5
    assert fast.recent is not None
    oracle = RecentWindow(WINDOW, SEQS, 2, 64, torch.bfloat16, [device] * LAYERS)
    for layer in range(LAYERS):
        key, value = _rows(seq_slots.shape[0], 2, 64, torch.bfloat16, device, seed=layer)
        ring = fast.recent.layers[layer]
        oracle.layers[layer].rows.copy_(ring.rows)
        oracle.layers[layer].positions.copy_(ring.positions)
        fast.write(layer, key, value, slots)
        fast.write_recent(layer, key, value, positions.to(device), seq_slots.to(device))
        index = oracle.index(positions, seq_slots, device)
        oracle.write_rows(layer, fast.step_rows(layer, key, value).exact, index)
        real = SEQS * WINDOW  # the spare row absorbs unkept tokens in any order
        assert torch.equal(ring.positions[:real], oracle.layers[layer].positions[:real])
        assert torch.equal(ring.rows[:, :real], oracle.layers[layer].rows[:, :real])


def test_decode_steps_in_cuda_graph(cuda_device: torch.device) -> None:
    """Write and window write captured once, replayed with new rows, slots and positions
    (crossing a page head): the same as running them eagerly."""
    fast, _ = _pair("q4", 8, 128, torch.bfloat16, True, cuda_device)
    twin, _ = _pair("q4", 8, 128, torch.bfloat16, True, cuda_device)  # the same poison
    batch = SEQS
    key = torch.zeros(batch, 8, 128, dtype=torch.bfloat16, device=cuda_device)
    value = torch.zeros_like(key)
    slots = torch.zeros(batch, dtype=torch.int64, device=cuda_device)
    positions = torch.zeros(batch, dtype=torch.int32, device=cuda_device)
    seq_slots = torch.arange(batch, dtype=torch.int32, device=cuda_device)

    def step(storage: QuantStorage, k: torch.Tensor, v: torch.Tensor, s: torch.Tensor,
             p: torch.Tensor) -> None:
        for layer in range(LAYERS):
            storage.write(layer, k, v, s)
            storage.write_recent(layer, k, v, p, seq_slots)

    for storage in (fast, twin):  # compile outside the capture; both write the same
        step(storage, key, value, slots, positions)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step(fast, key, value, slots, positions)
    for position in (15, 16, 17):
        new_key, new_value = _rows(batch, 8, 128, torch.bfloat16, cuda_device, seed=position)
        new_slots = torch.arange(batch, device=cuda_device) * 2 * PAGE + position
        new_positions = torch.full((batch,), position, dtype=torch.int32, device=cuda_device)
        key.copy_(new_key)
        value.copy_(new_value)
        slots.copy_(new_slots)
        positions.copy_(new_positions)
        graph.replay()
        step(twin, new_key, new_value.contiguous(), new_slots, new_positions)
    twin_tensors = _tensors(twin)
    for index, tensor in enumerate(_tensors(fast)):
        assert torch.equal(tensor, twin_tensors[index]), index
