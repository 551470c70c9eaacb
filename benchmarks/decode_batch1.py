"""Batch-1 decode: a 512-token prompt, 256 new tokens, dyngen vs transformers' eager generate.

Prints tok/s for: dyngen's generator (end to end, and its decode phase alone), the bare decode
step replayed from a CUDA graph (eager kernels, and torch.compile'd), and transformers'
``generate``. The memory roofline is the weight bytes one step reads over the device-to-device
copy bandwidth measured in the same run; the target is >= 80 % of it. With default options it
also reports the generator's start-up: the cache and graph capture (``setup_s``) and the first
job, which compiles the Triton kernels (``first_job_s``), with the Triton compiles (and disk-cache
loads) among them, counted and timed by kernel (``TRITON_CACHE_DIR=$(mktemp -d)`` for a first
start); `load_time.py` measures the load.

    python benchmarks/decode_batch1.py [--layers 32] [--new-tokens 256] [--no-compile] [--no-hf]
                                       [--compiled-only] [--set MODULE.NAME=VALUE]

``--set``: run with a kernel constant patched (benchmarks/kernels/constants.py), e.g.
``--set fused_ops.SILU_BLOCK=1024``.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch
from _common import (
    CompileClock,
    add_common_args,
    bench_config,
    copy_bandwidth,
    device_name,
    free_memory,
    graph_step,
    hf_model,
    make_generator,
    random_model,
    random_prompts,
    report,
    run_jobs,
    synchronize,
    weight_bytes,
    word_tokenizer,
)

from benchmarks.kernels import constants

PROMPT = 512


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    add_common_args(parser)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--no-compile", action="store_true")
    parser.add_argument("--no-hf", action="store_true")
    parser.add_argument("--compiled-only", action="store_true",
                        help="only the compiled graph step and generator (implies --no-hf)")
    constants.add_argument(parser)
    args = parser.parse_args()
    constants.apply(args.set)
    device = torch.device(args.device)
    config = bench_config(args)
    bandwidth = copy_bandwidth(device)
    model = random_model(config, device)
    step_bytes = weight_bytes(model)
    roofline_tps = bandwidth / step_bytes
    common = {"device": device_name(), "layers": config["num_hidden_layers"],
              "copy_GBps": bandwidth / 1e9, "weight_GB": step_bytes / 1e9,
              "roofline_tok_s": roofline_tps}
    report("decode_batch1.roofline", **common)

    tokenizer = word_tokenizer(config["vocab_size"])
    if args.compiled_only:
        context = PROMPT + args.new_tokens // 2
        report_graph_step(model, True, context, common, roofline_tps)
        compiled_generator(model, tokenizer, config, args.new_tokens, common, roofline_tps)
        return
    synchronize()
    start = time.perf_counter()
    with CompileClock() as compiles:
        generator = make_generator(model, tokenizer, cache_tokens=8192)
        synchronize()
        setup_s = time.perf_counter() - start
        prompt = random_prompts(1, PROMPT, config["vocab_size"], seed=1)
        first_job_s = run_jobs(generator, prompt, 8).wall  # warm-up: compiles the prefill kernels
    report("decode_batch1.startup", setup_s=setup_s, first_job_s=first_job_s,
           **compiles.summary(), **common)
    run = run_jobs(generator, random_prompts(1, PROMPT, config["vocab_size"], 2),
                   args.new_tokens)
    dyngen_tps = run.tok_s
    report("decode_batch1.dyngen_generator", tok_s=dyngen_tps, decode_tok_s=run.decode_tok_s,
           new_tokens=run.new_tokens, wall_s=run.wall,
           roofline_fraction=run.decode_tok_s / roofline_tps, **common)
    del generator
    free_memory()

    context = PROMPT + args.new_tokens // 2
    if device.type == "cuda":
        report_graph_step(model, False, context, common, roofline_tps)
    if not args.no_hf:
        hf_tps = transformers_tps(config, prompt, args.new_tokens, device)
        report("decode_batch1.transformers_generate", tok_s=hf_tps,
               dyngen_over_transformers=dyngen_tps / hf_tps, **common)
    if device.type == "cuda" and not args.no_compile:  # last: compiling takes a while
        report_graph_step(model, True, context, common, roofline_tps)
        compiled_generator(model, tokenizer, config, args.new_tokens, common, roofline_tps)


def compiled_generator(model, tokenizer, config: dict[str, Any], new_tokens: int,  # type: ignore[no-untyped-def]
                       common: dict[str, Any], roofline_tps: float) -> None:
    """The generator end to end with ``compile_decode=True`` (one bucket: max_batch_size=1)."""
    try:
        generator = make_generator(model, tokenizer, cache_tokens=8192, max_batch_size=1,
                                   compile_decode=True)
        run_jobs(generator, random_prompts(1, PROMPT, config["vocab_size"], seed=1), 8)
        run = run_jobs(generator, random_prompts(1, PROMPT, config["vocab_size"], 2), new_tokens)
    except Exception as exc:  # noqa: BLE001 - a compiler failure is a result, not a crash
        report("decode_batch1.dyngen_generator_compiled", error=repr(exc)[:500])
        return
    report("decode_batch1.dyngen_generator_compiled", tok_s=run.tok_s,
           decode_tok_s=run.decode_tok_s, roofline_fraction=run.decode_tok_s / roofline_tps,
           **common)
    del generator
    free_memory()


def report_graph_step(model, compiled: bool, context: int, common: dict[str, Any],  # type: ignore[no-untyped-def]
               roofline_tps: float) -> None:
    try:
        seconds, _ = graph_step(model, 1, context, compiled)
    except Exception as exc:  # report and go on: the other figures still count
        report("decode_batch1.graph_step", compiled=compiled, error=repr(exc)[:500])
        return
    report("decode_batch1.graph_step", compiled=compiled, context=context,
           step_ms=seconds * 1e3, tok_s=1 / seconds,
           roofline_fraction=(1 / seconds) / roofline_tps, **common)


def transformers_tps(config: dict[str, Any], prompt: list[list[int]], new_tokens: int,
                     device: torch.device) -> float:
    """transformers' generate (sdpa attention, dynamic cache), greedy, lengths forced."""
    hf = hf_model(config, device, attn="sdpa")
    ids = torch.tensor(prompt, device=device)
    hf.generate(ids, max_new_tokens=8, do_sample=False)
    synchronize()
    start = time.perf_counter()
    out = hf.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
    synchronize()
    tokens = int(out.shape[1] - PROMPT)
    tps = tokens / (time.perf_counter() - start)
    del hf
    free_memory()
    return tps

if __name__ == "__main__":
    main()
