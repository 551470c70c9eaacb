"""The iterate() loop: enqueue jobs, then stream their results as they come, interleaved."""

from __future__ import annotations

from _demo import model_dir

from dyngen_core import DynamicGenerator, Job, SamplerSettings

generator = DynamicGenerator.from_model_dir(model_dir(), cache_tokens=8192)
tokenizer = generator.tokenizer
questions = ["Why is the sky blue?", "How do plants grow?", "What is a prime number?"]
for i, question in enumerate(questions):
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": question}])
    generator.enqueue(Job(
        input_ids=tokenizer.encode(prompt, encode_special_tokens=True),
        max_new_tokens=80,
        stop_conditions=[*tokenizer.eos_token_ids, "\n\n"],
        gen_settings=SamplerSettings(temperature=0.5),
        identifier=i,
        seed=i,
    ))

answers = {i: "" for i in range(len(questions))}
while generator.num_remaining_jobs():
    for result in generator.iterate():  # a list of zero or more results
        i = result["identifier"]
        if result["stage"] == "started":
            print(f"[job {i} started]")
        answers[i] += result.get("text", "")
        if result["eos"]:
            print(f"[job {i} done: {result['eos_reason']}, {result['new_tokens']} tokens, "
                  f"{result['time_generate']:.2f} s generating]")
            print(f"  Q: {questions[i]}\n  A: {answers[i].strip()}")
