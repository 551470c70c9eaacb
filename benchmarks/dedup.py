"""Prefill work and wall time with dedup and the prompt cache on vs off, on the same jobs.

    python benchmarks/dedup.py [--model DIR] [--questions 16] [--doc-tokens 2000] [--device cpu]

One document followed by different questions (the RAG pattern), run three ways through
dyngen: sharing off, dedup among running jobs, and a second identical batch served from the
prompt cache. Prints prefill tokens computed and wall time, with ratios against sharing off.
"""

from __future__ import annotations

import argparse
import random
import time

from dyngen_core import Cache, DynamicGenerator, Job, Model, SamplerSettings, Tokenizer


def jobs_for(tokenizer: Tokenizer, doc: list[int], questions: int, new_tokens: int) -> list[Job]:
    rng = random.Random(1)
    vocab = tokenizer.vocab_size
    return [Job(input_ids=doc + [rng.randrange(100, vocab) for _ in range(30)],
                max_new_tokens=new_tokens, stop_conditions=[],
                gen_settings=SamplerSettings.greedy()) for _ in range(questions)]


def run(generator: DynamicGenerator, jobs: list[Job]) -> tuple[float, int, int]:
    before = generator.stats()
    start = time.perf_counter()
    generator.enqueue(jobs)
    while generator.num_remaining_jobs():
        generator.iterate()
    elapsed = time.perf_counter() - start
    after = generator.stats()
    return (elapsed, after.prefill_tokens_computed - before.prefill_tokens_computed,
            after.prefill_tokens_reused - before.prefill_tokens_reused)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--device", default=None)
    parser.add_argument("--questions", type=int, default=16)
    parser.add_argument("--doc-tokens", type=int, default=2000)
    parser.add_argument("--new-tokens", type=int, default=16)
    args = parser.parse_args()
    if args.model is None:
        from dyngen_core.cli.convert.demo import fetch_demo_model

        args.model = fetch_demo_model()
    model = Model.load(args.model, device=args.device)
    tokenizer = Tokenizer.from_model_dir(args.model)
    rng = random.Random(0)
    doc = [rng.randrange(100, tokenizer.vocab_size) for _ in range(args.doc_tokens)]
    cache_tokens = (args.doc_tokens + 30 + args.new_tokens + 256) * args.questions

    def generator(**options: bool) -> DynamicGenerator:
        return DynamicGenerator(model=model, cache=Cache(model, max_tokens=cache_tokens),
                                tokenizer=tokenizer, **options)

    def fresh_jobs() -> list[Job]:
        return jobs_for(tokenizer, doc, args.questions, args.new_tokens)

    rows = [("sharing off", *run(generator(dedup=False, prompt_cache=False), fresh_jobs()))]
    shared = generator()
    rows.append(("dedup", *run(shared, fresh_jobs())))
    rows.append(("dedup + prompt cache (2nd batch)", *run(shared, fresh_jobs())))
    base_time, base_prefill = rows[0][1], rows[0][2]
    print(f"model {args.model} on {model.device}; {args.questions} jobs, "
          f"{args.doc_tokens}-token document, {args.new_tokens} new tokens each")
    print(f"{'mode':<34}{'wall s':>8}{'prefill computed':>18}{'reused':>9}"
          f"{'time ratio':>12}{'prefill ratio':>15}")
    for name, elapsed, computed, reused in rows:
        print(f"{name:<34}{elapsed:>8.2f}{computed:>18}{reused:>9}"
              f"{elapsed / base_time:>12.2f}{computed / base_prefill:>15.3f}")


if __name__ == "__main__":
    main()
