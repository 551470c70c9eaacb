"""Speculative decoding: the same greedy text, fewer target forwards.

With ``use_ngram_draft=True`` the generator drafts each job's next tokens by looking up its
last few tokens earlier in its prompt and output, and the model checks a whole draft in one
forward. It pays when the answer copies from the prompt (quoting, editing, code changes).
The output is the same as without drafting; the final result says how many drafts were
accepted and rejected.
"""

from __future__ import annotations

from _demo import model_dir

from dyngen_core import DynamicGenerator, Job, SamplerSettings

generator = DynamicGenerator.from_model_dir(model_dir(), cache_tokens=8192, use_ngram_draft=True)
# With a smaller draft model of the same tokenizer instead (e.g. `dyngen fetch-speculative-pair`
# gives Qwen2.5-Coder-1.5B-Instruct and its 0.5B draft):
#   generator = DynamicGenerator.from_model_dir(
#       "~/.cache/dyngen/Qwen2.5-Coder-1.5B-Instruct",
#       draft_model_dir="~/.cache/dyngen/Qwen2.5-Coder-0.5B-Instruct", num_draft_tokens=4)
tokenizer = generator.tokenizer

paragraph = ("The lighthouse on Carrow Point was built in 1871 from granite quarried on the "
             "island itself. Its keeper, Margaret Hale, kept a logbook for thirty-two years.")
prompt = tokenizer.apply_chat_template([{
    "role": "user",
    "content": f"Repeat this paragraph word for word:\n\n{paragraph}",
}])
generator.enqueue(Job(input_ids=tokenizer.encode(prompt, encode_special_tokens=True),
                      max_new_tokens=120, gen_settings=SamplerSettings.greedy()))
while generator.num_remaining_jobs():
    for result in generator.iterate():
        if result.eos:
            print(result.full_completion)
            print(f"\n{result.new_tokens} tokens; drafts accepted "
                  f"{result.accepted_draft_tokens}, rejected {result.rejected_draft_tokens}")
stats = generator.stats()
print(f"generator: {stats.draft_tokens_accepted} drafts accepted, "
      f"{stats.draft_tokens_rejected} rejected")
