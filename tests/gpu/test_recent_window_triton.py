"""The Triton kernel reads quantized storage's exact rows (page heads, recent windows) by the
same rule as the sdpa reference (`attention.sdpa.extend_with_recent`), in decode, prefill and
mixed steps, with sequences with and without a window slot, and with the context split several
ways; the storage written by its torch twin and by its one-launch Triton write (`quant.write`).
"""

from __future__ import annotations

import math
import random
from typing import Any

import pytest
import torch

from dyngen_core.config import ModelConfig
from dyngen_core.engine.plan import SequenceSlice, StepPlan
from dyngen_core.kv.attention.base import ForwardBatch, build_forward_batch
from dyngen_core.kv.attention.sdpa import SdpaBackend
from dyngen_core.kv.quant.storage import QuantStorage

pytestmark = pytest.mark.gpu

PAGE, WINDOW, HEADS, KV_HEADS, DIM = 16, 4, 4, 2, 32
# (query tokens this step, context after it, has a window slot) per sequence.
CASES = {
    "decodes": [(1, 21, True), (1, 17, True), (1, 33, False), (1, 2, True), (1, 1, True)],
    "chunks": [(9, 40, True), (3, 19, True), (20, 20, True), (6, 30, False)],
    "mixed": [(1, 35, True), (12, 50, True), (1, 16, False), (2, 18, True)],
}


def triton_backend(monkeypatch: pytest.MonkeyPatch) -> Any:
    """The Triton backend with 16-key tiles (the page size), at most 3 splits."""
    from dyngen_core.kv.attention.triton import decode  # needs triton
    from dyngen_core.kv.attention.triton.paged import TritonPagedBackend

    monkeypatch.setattr(decode, "BLOCK_N", 16)
    monkeypatch.setattr(decode, "MAX_SPLITS", 3)
    return TritonPagedBackend()


def _setup(case: str, mode: str, device: torch.device, triton_write: bool,
           kind: type[QuantStorage] = QuantStorage
           ) -> tuple[QuantStorage, ForwardBatch, torch.Tensor, torch.Tensor]:
    config = ModelConfig(architecture="LlamaForCausalLM", vocab_size=32,
                         hidden_size=HEADS * DIM, intermediate_size=64, num_layers=1,
                         num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=DIM)
    storage = kind(config, 32, PAGE, torch.float32, [device], mode, recent_window=WINDOW,
                   triton_write=triton_write)
    storage.reserve_sequences(8)
    gen = torch.Generator().manual_seed(len(case))
    offsets = [torch.randn(KV_HEADS, DIM, generator=gen)]
    storage.set_key_offsets(offsets)
    order = list(range(32))
    random.Random(case).shuffle(order)
    slices, slots, step_k, step_v, used = [], [], [], [], 0
    for index, (qlen, ctx, has_slot) in enumerate(CASES[case]):
        table, used = order[used:used + math.ceil(ctx / PAGE)], used + math.ceil(ctx / PAGE)
        keys = (torch.randn(ctx, KV_HEADS, DIM, generator=gen) * 2).to(device)
        values = torch.randn(ctx, KV_HEADS, DIM, generator=gen).to(device)
        slot = index if has_slot else -1
        for pos in range(ctx - qlen):
            where = torch.tensor([table[pos // PAGE] * PAGE + pos % PAGE], device=device)
            storage.write(0, keys[pos:pos + 1], values[pos:pos + 1], where)
            storage.write_recent(0, keys[pos:pos + 1], values[pos:pos + 1],
                                 torch.tensor([pos], device=device),
                                 torch.tensor([slot], device=device))
        slices.append(SequenceSlice(index, [1] * qlen, ctx - qlen, table, True))
        slots.append(slot)
        step_k.append(keys[ctx - qlen:])
        step_v.append(values[ctx - qlen:])
    batch = build_forward_batch(StepPlan(slices), PAGE, device, seq_slots=slots)
    return storage, batch, torch.cat(step_k), torch.cat(step_v)


@pytest.mark.parametrize("triton_write", [False, True])
@pytest.mark.parametrize("mode", ["q4", "q8"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_triton_reads_exact_rows_like_sdpa(device: torch.device,
                                           monkeypatch: pytest.MonkeyPatch, case: str,
                                           mode: str, triton_write: bool) -> None:
    gen = torch.Generator().manual_seed(3)
    outputs = []
    for backend in (SdpaBackend(), triton_backend(monkeypatch)):
        storage, batch, k, v = _setup(case, mode, device, triton_write)
        q = torch.randn(batch.num_tokens, HEADS, DIM, generator=gen).to(device)
        gen.manual_seed(3)
        outputs.append(backend.attend(0, q, k, v, storage, batch, DIM ** -0.5))
        # Both wrote the step's rows into the windows after attending.
        held = storage.gather_recent(0, batch.seq_slots)
        newest = [int(row.max()) for row in held[2]] if held is not None else []
        assert newest == [c - 1 if slot else -1 for _, c, slot in CASES[case]]
    torch.testing.assert_close(outputs[1], outputs[0], rtol=2e-4, atol=2e-4)
