"""`JobSubmitter`: prompt text or chat-turn ids plus generation fields, as jobs on one engine.

Sync callers submit directly; async callers go through a `GateRegistry`, which groups one loop
iteration's jobs and hands them over off the event loop.
"""

from __future__ import annotations

from typing import Any

from llama_index.llms.dyngen.gate import GateRegistry
from llama_index.llms.dyngen.params import build_job

from dyngen_core import BackgroundGenerator, EngineOptions, JobHandle


class JobSubmitter:
    """Builds and submits jobs for one shared engine.

    engine: the `BackgroundGenerator` (from `shared_generator`) that runs them.
    """

    def __init__(self, engine: BackgroundGenerator) -> None:
        self.engine = engine
        self.tokenizer: Any = engine.tokenizer
        self._gates = GateRegistry(engine)
        generator: Any = engine.generator
        self._model_defaults = dict(generator.model.config.generation_defaults)
        # The longest prompt plus output one job can hold: the model's trained length, bounded
        # by the cache (a job that does not fit in the whole cache is refused).
        self.usable_window = min(int(generator.model.config.max_position_embeddings),
                                 int(generator.cache.max_tokens))

    def check(self, fields: dict[str, Any]) -> None:
        """Raise now on generation fields the engine would refuse (e.g. temperature < 0)."""
        self._job([0], fields, None)

    def text_ids(self, text: str) -> list[int]:
        """Token ids of a raw-text prompt (BOS added when the model's tokenizer asks for it)."""
        add_bos = bool(self.tokenizer.add_bos_token and self.tokenizer.bos_token_id is not None)
        return list(self.tokenizer.encode(text, add_bos=add_bos))

    def submit(self, input_ids: list[int], fields: dict[str, Any], constraint: Any = None
               ) -> JobHandle:
        """Submit prompt token ids; ``constraint`` (tools, structured output) wins over a
        per-call one in ``fields``."""
        return self.engine.submit(self._job(input_ids, fields, constraint))

    async def asubmit(self, input_ids: list[int], fields: dict[str, Any],
                      constraint: Any = None) -> JobHandle:
        """`submit` from an event loop, grouped with the loop iteration's other jobs."""
        return await self._gates.submit(self._job(input_ids, fields, constraint))

    def _job(self, input_ids: list[int], fields: dict[str, Any], constraint: Any) -> Any:
        return build_job(input_ids, fields, stop_token_ids=self.tokenizer.eos_token_ids,
                         model_defaults=self._model_defaults, constraint=constraint)


def gather_engine_options(data: Any) -> Any:
    """Constructor data with flat EngineOptions fields moved into ``engine_options``, over any
    given there (an EngineOptions or a dict); EngineOptions validates them, as in LangChain."""
    if not isinstance(data, dict):
        return data
    flat = {k: data.pop(k) for k in EngineOptions.model_fields if k in data}
    given = data.get("engine_options")
    if not flat and not isinstance(given, dict):
        return data
    if isinstance(given, EngineOptions):
        given = given.model_dump(exclude_unset=True)
    data["engine_options"] = EngineOptions(**{**(given or {}), **flat})
    return data
