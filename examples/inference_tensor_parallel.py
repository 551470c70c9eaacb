"""Tensor parallelism: one model over several processes (GPUs with NCCL; here the CPU with gloo).

`from_model_dir(..., tensor_parallel=N)` starts ranks 1..N-1 itself; rank 0 (this process)
schedules, samples and prints. The demo model has 9 query and 3 KV heads, so N must divide 3
heads evenly: 3 ranks here (slow on a small CPU; on GPUs use one rank per GPU)."""

from __future__ import annotations

import argparse

from _demo import model_dir

from dyngen_core import DynamicGenerator, SamplerSettings


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--ranks", type=int, default=3, help="tensor-parallel processes")
    args = parser.parse_args()
    generator = DynamicGenerator.from_model_dir(model_dir(), cache_tokens=4096,
                                                tensor_parallel=args.ranks)
    try:
        tokenizer = generator.tokenizer
        prompt = tokenizer.apply_chat_template([{"role": "user",
                                                 "content": "Tell me about owls."}])
        print(generator.generate(prompt, max_new_tokens=40, encode_special_tokens=True,
                                 gen_settings=SamplerSettings.greedy()))
    finally:
        generator.close()


if __name__ == "__main__":  # the ranks dyngen starts import this module again
    main()
