"""One prompt, one completion: the simplest use of the generator."""

from __future__ import annotations

from _demo import model_dir

from dyngen_core import DynamicGenerator, SamplerSettings

generator = DynamicGenerator.from_model_dir(model_dir(), cache_tokens=8192)
tokenizer = generator.tokenizer
prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Tell me about owls."}])
text = generator.generate(prompt, max_new_tokens=100, encode_special_tokens=True,
                          gen_settings=SamplerSettings(temperature=0.7, top_p=0.9), seed=1)
print(text)
