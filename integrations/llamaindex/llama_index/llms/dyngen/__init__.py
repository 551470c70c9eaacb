"""LlamaIndex LLM on dyngen's dynamic-batching engine: ``from llama_index.llms.dyngen import
DynGenLLM``."""

from llama_index.llms.dyngen.base import DynGenLLM

__all__ = ["DynGenLLM"]
