"""End to end on the real demo model: our generator's greedy chat answers equal transformers'."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dyngen_core import DynamicGenerator, Job, SamplerSettings

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three uses of a paperclip.",
]


@pytest.mark.demo
def test_greedy_chat_continuations_equal_transformers(demo_model_dir: Path) -> None:
    transformers = pytest.importorskip("transformers")
    generator = DynamicGenerator.from_model_dir(demo_model_dir, cache_tokens=4096,
                                                device="cpu", dtype="float32")
    tokenizer = generator.tokenizer
    prompts = [
        tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": p}]),
                         encode_special_tokens=True)
        for p in PROMPTS
    ]
    jobs = [Job(input_ids=ids, max_new_tokens=32, stop_conditions=[],
                gen_settings=SamplerSettings.greedy(), identifier=i)
            for i, ids in enumerate(prompts)]
    generator.enqueue(jobs)  # all three run as one batch
    while generator.num_remaining_jobs():
        generator.iterate()
    generator.check_invariant()

    hf = transformers.AutoModelForCausalLM.from_pretrained(demo_model_dir,
                                                           dtype=torch.float32)
    for job, ids in zip(jobs, prompts):
        with torch.inference_mode():
            out = hf.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False,
                              eos_token_id=None, pad_token_id=0)
        expected = out[0, len(ids):].tolist()
        assert job.new_token_ids == expected, tokenizer.decode(expected)
