"""The Triton paged-attention decode kernel alone: achieved bandwidth per storage mode and
launch shape (keys per step, warps), at long context, to choose the backend's defaults.

One layer of Llama-3-8B shape (32 query heads, 8 KV heads, head_dim 128), random pages, decode
of every sequence at ``--context`` tokens. Bandwidth counts the page bytes (codes and scales)
of the context read once.

    python benchmarks/attention_kernels.py [--context 16384] [--batches 1,32]
"""

from __future__ import annotations

import argparse
from typing import Any

import torch
from _common import add_common_args, bench_config, cuda_seconds, device_name, report

from dyngen_core.attention.triton_paged import TritonPagedBackend
from dyngen_core.config import ModelConfig
from dyngen_core.forward import build_forward_batch
from dyngen_core.plan import SequenceSlice, StepPlan
from dyngen_core.storage import make_storage
from dyngen_core.storage.quant import QuantStorage

VARIANTS = [(32, 4), (64, 4), (64, 8), (128, 8)]  # (block_n, num_warps)


def one_layer_storage(config: dict[str, Any], mode: str, tokens: int,
                      device: torch.device) -> Any:
    shape = ModelConfig.from_dict({**config, "num_hidden_layers": 1})
    pages = tokens // 256
    if mode == "fp16":
        storage = make_storage("fp16", shape, pages, 256, torch.bfloat16, [device])
        storage.keys[0].normal_()
        storage.values[0].normal_()
        return storage
    storage = QuantStorage(shape, pages, 256, torch.bfloat16, [device], mode=mode)
    layer = storage.layers[0]
    for codes in (layer.key_codes, layer.value_codes):
        codes.view(torch.uint8).random_(0, 256)
    for scales in (layer.key_scales, layer.value_scales):
        scales.uniform_(0.01, 0.05)
    return storage


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    add_common_args(parser)
    parser.add_argument("--context", type=int, default=16384)
    parser.add_argument("--batches", default="1,32")
    args = parser.parse_args()
    device = torch.device(args.device)
    config = bench_config(args)
    heads, head_dim = config["num_attention_heads"], config["head_dim"]
    batches = [int(b) for b in args.batches.split(",")]
    pages_per_seq = args.context // 256
    for mode in ("fp16", "q8", "q4"):
        storage = one_layer_storage(config, mode, max(batches) * args.context, device)
        per_token = storage.nbytes() / (storage.num_pages * 256)
        for batch_size in batches:
            plan = StepPlan([SequenceSlice(i, [1], args.context - 1,
                                           list(range(i * pages_per_seq, (i + 1) * pages_per_seq)),
                                           True) for i in range(batch_size)])
            batch = build_forward_batch(plan, 256, device)
            q = torch.randn(batch_size, heads, head_dim, device=device, dtype=torch.bfloat16)
            for block_n, warps in VARIANTS:
                backend = TritonPagedBackend(block_n=block_n, decode_warps=warps)
                seconds = cuda_seconds(lambda b=backend, q=q, s=storage, fb=batch: b.attend_cached(
                    0, q, s, fb, head_dim**-0.5))
                read = batch_size * args.context * per_token
                report("attention_kernels.decode", device=device_name(), mode=mode,
                       batch=batch_size, context=args.context, block_n=block_n, warps=warps,
                       us=seconds * 1e6, GBps=read / seconds / 1e9)
        storage = None
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
