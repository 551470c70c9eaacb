"""Generation with a 4-bit quantized KV cache: the same memory holds about 3.5x the tokens.

Keys and values are rotated (a 32-point Hadamard transform spreads outlier channels), quantized
to 4 bits with one float16 scale per 32 values as they are written, and dequantized when read.
The first slot of every page and each running sequence's last 16 positions stay unquantized
(`Cache(..., recent_window=...)` changes the latter). benchmarks/cache_quality.py measures what
it all costs in prediction quality.
"""

from __future__ import annotations

from _demo import model_dir

from dyngen_core import Cache, DynamicGenerator, Model, SamplerSettings, Tokenizer

folder = model_dir()
model = Model.load(folder)
tokenizer = Tokenizer.from_model_dir(folder)

sixteen_bit = model.config.kv_bytes_per_token_fp16  # keys and values of all layers, 2 bytes each
print(f"16-bit cache: {sixteen_bit:,} bytes per token")
for mode in ("q8", "q6", "q4"):
    storage = Cache(model, max_tokens=256, mode=mode).storage
    # Codes and scales of a token, plus its share of the page's unquantized head row.
    per_token = storage.bytes_per_token() + storage.bytes_per_page_head() / 256  # type: ignore[attr-defined]
    print(f"{mode} cache: {per_token:,.0f} bytes per token, {sixteen_bit / per_token:.2f}x the "
          "tokens of a 16-bit cache in the same memory")

cache = Cache(model, max_tokens=16384, mode="q4")
generator = DynamicGenerator(model=model, cache=cache, tokenizer=tokenizer)
questions = ["What is a paged KV cache?", "Name three birds of prey.", "Why is the sky blue?"]
prompts = [tokenizer.apply_chat_template([{"role": "user", "content": q}]) for q in questions]
answers = generator.generate(prompts, max_new_tokens=60, encode_special_tokens=True,
                             gen_settings=SamplerSettings(temperature=0.0), seed=0)
for question, answer in zip(questions, answers, strict=True):
    print(f"\n### {question}\n{answer.strip()}")
print(f"\ncache: {cache}, {cache.nbytes() / 2**20:.1f} MiB")
