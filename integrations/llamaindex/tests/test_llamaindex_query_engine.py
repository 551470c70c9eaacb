"""DynGenLLM as `Settings.llm` under LlamaIndex query engines: async tree_summarize and
accumulate fan out into the shared queue at once, and prompts over the same document share
cache pages."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest
from llama_index.core import Document, Settings, VectorStoreIndex
from llama_index.core.embeddings import MockEmbedding
from llama_index.llms.dyngen import DynGenLLM

pytestmark = pytest.mark.demo

TOPICS = ["the river Seine", "Mont Blanc", "the Loire valley", "Provence lavender"]


def _document(topic: str) -> Document:
    # About 170 tokens: with the prompt around it, a prompt fills one 256-token page and
    # part of a second, so two questions about one document can share that first page.
    sentences = [f"Fact {i} about {topic}: guide {i} describes it with care." for i in range(10)]
    return Document(text=" ".join(sentences), metadata={"topic": topic})


@pytest.fixture(scope="module")
def index(llm: DynGenLLM) -> Iterator[VectorStoreIndex]:
    saved = (Settings._llm, Settings._embed_model, Settings._tokenizer)
    # A 400-token context window holds one document per prompt, so the four retrieved
    # documents become four prompts instead of being packed into one.
    Settings.llm = DynGenLLM(model_dir=llm.model_dir, max_tokens=3, temperature=0.0,
                             context_window=400, engine_options=llm.engine_options)
    Settings.embed_model = MockEmbedding(embed_dim=8)
    Settings.tokenizer = llm.tokenize
    try:
        yield VectorStoreIndex.from_documents([_document(t) for t in TOPICS])
    finally:
        Settings._llm, Settings._embed_model, Settings._tokenizer = saved


def test_async_tree_summarize_fans_out_and_shares_the_document_prefix(
    index: VectorStoreIndex, llm: DynGenLLM, probe: Any
) -> None:
    engine = index.as_query_engine(response_mode="tree_summarize", use_async=True,
                                   similarity_top_k=len(TOPICS))
    questions = ["Which places are mentioned?", "What do the guides describe?"]
    before = llm.engine.stats()

    async def ask_both() -> list[Any]:
        return await asyncio.gather(*(engine.aquery(q) for q in questions))

    answers = asyncio.run(ask_both())
    after = llm.engine.stats()
    assert all(len(a.source_nodes) == len(TOPICS) for a in answers)
    assert all(str(a).strip() for a in answers)
    # Each question summarizes its four documents in parallel (four prompts at once, and the
    # other question's prompts join while they run).
    assert probe.most_jobs >= 4
    # Both questions put the same document first: those pages are prefilled once.
    assert after.prefill_tokens_reused - before.prefill_tokens_reused >= 256


def test_sync_query_with_use_async_fans_out_too(index: VectorStoreIndex, llm: DynGenLLM,
                                                 probe: Any) -> None:
    engine = index.as_query_engine(response_mode="accumulate", use_async=True,
                                   similarity_top_k=len(TOPICS))
    answer = engine.query("Name one place.")
    assert "Response 4:" in str(answer) and "Response 5:" not in str(answer)
    assert probe.most_jobs >= 4
