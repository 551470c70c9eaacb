"""The decode step the q8/q4 kernel tests share: a quantized storage holding each sequence's
history (and recent window) in shuffled pages, with key offsets, and the batch decoding one more
token of every sequence (`decode_step`), and queries the kernel's int8 query codes hold exactly
(`int8_exact_queries`), so that the kernel and the float reference agree to rounding."""

from __future__ import annotations

import math
import random

import torch

from dyngen_core.config import ModelConfig
from dyngen_core.engine.plan import SequenceSlice, StepPlan
from dyngen_core.kv.attention.base import ForwardBatch, build_forward_batch
from dyngen_core.kv.quant.format import GROUP_SIZE, hadamard_matrix, round_query_codes
from dyngen_core.kv.quant.storage import QuantStorage


def decode_step(mode: str, window: int, decodes: list[tuple[int, bool]], *, heads: int,
                kv_heads: int, head_dim: int, page: int, dtype: torch.dtype,
                device: torch.device, seed: int, triton_write: bool | None = None
                ) -> tuple[QuantStorage, ForwardBatch, torch.Tensor, torch.Tensor]:
    """A ``mode`` storage of ``page``-slot pages with a ``window``-position recent window
    holding, for each (context, has a window slot) of ``decodes``, that sequence's first
    context - 1 keys and values, and the batch decoding its last token; returns the step's
    keys and values too ([sequences, kv_heads, head_dim] each). ``triton_write``: the
    storage's option of that name."""
    config = ModelConfig(architecture="LlamaForCausalLM", vocab_size=32,
                         hidden_size=heads * head_dim, intermediate_size=64, num_layers=1,
                         num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim)
    num_pages = sum(math.ceil(ctx / page) for ctx, _ in decodes) + 1
    storage = QuantStorage(config, num_pages, page, dtype, [device], mode,
                           recent_window=window, triton_write=triton_write)
    storage.reserve_sequences(len(decodes))
    gen = torch.Generator().manual_seed(seed)
    storage.set_key_offsets([torch.randn(kv_heads, head_dim, generator=gen)])
    order = list(range(num_pages))
    random.Random(seed).shuffle(order)
    slices, slots, step_k, step_v, used = [], [], [], [], 0
    for index, (ctx, has_slot) in enumerate(decodes):
        count = math.ceil(ctx / page)
        table, used = order[used:used + count], used + count
        keys = (torch.randn(ctx, kv_heads, head_dim, generator=gen) * 2).to(device, dtype)
        values = torch.randn(ctx, kv_heads, head_dim, generator=gen).to(device, dtype)
        slot = index if has_slot else -1
        if ctx > 1:
            where = torch.tensor([table[p // page] * page + p % page for p in range(ctx - 1)],
                                 device=device)
            storage.write(0, keys[:-1], values[:-1], where)
            storage.write_recent(0, keys[:-1], values[:-1],
                                 torch.arange(ctx - 1, device=device),
                                 torch.full((ctx - 1,), slot, device=device))
        slices.append(SequenceSlice(index, [1], ctx - 1, table, True))
        slots.append(slot)
        step_k.append(keys[-1:])
        step_v.append(values[-1:])
    batch = build_forward_batch(StepPlan(slices), page, device, seq_slots=slots)
    return storage, batch, torch.cat(step_k), torch.cat(step_v)


def int8_exact_queries(tokens: int, heads: int, head_dim: int,
                       generator: torch.Generator) -> torch.Tensor:
    """Float32 queries [tokens, heads, head_dim], random normal rounded as the q8/q4 decode
    kernel rounds them (`round_query_codes`): its int8 query codes then hold them exactly, and
    its output differs from the float reference's by rounding only."""
    q = torch.randn(tokens, heads, head_dim, generator=generator)
    return round_query_codes(q, hadamard_matrix(GROUP_SIZE))
