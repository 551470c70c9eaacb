"""Throughput: 256 prompts of 512 tokens, 128 new tokens each (lengths forced), all at once.

Output tok/s of dyngen against transformers' static batched ``generate`` and its continuous
batching ``generate_batch``, plus the workload's roofline: prefill FLOPs at the matmul rate
measured in this run, then per decode step the larger of (weights + KV bytes) / measured copy
bandwidth and the step's FLOPs / matmul rate. Targets: >= 10x transformers' continuous batching,
>= 60 % of the roofline.

    python benchmarks/throughput.py [--layers 32] [--prompts 256] [--engines dyngen,hf_static,hf_cb]
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch
from _common import (
    add_common_args,
    bench_config,
    cache_tokens_for,
    copy_bandwidth,
    device_name,
    free_memory,
    hf_model,
    kv_bytes_per_token,
    make_generator,
    matmul_rate,
    random_model,
    random_prompts,
    report,
    run_jobs,
    synchronize,
    weight_bytes,
    word_tokenizer,
)

PROMPT, NEW = 512, 128


def roofline_seconds(config: dict[str, Any], weights: int, prompts: int, bandwidth: float,
                     flops: float) -> float:
    """The workload's floor: prefill at the matmul rate, each decode step at its larger bound."""
    params = weights / 2
    layers, hidden = config["num_hidden_layers"], config["hidden_size"]
    attention_prefill = 2 * 2 * layers * hidden * (PROMPT * PROMPT / 2)  # QK^T and PV, causal
    prefill = prompts * (2 * params * PROMPT + attention_prefill) / flops
    decode = 0.0
    kv_token = kv_bytes_per_token(config)
    for step in range(NEW - 1):
        context = PROMPT + step + 1
        step_bytes = weights + prompts * context * kv_token
        step_flops = prompts * (2 * params + 4 * layers * hidden * context)
        decode += max(step_bytes / bandwidth, step_flops / flops)
    return prefill + decode


def run_dyngen(model, config: dict[str, Any], prompts: list[list[int]],  # type: ignore[no-untyped-def]
               compile_decode: bool = False) -> float:
    tokenizer = word_tokenizer(config["vocab_size"])
    started = time.perf_counter()
    generator = make_generator(model, tokenizer, cache_tokens=cache_tokens_for(prompts, NEW),
                               max_batch_size=len(prompts), max_chunk_size=16384,
                               compile_decode=compile_decode)
    report("throughput.dyngen_setup", seconds=time.perf_counter() - started,
           compile_decode=compile_decode)
    # Warm-up on other prompts (no prompt-cache hits later): prefill kernels, a few buckets.
    run_jobs(generator, random_prompts(4, PROMPT, config["vocab_size"], seed=98), 4)
    run = run_jobs(generator, prompts, NEW)
    assert run.new_tokens == len(prompts) * NEW, run.new_tokens
    report("throughput.dyngen", tok_s=run.tok_s, wall_s=run.wall, new_tokens=run.new_tokens,
           compile_decode=compile_decode)
    del generator
    return run.tok_s


def run_hf_static(hf: Any, prompts: list[list[int]], device: torch.device) -> float:
    ids = torch.tensor(prompts, device=device)
    hf.generate(ids[:4], max_new_tokens=4, do_sample=False)
    synchronize()
    start = time.perf_counter()
    out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW,
                      min_new_tokens=NEW, do_sample=False)
    synchronize()
    wall = time.perf_counter() - start
    tokens = int(out.shape[0] * (out.shape[1] - PROMPT))
    report("throughput.transformers_static_generate", tok_s=tokens / wall, wall_s=wall,
           new_tokens=tokens)
    return tokens / wall


def run_hf_continuous(hf: Any, prompts: list[list[int]]) -> float:
    from transformers import GenerationConfig

    attn = "paged|sdpa"
    try:
        hf.set_attn_implementation(attn)
    except Exception as exc:  # older/newer transformers name it differently: let CB choose
        attn = f"sdpa (paged|sdpa refused: {exc!r:.120})"
    config = GenerationConfig(max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False,
                              eos_token_id=None, pad_token_id=0)
    hf.generate_batch(inputs=prompts[:4], generation_config=config)
    synchronize()
    start = time.perf_counter()
    outputs = hf.generate_batch(inputs=prompts, generation_config=config)
    synchronize()
    wall = time.perf_counter() - start
    tokens = sum(len(o.generated_tokens) for o in outputs.values())
    report("throughput.transformers_generate_batch", tok_s=tokens / wall, wall_s=wall,
           new_tokens=tokens, attn_implementation=attn,
           final_attn=getattr(hf.config, "_attn_implementation", "?"))
    return tokens / wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    add_common_args(parser)
    parser.add_argument("--prompts", type=int, default=256)
    parser.add_argument("--engines", default="dyngen,hf_static,hf_cb")
    parser.add_argument("--compile-decode", action="store_true",
                        help="dyngen with compile_decode=True (torch.compile'd decode graphs)")
    args = parser.parse_args()
    engines = args.engines.split(",")
    device = torch.device(args.device)
    config = bench_config(args)
    bandwidth, flops = copy_bandwidth(device), matmul_rate(device)
    prompts = random_prompts(args.prompts, PROMPT, config["vocab_size"], seed=3)
    model = random_model(config, device)
    weights = weight_bytes(model)
    floor = roofline_seconds(config, weights, len(prompts), bandwidth, flops)
    roofline_tps = len(prompts) * NEW / floor
    report("throughput.roofline", device=device_name(), layers=config["num_hidden_layers"],
           prompts=len(prompts), copy_GBps=bandwidth / 1e9, matmul_TFLOPs=flops / 1e12,
           floor_s=floor,
           roofline_tok_s=roofline_tps)
    rates: dict[str, float] = {}
    if "dyngen" in engines:
        rates["dyngen"] = run_dyngen(model, config, prompts, args.compile_decode)
        report("throughput.dyngen_roofline", roofline_fraction=rates["dyngen"] / roofline_tps)
    del model
    free_memory()
    if not {"hf_static", "hf_cb"} & set(engines):
        return
    hf = hf_model(config, device, attn="sdpa")
    for name, run in (("hf_static", lambda: run_hf_static(hf, prompts, device)),
                      ("hf_cb", lambda: run_hf_continuous(hf, prompts))):
        if name not in engines:
            continue
        try:
            rates[name] = run()
        except Exception as exc:  # report and go on
            report(f"throughput.{name}", error=repr(exc)[:800])
            continue
        if "dyngen" in rates:
            report(f"throughput.dyngen_over_{name}", ratio=rates["dyngen"] / rates[name])
        free_memory()


if __name__ == "__main__":
    main()
