"""Many prompts at once: generate() batches them and returns completions in order."""

from __future__ import annotations

import time

from _demo import model_dir

from dyngen_core import DynamicGenerator, SamplerSettings

generator = DynamicGenerator.from_model_dir(model_dir(), cache_tokens=16384)
tokenizer = generator.tokenizer
topics = ["owls", "volcanoes", "the moon", "bread", "rivers", "chess", "bees", "glass"]
prompts = [
    tokenizer.apply_chat_template([{"role": "user", "content": f"One sentence about {t}."}])
    for t in topics
]
start = time.perf_counter()
texts, finals = generator.generate(
    prompts, max_new_tokens=48, encode_special_tokens=True, seed=0,
    gen_settings=SamplerSettings(temperature=0.6, top_p=0.9, token_repetition_penalty=1.05),
    return_last_results=True, progress=True,
)
elapsed = time.perf_counter() - start
for topic, text in zip(topics, texts):
    print(f"--- {topic}\n{text.strip()}")
tokens = sum(f["new_tokens"] for f in finals)
print(f"\n{len(prompts)} prompts, {tokens} tokens in {elapsed:.1f} s "
      f"({tokens / elapsed:.1f} tok/s together)")
