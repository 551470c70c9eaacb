"""RAG with LangChain on dyngen: one long document, many questions answered in one `batch`.

    python examples/langchain_rag.py [MODEL_DIR]

Every question's prompt starts with the same document. dyngen keeps that prefix in its paged
KV cache, so the document is computed once: the first (streamed) answer fills the cache, and
the batch that follows puts every other question into the engine at once, each reading the
document's pages instead of recomputing them. The script prints the answers and the savings,
from LangChain's own usage metadata (``input_token_details["cache_read"]``).
"""

from __future__ import annotations

import time

from _demo import model_dir
from langchain_core.prompts import ChatPromptTemplate
from langchain_dyngen import ChatDynGen

DOCUMENT = """\
Harbor Light Bakery: staff handbook (2024 edition)

History. Harbor Light Bakery was founded in 1987 by Marta Velasquez in a former boat shed on
Pier 4 of the old harbor in Port Elin. It started with one wood-fired oven and three loaves:
a sourdough, a rye and a sweet milk bread. Today the bakery has two shops, one on Pier 4 and
one on Lantern Street, and employs 23 people. The founder's grandson, Tomas Velasquez, has run
the bakery since 2015.

Opening hours. The Pier 4 shop opens at 6:30 in the morning and closes at 2 in the afternoon,
every day except Monday. The Lantern Street shop opens at 8 in the morning and closes at 6 in
the evening, Tuesday to Saturday. Both shops close on New Year's Day and on the first week of
February, when the ovens are cleaned and repaired.

Bread. The bakery bakes 400 loaves a day. The best seller is the harbor sourdough, made with a
starter that Marta brought from her mother's kitchen and that is fed twice a day with rye
flour. Dough rests for 18 hours in the cold room before it is shaped. The rye bread uses seeds
of caraway and is baked in tins. The milk bread is sold only on weekends.

Pastry. Pastry is made at the Lantern Street shop. The most popular pastry is the cardamom
knot, followed by the almond croissant. Every Friday the pastry team makes a fig and honey
tart, which usually sells out before noon.

Suppliers. Flour comes from the Green Valley mill, 40 kilometres north of Port Elin, delivered
every Tuesday and Friday. Butter and milk come from the Hollis dairy farm. Eggs come from
Ridgeway Farm. Coffee beans are roasted by the Lantern Street Roasters next door.

Safety. Every baker wears heat-proof gloves at the ovens. The cold room must stay between 2 and
4 degrees Celsius; the temperature is written in the log book every four hours. Knives are
sharpened every Monday. New staff spend their first week with a senior baker before working
alone at the ovens.

Staff. Shifts at Pier 4 start at 3:30 in the morning. Each employee gets a free loaf of bread
at the end of every shift and a 30 percent discount in both shops. Holidays are requested two
months in advance from the shift manager, Ines Park. Training on the new deck oven is given by
the head baker, Samuel Osei, on the first Wednesday of each month.

Community. Bread left at the end of the day is given to the Port Elin food bank. Every spring
the bakery runs a free bread-making class for children at the harbor school.
"""

QUESTIONS = [
    "Who founded Harbor Light Bakery?",
    "In which year was the bakery founded?",
    "How many people work at the bakery?",
    "When does the Pier 4 shop open?",
    "Which day is the Pier 4 shop closed?",
    "How many loaves does the bakery bake each day?",
    "What is the best-selling bread?",
    "How long does the dough rest in the cold room?",
    "What is the most popular pastry?",
    "Which tart is made every Friday?",
    "Where does the flour come from?",
    "Who supplies the eggs?",
    "What temperature must the cold room stay at?",
    "When do shifts at Pier 4 start?",
    "Who is the shift manager?",
    "Who gives training on the deck oven?",
    "What happens to bread left at the end of the day?",
]


def main() -> None:
    chat = ChatDynGen(model_dir=str(model_dir()), temperature=0, max_tokens=40,
                      stop=["\n\n"], cache_tokens=16384)
    prompt = ChatPromptTemplate.from_messages([
        ("system", "Answer the question about this document in one short sentence.\n\n"
                   "{document}"),
        ("human", "{question}"),
    ])
    chain = prompt | chat
    print(f"Document: {len(chat.get_token_ids(DOCUMENT))} tokens. "
          f"Questions: {len(QUESTIONS)}.\n")

    # 1. Stream one answer, token by token. Its prompt fills the cache with the document.
    print(f"Q: {QUESTIONS[0]}\nA: ", end="", flush=True)
    for chunk in chain.stream({"document": DOCUMENT, "question": QUESTIONS[0]}):
        print(chunk.text, end="", flush=True)
    print("\n")

    # 2. Every other question in one batch: all prompts enter the engine together.
    started = time.perf_counter()
    answers = chain.batch([{"document": DOCUMENT, "question": q} for q in QUESTIONS[1:]])
    seconds = time.perf_counter() - started
    for question, answer in zip(QUESTIONS[1:], answers, strict=True):
        print(f"Q: {question}\nA: {answer.text.strip()}\n")

    # 3. What the shared prefix saved, from each answer's usage metadata.
    usage = [a.usage_metadata for a in answers if a.usage_metadata]
    prompt_tokens = sum(u["input_tokens"] for u in usage)
    cached = sum(u.get("input_token_details", {}).get("cache_read", 0) for u in usage)
    generated = sum(u["output_tokens"] for u in usage)
    print(f"Batch of {len(answers)} questions: {seconds:.1f} s, {generated} tokens generated.")
    print(f"Prompt tokens: {prompt_tokens}; read from the prefix cache: {cached} "
          f"({100 * cached / max(prompt_tokens, 1):.0f}%); prefilled: {prompt_tokens - cached}.")


if __name__ == "__main__":
    main()
