"""LangChain integration for dyngen: `ChatDynGen` (chat model) and `DynGenLLM` (text completion).

Both run on `dyngen_core.shared_generator`: every object pointed at the same model folder and
engine options — LangChain's or LlamaIndex's — shares one engine, one KV cache and one job
queue, so concurrent calls are batched together and shared prompt prefixes are computed once.
"""

from langchain_dyngen.chat_models import ChatDynGen
from langchain_dyngen.llms import DynGenLLM

__all__ = ["ChatDynGen", "DynGenLLM"]
__version__ = "0.1.0"
