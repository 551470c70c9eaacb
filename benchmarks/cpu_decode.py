"""Decode speed on the CPU: dyngen vs transformers' generate on the same model and prompts.

    python benchmarks/cpu_decode.py [--model DIR] [--batch-sizes 1,8] [--new-tokens 64]

Both run greedy in float32 with the same torch thread count, on prompts of equal length (so
transformers needs no padding), generating exactly --new-tokens tokens per prompt (no early
stop). Both are warmed up first and their runs alternate; each reports its best of --repeats.
Prints tokens/s for each and the ratio dyngen / transformers.
"""

from __future__ import annotations

import argparse
import random
import time

import torch

from dyngen_core import Cache, DynamicGenerator, Job, Model, SamplerSettings, Tokenizer


def prompts(batch: int, length: int, vocab: int) -> list[list[int]]:
    rng = random.Random(batch)
    return [[rng.randrange(100, vocab) for _ in range(length)] for _ in range(batch)]


def dyngen_rate(generator: DynamicGenerator, ids: list[list[int]], new_tokens: int) -> float:
    generator.enqueue([Job(input_ids=p, max_new_tokens=new_tokens, stop_conditions=[],
                           gen_settings=SamplerSettings.greedy()) for p in ids])
    start = time.perf_counter()
    while generator.num_remaining_jobs():
        generator.iterate()
    return len(ids) * new_tokens / (time.perf_counter() - start)


def transformers_rate(hf_model: object, ids: list[list[int]], new_tokens: int) -> float:
    inputs = torch.tensor(ids)
    start = time.perf_counter()
    with torch.inference_mode():
        out = hf_model.generate(  # type: ignore[attr-defined]
            inputs, attention_mask=torch.ones_like(inputs), max_new_tokens=new_tokens,
            min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    assert out.shape[1] == inputs.shape[1] + new_tokens
    return len(ids) * new_tokens / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--batch-sizes", default="1,8")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2, help="best of N runs for each")
    args = parser.parse_args()
    if args.model is None:
        from dyngen_core.cli.convert.demo import fetch_demo_model

        args.model = fetch_demo_model()
    from transformers import AutoModelForCausalLM

    model = Model.load(args.model, device="cpu", dtype="float32")
    tokenizer = Tokenizer.from_model_dir(args.model)
    generator = DynamicGenerator(model=model, cache=Cache(model, max_tokens=16384),
                                 tokenizer=tokenizer, prompt_cache=False)
    hf_model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    print(f"model {args.model}; CPU threads {torch.get_num_threads()}; prompt "
          f"{args.prompt_tokens} tokens, {args.new_tokens} new tokens per prompt; best of "
          f"{args.repeats}")
    print(f"{'batch':>6}{'dyngen tok/s':>14}{'transformers tok/s':>20}{'ratio':>8}")
    warm_up = prompts(1, 16, tokenizer.vocab_size)
    dyngen_rate(generator, warm_up, 4)
    transformers_rate(hf_model, warm_up, 4)
    for batch in (int(b) for b in args.batch_sizes.split(",")):
        ids = prompts(batch, args.prompt_tokens, tokenizer.vocab_size)
        # Alternate the engines run by run, so a burst of load from other processes on a shared
        # machine slows both rather than whichever happened to be running.
        ours, theirs = 0.0, 0.0
        for _ in range(args.repeats):
            ours = max(ours, dyngen_rate(generator, ids, args.new_tokens))
            theirs = max(theirs, transformers_rate(hf_model, ids, args.new_tokens))
        print(f"{batch:>6}{ours:>14.1f}{theirs:>20.1f}{ours / theirs:>8.2f}")


if __name__ == "__main__":
    main()
