"""One story, many questions: the shared prompt prefix is prefilled once and held once."""

from __future__ import annotations

from _demo import model_dir

from dyngen_core import DynamicGenerator, Job, SamplerSettings

STORY = " ".join([
    "Mira kept a lighthouse on a rocky island far from the mainland.",
    "Every evening she climbed one hundred and twelve steps to light the lamp,",
    "and every morning she wrote in a logbook what ships had passed.",
    "One stormy night a small boat with a red sail drifted towards the rocks,",
    "and Mira rowed out with a lantern to guide the two fishermen inside to safety.",
    "They stayed three days, repaired their sail with her spare canvas,",
    "and left her a jar of honey from their village as thanks.",
] * 6)
QUESTIONS = [
    "Who keeps the lighthouse?", "How many steps does Mira climb?",
    "What colour was the sail?", "How many fishermen were there?",
    "What did the fishermen leave?", "How long did they stay?",
    "What does Mira write in the logbook?", "Where is the lighthouse?",
]

generator = DynamicGenerator.from_model_dir(model_dir(), cache_tokens=16384)
tokenizer = generator.tokenizer
prompts = [
    tokenizer.apply_chat_template([{"role": "user", "content": f"{STORY}\n\nQuestion: {q}"}])
    for q in QUESTIONS
]
jobs = [Job(input_ids=tokenizer.encode(p, encode_special_tokens=True), max_new_tokens=32,
            gen_settings=SamplerSettings.greedy(), identifier=i) for i, p in enumerate(prompts)]
generator.enqueue(jobs)
answers = [""] * len(jobs)
peak_pages = 0
while generator.num_remaining_jobs():
    for result in generator.iterate():
        answers[result["identifier"]] += result.get("text", "")
    peak_pages = max(peak_pages, generator.stats().pages_referenced)
for question, text in zip(QUESTIONS, answers):
    print(f"Q: {question}\nA: {text.strip()}\n")

stats = generator.stats()
prompt_tokens = sum(len(j.input_ids) for j in jobs)
alone_pages = sum(-(-(len(j.input_ids) + len(j.new_token_ids)) // 256) for j in jobs)
print(f"prompt tokens: {prompt_tokens}; computed: {stats.prefill_tokens_computed}; "
      f"reused from shared pages: {stats.prefill_tokens_reused} "
      f"({stats.prefill_tokens_reused / prompt_tokens:.0%} of prefill saved)")
print(f"pages in use at the peak: {peak_pages} (without sharing: {alone_pages})")
