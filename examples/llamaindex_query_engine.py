"""A LlamaIndex query engine on dyngen: several questions over the same documents at once.

    python examples/llamaindex_query_engine.py [--model-dir DIR]

Without --model-dir it uses the demo model (SmolLM2-135M-Instruct, fetched on first use). The
questions run concurrently in async tree_summarize mode, so every document-sized prompt lands
in dyngen's shared job queue at the same time; prompts that start with the same document share
its cache pages, which the engine stats at the end show as reused prefill tokens. Embeddings
come from a small local hashing embedding, so nothing is downloaded besides the model.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import math
import re
import time

from llama_index.core import Document, Settings, VectorStoreIndex
from llama_index.core.embeddings import BaseEmbedding
from llama_index.core.prompts import PromptTemplate
from llama_index.llms.dyngen import DynGenLLM
from pydantic import BaseModel

DOCUMENTS = {
    "Seine": "The Seine flows 777 kilometres from Burgundy through Paris to the English "
             "Channel at Le Havre. Barges carry grain and gravel on it, and thirty-seven "
             "bridges cross it in Paris alone.",
    "Mont Blanc": "Mont Blanc, at 4,806 metres the highest mountain of the Alps, stands on "
                  "the border of France and Italy. The first ascent was in 1786; a road "
                  "tunnel has run beneath it since 1965.",
    "Loire": "The Loire is the longest river in France, 1,006 kilometres long. Its valley "
             "between Sully-sur-Loire and Chalonnes is known for its castles and vineyards "
             "and is a UNESCO World Heritage Site.",
    "Lavender": "Lavender fields cover the Valensole plateau in Provence. They bloom from "
                "mid-June to late July, and the flowers are distilled into essential oil.",
}
QUESTIONS = ["Which river is the longest?", "How high is Mont Blanc?",
             "When does lavender bloom?"]


class HashEmbedding(BaseEmbedding):
    """Bag-of-words vectors by feature hashing: deterministic, local, good enough to find the
    document that shares a question's words."""

    dim: int = 256

    def _vector(self, text: str) -> list[float]:
        vector = [0.0] * self.dim
        for word in re.findall(r"[a-z0-9]+", text.lower()):
            digest = hashlib.blake2b(word.encode(), digest_size=4).digest()
            vector[int.from_bytes(digest, "little") % self.dim] += 1.0
        norm = math.sqrt(sum(v * v for v in vector)) or 1.0
        return [v / norm for v in vector]

    def _get_text_embedding(self, text: str) -> list[float]:
        return self._vector(text)

    def _get_query_embedding(self, query: str) -> list[float]:
        return self._vector(query)

    async def _aget_query_embedding(self, query: str) -> list[float]:
        return self._vector(query)


class Fact(BaseModel):
    """One fact about a place."""

    place: str
    fact: str


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", help="model folder (default: the demo model)")
    parser.add_argument("--max-tokens", type=int, default=48)
    args = parser.parse_args()
    model_dir = args.model_dir
    if model_dir is None:
        from dyngen_core.cli.convert.demo import fetch_demo_model

        model_dir = str(fetch_demo_model(progress=True))

    llm = DynGenLLM(model_dir=model_dir, max_tokens=args.max_tokens, temperature=0.0,
                    cache_tokens=8192)
    Settings.llm = llm
    Settings.embed_model = HashEmbedding()
    Settings.tokenizer = llm.tokenize  # count tokens the way the model does
    index = VectorStoreIndex.from_documents(
        [Document(text=text, metadata={"topic": topic}) for topic, text in DOCUMENTS.items()])
    engine = index.as_query_engine(response_mode="tree_summarize", use_async=True,
                                   similarity_top_k=2)

    async def ask_all() -> list[object]:
        return await asyncio.gather(*(engine.aquery(q) for q in QUESTIONS))

    start = time.perf_counter()
    answers = asyncio.run(ask_all())
    elapsed = time.perf_counter() - start
    for question, answer in zip(QUESTIONS, answers):
        print(f"Q: {question}\nA: {str(answer).strip()}\n")
    stats = llm.engine.stats()
    print(f"{len(QUESTIONS)} questions in {elapsed:.1f} s; prefill tokens computed "
          f"{stats.prefill_tokens_computed}, reused {stats.prefill_tokens_reused}")

    print("\nStreaming:", end=" ", flush=True)
    for chunk in llm.stream_complete("The Seine flows through", max_tokens=16):
        print(chunk.delta, end="", flush=True)
    fact = llm.structured_predict(
        Fact, PromptTemplate("State one fact about {place} from this text: {text}"),
        llm_kwargs={"max_tokens": 128}, place="the Loire", text=DOCUMENTS["Loire"])
    print(f"\n\nStructured (decoded under Fact's JSON schema): {fact!r}")


if __name__ == "__main__":
    main()
