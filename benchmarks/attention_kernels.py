"""The Triton paged-attention decode kernel alone: achieved bandwidth per storage mode and
launch shape (keys per step, warps), at long context, to choose the backend's defaults.

One layer of Llama-3-8B shape (32 query heads, 8 KV heads, head_dim 128), random pages, decode
of every sequence at ``--context`` tokens. Bandwidth counts the page bytes (codes and scales)
of the context read once. Quantized modes run as the runner does: with their default recent
window (q4: 16 positions, q8: none) and page heads, by the general kernel and by the q8/q4
decode kernel (`triton_quant`) in several launch shapes (the ``kernel`` field says which).

    python benchmarks/attention_kernels.py [--context 16384] [--batches 1,32]

``--shared`` instead times the shared-document decode (benchmarks/shared_document.py's shape:
64 sequences whose page tables share the 31 full pages of an 8,000-token document, each with
~160 tokens of its own) with the plain kernel and with shared-prefix (cascade) attention, and
checks that both agree:

    python benchmarks/attention_kernels.py --shared [--members 64] [--document 8000]
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

import torch
from _common import add_common_args, bench_config, cuda_seconds, device_name, report

from dyngen_core.config import ModelConfig
from dyngen_core.engine.cascade import plan_shared_prefixes
from dyngen_core.engine.plan import SequenceSlice, StepPlan
from dyngen_core.kv.attention.base import ForwardBatch, build_forward_batch
from dyngen_core.kv.attention.triton.paged import TritonPagedBackend
from dyngen_core.kv.fp16.storage import FP16Storage
from dyngen_core.kv.quant.storage import QuantStorage

VARIANTS = [(32, 4), (64, 4), (64, 8), (128, 8)]  # (block_n, num_warps)
# Quantized decode: (kernel, block_n, num_warps, launches); "general" is
# paged_attention_kernel, "words" the q8/q4 decode kernel of triton_quant (its page and tail
# programs in one launch or two).
QUANT_VARIANTS = [("general", 64, 4, 1), ("words", 32, 4, 1), ("words", 64, 4, 1),
                  ("words", 64, 8, 1), ("words", 128, 8, 1), ("words", 32, 4, 2),
                  ("words", 64, 4, 2), ("words", 64, 8, 2)]


def one_layer_storage(config: dict[str, Any], mode: str, tokens: int,
                      device: torch.device) -> Any:
    shape = ModelConfig.from_dict({**config, "num_hidden_layers": 1})
    pages = tokens // 256
    if mode == "fp16":
        fp16 = FP16Storage(shape, pages, 256, torch.bfloat16, [device])
        fp16.keys[0].normal_()
        fp16.values[0].normal_()
        return fp16
    storage = QuantStorage(shape, pages, 256, torch.bfloat16, [device], mode=mode)
    layer = storage.layers[0]
    for codes in (layer.key_codes, layer.value_codes):
        codes.view(torch.uint8).random_(0, 256)
    for scales in (layer.key_scales, layer.value_scales):
        scales.uniform_(0.01, 0.05)
    return storage


def decode_seconds(backend: TritonPagedBackend, q: torch.Tensor, storage: Any,
                   batch: ForwardBatch,
                   step_rows: tuple[torch.Tensor, torch.Tensor] | None = None) -> float:
    """Median seconds of one attention call of layer 0 over the cache (``step_rows``: the
    step's keys and values, which a quantized cache with a recent window reads exactly)."""
    return cuda_seconds(lambda: backend.attend_cached(0, q, storage, batch, q.shape[2] ** -0.5,
                                                      step_rows=step_rows))


def shared_document(config: dict[str, Any], members: int, document: int,
                    device: torch.device) -> None:
    """Plain vs cascade decode of ``members`` sequences sharing ``document`` tokens' full pages
    (one layer, bf16 pages): time, KV bytes each reads, agreement, host planning time."""
    heads, head_dim = config["num_attention_heads"], config["head_dim"]
    shared_pages, own_tokens = document // 256, document % 256 + 30 + 64  # + question + half
    own_pages = -(-own_tokens // 256)
    storage = one_layer_storage(config, "fp16", (shared_pages + members * own_pages) * 256,
                                device)
    shared = list(range(shared_pages))
    plan = StepPlan([SequenceSlice(i, [1], shared_pages * 256 + own_tokens - 1,
                                   shared + [shared_pages + i * own_pages + p
                                             for p in range(own_pages)], True)
                     for i in range(members)])
    batch = build_forward_batch(plan, 256, device)
    q = torch.randn(members, heads, head_dim, device=device, dtype=torch.bfloat16)
    per_token = storage.nbytes() / (storage.num_pages * 256)
    plain = TritonPagedBackend(cascade_min_saved_keys=None)
    cascade = TritonPagedBackend(cascade_min_saved_keys=0)  # the kernels, whatever the policy
    # As a replayed CUDA graph runs it: tables in a fixed region, launches from the batch size.
    graph_tables = cascade.graph_tables(storage, heads, config["num_key_value_heads"],
                                        capacity=members)
    writer = graph_tables.stage(plan) if graph_tables is not None else None
    if graph_tables is None or writer is None:
        raise RuntimeError("the shared-document batch did not plan a cascade")
    region = torch.zeros(graph_tables.size, dtype=torch.int32)
    writer(region.numpy())
    graph_batch = dataclasses.replace(batch, page_tables_host=None,
                                      graph_tables=graph_tables.views(region.to(device), members))
    outputs = {}
    for name, backend, case in (("plain", plain, batch), ("cascade", cascade, batch),
                                ("cascade_graph_tables", cascade, graph_batch)):
        outputs[name] = backend.attend_cached(0, q, storage, case, head_dim**-0.5).float()
        seconds = decode_seconds(backend, q, storage, case)
        context = shared_pages * 256 + own_tokens
        keys_read = members * context if name == "plain" else (
            shared_pages * 256 + members * own_tokens)  # prefix once (per row block, via L2)
        report("attention_kernels.shared_document", device=device_name(), kernel=name,
               members=members, document=document, us=seconds * 1e6,
               kv_MB=keys_read * per_token / 1e6, GBps_equivalent=members * context * per_token
               / seconds / 1e9)
    error = max(float((outputs[name] - outputs["plain"]).norm() / outputs["plain"].norm())
                for name in ("cascade", "cascade_graph_tables"))
    tables = batch.page_tables_host or []
    planning = cuda_seconds(lambda: plan_shared_prefixes(tables, batch.context_lens_host,
                                                         batch.query_lens_host, 256))
    report("attention_kernels.shared_document_check", relative_error=float(error),
           host_plan_us=planning * 1e6,
           default_policy_cascades=TritonPagedBackend().cascade.plan(batch, storage) is not None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    add_common_args(parser)
    parser.add_argument("--context", type=int, default=16384)
    parser.add_argument("--batches", default="1,32")
    parser.add_argument("--shared", action="store_true",
                        help="time the shared-document decode, plain vs cascade, instead")
    parser.add_argument("--members", type=int, default=64)
    parser.add_argument("--document", type=int, default=8000)
    args = parser.parse_args()
    device = torch.device(args.device)
    config = bench_config(args)
    if args.shared:
        shared_document(config, args.members, args.document, device)
        return
    batches = [int(b) for b in args.batches.split(",")]
    for mode in ("fp16", "q8", "q4"):
        storage = one_layer_storage(config, mode, max(batches) * args.context, device)
        per_token = storage.nbytes() / (storage.num_pages * 256)
        windowed = mode != "fp16" and storage.reserve_sequences(max(batches))
        for batch_size in batches:
            batch, q, step_rows = decode_inputs(config, batch_size, args.context, device,
                                                windowed)
            variants = (QUANT_VARIANTS if mode != "fp16"
                        else [("general", n, w, 1) for n, w in VARIANTS])
            for kernel, block_n, warps, launches in variants:
                backend = (TritonPagedBackend(word_block_n=block_n, word_warps=warps,
                                              word_launches=launches)
                           if kernel == "words" else
                           TritonPagedBackend(block_n=block_n, decode_warps=warps,
                                              word_block_n=None))
                seconds = decode_seconds(backend, q, storage, batch, step_rows)
                read = batch_size * args.context * per_token
                report("attention_kernels.decode", device=device_name(), mode=mode,
                       window=storage.recent_window if windowed else 0, batch=batch_size,
                       context=args.context, kernel=kernel, block_n=block_n, warps=warps,
                       launches=launches, us=seconds * 1e6, GBps=read / seconds / 1e9)
        storage = None
        torch.cuda.empty_cache()


def decode_inputs(config: dict[str, Any], batch_size: int, context: int, device: torch.device,
                  windowed: bool
                  ) -> tuple[ForwardBatch, torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """One decode of ``batch_size`` sequences at ``context`` tokens (sequence slots for the
    recent windows when ``windowed``): the batch, the queries and the step's keys/values."""
    pages_per_seq = context // 256
    plan = StepPlan([SequenceSlice(i, [1], context - 1,
                                   list(range(i * pages_per_seq, (i + 1) * pages_per_seq)), True)
                     for i in range(batch_size)])
    slots = list(range(batch_size)) if windowed else None
    batch = build_forward_batch(plan, 256, device, seq_slots=slots)
    head_dim = config["head_dim"]
    q = torch.randn(batch_size, config["num_attention_heads"], head_dim, device=device,
                    dtype=torch.bfloat16)
    k = torch.randn(batch_size, config["num_key_value_heads"], head_dim, device=device,
                    dtype=torch.bfloat16)
    return batch, q, (k, torch.randn_like(k))

if __name__ == "__main__":
    main()
