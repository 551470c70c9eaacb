"""One 8,000-token document, 64 different ~30-token questions, 128 new tokens each.

Wall time and prefill tokens with dedup (and the prompt cache) on, with both off, and for the
same 64 jobs without the document; then transformers' static batched ``generate`` on the full
prompts (in batches of ``--hf-batch``). Target: with dedup, <= 1.3x the time of the jobs
without the document; and the time the document adds (dedup run - no-document run) <= 1.5x the
document's prefill floor: its layers' matrix products (2 FLOP per weight and token) plus its
causal attention (2 n^2 H D a layer), both at the bf16 matmul rate measured in the same run.
``reachable_over_floor`` is the least added time this machine's kernels allow over that floor
(`reachable_added_time`: the products at the matrix library's own rate on their shapes, the
rest at the measured peaks).

    python benchmarks/shared_document.py [--layers 32] [--questions 64] [--skip-off] [--no-hf]
        [--set cascade_path.NAME=VALUE]

``--set``: run with a kernel constant patched (benchmarks/kernels/constants.py).
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
    cuda_seconds,
    device_name,
    free_memory,
    hf_model,
    make_generator,
    matmul_rate,
    random_model,
    random_prompts,
    report,
    run_jobs,
    synchronize,
    word_tokenizer,
)

from benchmarks.kernels import constants

DOCUMENT, QUESTION, NEW = 8000, 30, 128


def run_case(name: str, model: Any, tokenizer: Any, prompts: list[list[int]],
             **options: Any) -> float:
    generator = make_generator(model, tokenizer, cache_tokens=cache_tokens_for(prompts, NEW),
                               max_batch_size=len(prompts), max_chunk_size=16384, **options)
    warm_up(generator, model.config.vocab_size, len(prompts))
    before = generator.stats()
    run = run_jobs(generator, prompts, NEW)
    stats = generator.stats()
    report(f"shared_document.dyngen_{name}", wall_s=run.wall, tok_s=run.tok_s,
           prefill_tokens_computed=stats.prefill_tokens_computed - before.prefill_tokens_computed,
           prefill_tokens_reused=stats.prefill_tokens_reused - before.prefill_tokens_reused)
    del generator
    free_memory()
    return run.wall


def warm_up(generator: Any, vocab: int, jobs: int) -> None:
    """A run shaped like the workload (sharing no token with it): ``jobs`` jobs over a common
    3-page prefix, with question-length tails, so the shared-prefix kernels and the prefill
    tiles of the questions' step (their chunks beside the first job's decode) compile and the
    bucket's cascade graph is captured here, not inside a timed run (2.6 s on the H200 when
    they were not)."""
    prefix = random_prompts(1, 768, vocab, seed=99)[0]
    run_jobs(generator, [prefix + tail for tail in
                         random_prompts(jobs, QUESTION, vocab, seed=98)], 4)


def document_prefill_floor(config: dict[str, Any], tokens: int, rate: float) -> float:
    """Seconds of the document's prefill at ``rate`` FLOP/s: the decoder layers' products (no
    lm_head: a prefill computes logits only for sampled rows) and its causal attention."""
    hidden, heads, dim = config["hidden_size"], config["num_attention_heads"], config["head_dim"]
    kv_heads, inter = config["num_key_value_heads"], config["intermediate_size"]
    layer_weights = hidden * (heads + 2 * kv_heads) * dim + heads * dim * hidden \
        + 3 * hidden * inter
    layers = config["num_hidden_layers"]
    products = 2 * layer_weights * layers * tokens
    attention = 2 * tokens**2 * heads * dim * layers
    return (products + attention) / rate


def reachable_added_time(model: Any, config: dict[str, Any], questions: int, rate: float,
                         bandwidth: float) -> dict[str, float]:
    """The least time the document can add with the kernels this machine has, in seconds:
    its layers' products at the rate the matrix library reaches on their shapes (timed here,
    on layer 0's weights, over the document's rows), and everything else at the measured
    peaks: its causal attention and the questions' attention over it at ``rate``, and each
    decode step reading the document's keys and values once for all members (a shared-prefix
    pass) at ``bandwidth``."""
    import torch.nn.functional as F

    layer = model.layers[0]
    rows = torch.randn(DOCUMENT, config["hidden_size"], device=model.device, dtype=model.dtype)
    wide = torch.randn(DOCUMENT, config["intermediate_size"], device=model.device,
                       dtype=model.dtype)
    products = [(rows, layer.attn.qkv_weight), (rows, layer.attn.o_weight),
                (rows, layer.mlp.gate_up_weight), (wide, layer.mlp.down_weight)]
    layers, heads = config["num_hidden_layers"], config["num_attention_heads"]
    dim, kv_heads = config["head_dim"], config["num_key_value_heads"]
    product_s = layers * sum(cuda_seconds(lambda a=a, w=w: F.linear(a, w))  # type: ignore[misc]
                             for a, w in products)
    flops = sum(2 * a.shape[0] * w.shape[0] * w.shape[1] for a, w in products)
    attention_s = 2 * DOCUMENT**2 * heads * dim * layers / rate
    questions_s = 4 * questions * QUESTION * DOCUMENT * heads * dim * layers / rate
    document_bytes = DOCUMENT * layers * 2 * kv_heads * dim * model.dtype.itemsize
    decode_s = (NEW - 1) * document_bytes / bandwidth
    return {"products_s": product_s, "products_TFLOPs": flops * layers / product_s / 1e12,
            "attention_at_peak_s": attention_s, "questions_over_document_at_peak_s": questions_s,
            "decode_reads_at_bandwidth_s": decode_s,
            "reachable_s": product_s + attention_s + questions_s + decode_s}


def run_transformers(config: dict[str, Any], prompts: list[list[int]], batch: int,
                     device: torch.device) -> float:
    hf = hf_model(config, device, attn="sdpa")
    hf.generate(torch.tensor(prompts[:1], device=device)[:, -64:], max_new_tokens=4,
                do_sample=False)
    synchronize()
    start = time.perf_counter()
    for first in range(0, len(prompts), batch):
        ids = torch.tensor(prompts[first:first + batch], device=device)
        hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW,
                    min_new_tokens=NEW, do_sample=False)
    synchronize()
    wall = time.perf_counter() - start
    report("shared_document.transformers_static_generate", wall_s=wall, batch=batch,
           prefill_tokens_computed=sum(len(p) for p in prompts))
    return wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    add_common_args(parser)
    parser.add_argument("--questions", type=int, default=64)
    parser.add_argument("--hf-batch", type=int, default=16)
    parser.add_argument("--skip-off", action="store_true", help="skip the dedup-off run")
    parser.add_argument("--no-hf", action="store_true")
    constants.add_argument(parser)
    args = parser.parse_args()
    constants.apply(args.set)
    device = torch.device(args.device)
    config = bench_config(args)
    vocab = config["vocab_size"]
    document = random_prompts(1, DOCUMENT, vocab, seed=5)[0]
    questions = random_prompts(args.questions, QUESTION, vocab, seed=6)
    with_document = [document + q for q in questions]
    model = random_model(config, device)
    tokenizer = word_tokenizer(vocab)
    report("shared_document.setup", device=device_name(), layers=config["num_hidden_layers"],
           questions=args.questions, document_tokens=DOCUMENT, question_tokens=QUESTION)
    alone = run_case("no_document", model, tokenizer, questions)
    dedup = run_case("dedup_on", model, tokenizer, with_document)
    report("shared_document.dedup_over_no_document", ratio=dedup / alone, target=1.3)
    if device.type == "cuda":
        rate = matmul_rate(device)
        floor = document_prefill_floor(config, DOCUMENT, rate)
        report("shared_document.document_cost_over_floor", added_s=dedup - alone,
               floor_s=floor, ratio=(dedup - alone) / floor, matmul_TFLOPs=rate / 1e12,
               target=1.5)
        bound = reachable_added_time(model, config, args.questions, rate,
                                     copy_bandwidth(device))
        report("shared_document.reachable_over_floor", floor_s=floor, target_s=1.5 * floor,
               ratio=bound["reachable_s"] / floor, **bound)
    if not args.skip_off:
        off = run_case("dedup_off", model, tokenizer, with_document, dedup=False,
                       prompt_cache=False)
        report("shared_document.off_over_on", ratio=off / dedup)
    if args.no_hf:
        return
    del model
    free_memory()
    hf_wall = run_transformers(config, with_document, args.hf_batch, device)
    report("shared_document.transformers_over_dyngen_dedup", ratio=hf_wall / dedup)


if __name__ == "__main__":
    main()
