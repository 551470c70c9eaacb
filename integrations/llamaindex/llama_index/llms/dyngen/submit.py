"""`JobSubmitter`: prompt text or chat-turn ids plus generation fields, as jobs on the shared
engine of one model folder and engine options.

Sync callers submit directly; async callers go through a `dyngen_core.SubmissionCoalescer`,
which sends the jobs one event-loop iteration produces in one ``submit_many``: a query engine
with ``use_async=True`` starts its prompts with ``asyncio.gather``, so they enter the same
scheduling step (they batch, and a shared document prefix is prefilled once).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from llama_index.llms.dyngen.params import build_job

from dyngen_core import (
    BackgroundGenerator,
    EngineOptions,
    JobHandle,
    SubmissionCoalescer,
    shared_generator,
)


class JobSubmitter:
    """Builds and submits jobs for one model folder and engine options.

    model_dir: the model folder.
    options: the `EngineOptions` of its shared engine.

    The engine is `shared_generator(model_dir, engine_options=options)`, asked for on every
    submission: an engine that was closed or stopped is replaced by a new one.
    """

    def __init__(self, model_dir: str | Path, options: EngineOptions) -> None:
        self._model_dir = model_dir
        self._options = options
        self._coalescer = SubmissionCoalescer()
        engine = self.engine  # loads the model now, so errors surface at construction
        self.tokenizer: Any = engine.tokenizer
        self._model_defaults = dict(engine.generation_defaults)
        # The longest prompt plus output one job can hold.
        self.usable_window = engine.max_job_tokens

    @property
    def engine(self) -> BackgroundGenerator:
        """The shared engine jobs go to now."""
        return shared_generator(self._model_dir, engine_options=self._options)

    def check(self, fields: dict[str, Any]) -> None:
        """Raise now on generation fields the engine would refuse (e.g. temperature < 0)."""
        self._job([0], fields, None)

    def text_ids(self, text: str) -> list[int]:
        """Token ids of a raw-text prompt (BOS added when the model's tokenizer asks for it)."""
        add_bos = bool(self.tokenizer.add_bos_token and self.tokenizer.bos_token_id is not None)
        return list(self.tokenizer.encode(text, add_bos=add_bos))

    def submit(self, input_ids: list[int], fields: dict[str, Any], constraint: Any = None,
               decode_special_tokens: bool = False) -> JobHandle:
        """Submit prompt token ids; ``constraint`` (tools, structured output) wins over a
        per-call one in ``fields``; ``decode_special_tokens`` where tool call markers are
        special tokens."""
        return self.engine.submit(self._job(input_ids, fields, constraint,
                                            decode_special_tokens))

    async def asubmit(self, input_ids: list[int], fields: dict[str, Any],
                      constraint: Any = None, decode_special_tokens: bool = False
                      ) -> JobHandle:
        """`submit` from an event loop, grouped with the loop iteration's other jobs."""
        job = self._job(input_ids, fields, constraint, decode_special_tokens)
        return await self._coalescer.submit(self.engine, job)

    def _job(self, input_ids: list[int], fields: dict[str, Any], constraint: Any,
             decode_special_tokens: bool = False) -> Any:
        return build_job(input_ids, fields, stop_token_ids=self.tokenizer.eos_token_ids,
                         model_defaults=self._model_defaults, constraint=constraint,
                         decode_special_tokens=decode_special_tokens)


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
