"""Sampling time per step: 1, 64 and 256 rows over a 49152-token vocabulary.

Four workloads: greedy; plain sampling (temperature, top_p, min_p: full-vocabulary sort and
noise); top-k top-p (temperature 0.8, top_k 50, top_p 0.9: the compact draw, fused into one
Triton kernel on CUDA with triton; ``cuda-torch`` rows run the same on CUDA with the torch
draw); and every stage on (bias, bans, penalties over a 1024-token history, DRY, temperature,
top_k, top_p, min_p, typical, tfs, top_a, XTC, mirostat). Runs on the CPU, and on CUDA when
present. Prints one table (median milliseconds per ``Sampler.sample`` call, transfers
included).

    python benchmarks/sampler.py [--rows 1 64 256] [--vocab 49152] [--repeats 5]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from dyngen_core.sampling import Sampler, SampleRequest, SamplerSettings, SamplerState

WORKLOADS = {
    "greedy": SamplerSettings.greedy(),
    "sample": SamplerSettings(temperature=0.8, top_p=0.9, min_p=0.02),
    "top-k top-p": SamplerSettings(temperature=0.8, top_p=0.9, top_k=50),
    "all stages": SamplerSettings(
        temperature=0.8, top_k=100, top_p=0.9, min_p=0.02, typical=0.95, tfs=0.95, top_a=0.1,
        xtc_probability=0.5, xtc_threshold=0.1, mirostat=True, token_repetition_penalty=1.1,
        token_repetition_range=512, token_repetition_decay=128, token_frequency_penalty=0.1,
        token_presence_penalty=0.1, dry_multiplier=0.8, dry_sequence_breakers=(13, 30),
        token_bias={42: 1.5, 43: -2.0}, banned_tokens=(7, 8, 9),
    ),
}


def make_requests(settings: SamplerSettings, rows: int, vocab: int) -> list[SampleRequest]:
    rng = random.Random(0)
    history = [rng.randrange(vocab) for _ in range(1024)]
    history[-200:] = history[-400:-200]  # a long repeat, so DRY finds real matches
    return [SampleRequest(settings, seed=i, counter=0, history=history, state=SamplerState())
            for i in range(rows)]


def time_step(sampler: Sampler, logits: torch.Tensor, requests: list[SampleRequest],
              repeats: int) -> float:
    sampler.sample(logits, requests)  # warm-up: lazily built tables, allocator
    times = []
    for step in range(repeats):
        for req in requests:
            req.counter = step + 1
        if logits.is_cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        sampler.sample(logits, requests)
        times.append(time.perf_counter() - start)  # sample() ends with a host transfer
    return statistics.median(times) * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 64, 256])
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    # (label, device, fused_draw): on CUDA the default (fused where triton is installed), and
    # the torch draw for comparison.
    devices: list[tuple[str, str, bool | None]] = [("cpu", "cpu", None)]
    if torch.cuda.is_available():
        devices += [("cuda", "cuda", None), ("cuda-torch", "cuda", False)]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} CPU threads, "
          f"vocab {args.vocab}, median of {args.repeats} steps (ms per step)")
    header = f"{'device':<11}{'rows':>6}" + "".join(f"{name:>14}" for name in WORKLOADS)
    print(header)
    print("-" * len(header))
    for label, device, fused_draw in devices:
        sampler = Sampler(args.vocab, device, eos_token_ids=[0], fused_draw=fused_draw)
        for rows in args.rows:
            generator = torch.Generator().manual_seed(rows)
            logits = (torch.randn(rows, args.vocab, generator=generator) * 3).to(device)
            cells = [time_step(sampler, logits, make_requests(s, rows, args.vocab), args.repeats)
                     for s in WORKLOADS.values()]
            print(f"{label:<11}{rows:>6}" + "".join(f"{c:>14.2f}" for c in cells))


if __name__ == "__main__":
    main()
