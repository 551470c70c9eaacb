"""The sdpa backend's slot reader (unquantized caches) and page reader (quantized caches)
against a plain per-sequence attention written out in torch.

Each case fills a paged cache with random keys/values over shuffled pages, then runs one step
(decodes, prefill chunks, or both) through `SdpaBackend`, over two layers and several batches
with one backend, so the reused scratch buffer and the per-batch layout are exercised.
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from dyngen_core.config import ModelConfig
from dyngen_core.engine.plan import SequenceSlice, StepPlan
from dyngen_core.kv.attention.base import ForwardBatch, build_forward_batch
from dyngen_core.kv.attention.sdpa import SdpaBackend
from dyngen_core.kv.cache import make_storage
from dyngen_core.kv.fp16 import FP16Storage
from dyngen_core.kv.storage import KVStorage

PAGE_SIZE = 16
HEADS, KV_HEADS, HEAD_DIM = 4, 2, 32
# (query tokens this step, context length after it) per sequence; contexts end on, just past and
# just before page boundaries.
CASES = {
    "decodes_equal_context": [(1, 21), (1, 21), (1, 21)],
    "decodes_page_boundaries": [(1, 16), (1, 17), (1, 32), (1, 1), (1, 47)],
    "prefill_only": [(16, 16), (9, 40), (5, 5)],
    "mixed_prefill_and_decode": [(1, 33), (20, 20), (1, 16), (7, 48), (1, 2)],
    "one_sequence_chunk": [(12, 64)],
}


def _config() -> ModelConfig:
    return ModelConfig(architecture="LlamaForCausalLM", vocab_size=32,
                       hidden_size=HEADS * HEAD_DIM, intermediate_size=64, num_layers=2,
                       num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM)


def _batch(storage: KVStorage, lens: list[tuple[int, int]], seed: int) -> ForwardBatch:
    """Random earlier context in shuffled pages for each sequence; the step's batch."""
    gen = torch.Generator().manual_seed(seed)
    order = list(range(storage.num_pages))
    random.Random(seed).shuffle(order)
    slices, offset = [], 0
    for job_id, (qlen, ctx) in enumerate(lens):
        count = math.ceil(ctx / PAGE_SIZE)
        table, offset = order[offset:offset + count], offset + count
        slots = [table[p // PAGE_SIZE] * PAGE_SIZE + p % PAGE_SIZE for p in range(ctx - qlen)]
        for layer in range(2):
            k, v = (torch.randn(len(slots), KV_HEADS, HEAD_DIM, generator=gen) for _ in "kv")
            storage.write(layer, k, v, torch.tensor(slots, dtype=torch.long))
        slices.append(SequenceSlice(job_id=job_id, token_ids=[1] * qlen, start_pos=ctx - qlen,
                                    page_table=table, sample=True))
    return build_forward_batch(StepPlan(slices=slices), PAGE_SIZE, "cpu")


def _plain_attention(storage: KVStorage, layer: int, q: torch.Tensor,
                     batch: ForwardBatch, scale: float) -> torch.Tensor:
    """Per sequence: its slots' keys/values (every page gathered), causal softmax(q k^T) v, one
    head at a time."""
    out = torch.empty_like(q)
    keys, values = (rows[0] for rows in
                    storage.gather(layer, torch.arange(storage.num_pages).view(1, -1)))
    group = HEADS // KV_HEADS
    start = 0
    for seq, (qlen, ctx) in enumerate(zip(batch.query_lens_host, batch.context_lens_host,
                                          strict=True)):
        table = batch.page_table[seq].tolist()
        slots = torch.tensor([table[p // PAGE_SIZE] * PAGE_SIZE + p % PAGE_SIZE
                              for p in range(ctx)])
        positions = torch.arange(ctx - qlen, ctx)
        visible = torch.arange(ctx)[None, :] <= positions[:, None]
        for head in range(HEADS):
            k, v = keys[slots, head // group], values[slots, head // group]
            scores = (q[start:start + qlen, head] @ k.T) * scale
            weights = scores.masked_fill(~visible, float("-inf")).softmax(-1)
            out[start:start + qlen, head] = weights @ v
        start += qlen
    return out


def _step(backend: SdpaBackend, storage: KVStorage, batch: ForwardBatch,
          seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Attend one step in both layers (fresh k/v written at the step's slots); (q, out) each."""
    gen = torch.Generator().manual_seed(seed)
    outs = []
    for layer in range(2):
        q = torch.randn(batch.num_tokens, HEADS, HEAD_DIM, generator=gen)
        k, v = (torch.randn(batch.num_tokens, KV_HEADS, HEAD_DIM, generator=gen) for _ in "kv")
        outs.append((q, backend.attend(layer, q, k, v, storage, batch, HEAD_DIM ** -0.5)))
    return outs


def _storage() -> FP16Storage:
    storage = make_storage("fp16", _config(), 24, PAGE_SIZE, torch.float32,
                           [torch.device("cpu")] * 2)
    assert isinstance(storage, FP16Storage)
    return storage


@pytest.mark.parametrize("case", sorted(CASES))
def test_slot_reader_matches_plain_attention(case: str) -> None:
    storage = _storage()
    batch = _batch(storage, CASES[case], seed=len(case))
    for layer, (q, ours) in enumerate(_step(SdpaBackend(), storage, batch, seed=1)):
        plain = _plain_attention(storage, layer, q, batch, HEAD_DIM ** -0.5)
        torch.testing.assert_close(ours, plain, rtol=1e-4, atol=1e-4)


def test_one_backend_over_batches_of_changing_size() -> None:
    """The scratch buffer grows and is reused: a large step, a small one, a large one again."""
    backend = SdpaBackend()
    for seed, case in enumerate(("decodes_equal_context", "mixed_prefill_and_decode",
                                 "one_sequence_chunk", "prefill_only")):
        storage = _storage()
        batch = _batch(storage, CASES[case], seed=seed)
        reused = _step(backend, storage, batch, seed=seed)
        fresh = _step(SdpaBackend(), storage, batch, seed=seed)
        for (_, ours), (_, ref) in zip(reused, fresh, strict=True):
            torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)


def test_quantized_storage_is_read_by_pages() -> None:
    """Quantized storage has no plain slot tensors: the backend must gather its pages."""
    from dyngen_core.kv.quant.storage import QuantStorage

    storage = QuantStorage(_config(), 24, PAGE_SIZE, torch.float32,
                           [torch.device("cpu")] * 2, mode="q8")
    batch = _batch(storage, CASES["mixed_prefill_and_decode"], seed=3)
    for layer, (q, ours) in enumerate(_step(SdpaBackend(), storage, batch, seed=3)):
        plain = _plain_attention(storage, layer, q, batch, HEAD_DIM ** -0.5)
        torch.testing.assert_close(ours, plain, rtol=1e-4, atol=1e-4)
