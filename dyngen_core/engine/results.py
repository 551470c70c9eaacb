"""What the generator hands back: `Result` per job event, `GeneratorStats`, `EosReason`.

Results are typed objects that also read as mappings (``result["text"]``, ``result.get(...)``),
because code ported from ExLlamaV2's dynamic generator indexes them like dicts. A key is present
only when its stage sets it, so ``"text" in result`` is meaningful.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, fields
from enum import Enum
from typing import Any


class EosReason(str, Enum):
    """Why a job ended (the ``eos_reason`` of its final result)."""

    STOP_TOKEN = "stop_token"
    STOP_STRING = "stop_string"
    MAX_NEW_TOKENS = "max_new_tokens"
    CANCELLED = "cancelled"
    ERROR = "error"
    CONSTRAINT_INCOMPLETE = "constraint_incomplete"

    def __str__(self) -> str:
        return self.value


class Result(Mapping[str, Any]):
    """One event of one job.

    Always: ``job``, ``identifier``, ``stage`` ("started", "prefill" or "streaming") and ``eos``.
    Streaming results add ``text`` and ``token_ids`` and, when the job asked, ``token_probs``,
    ``top_k_tokens``, ``top_k_probs``, ``logits``. Prefill results add ``prefill_progress`` and
    ``prefill_total``. The final result (``eos=True``) adds ``eos_reason``, ``full_completion``,
    ``new_tokens``, ``prompt_tokens``, ``cached_tokens``, ``cached_pages``, ``time_enqueued``,
    ``time_prefill``, ``time_generate``, ``accepted_draft_tokens``, ``rejected_draft_tokens``,
    and ``error`` when eos_reason is "error".
    """

    __slots__ = ("_data",)

    def __init__(self, **data: Any) -> None:
        self._data = data

    def raise_for_error(self) -> None:
        """Raise the engine's error when this is the final result of a job that failed
        (eos_reason "error"): the exception the job failed with, else a RuntimeError."""
        if self["eos"] and str(self["eos_reason"]) == "error":
            error = self.get("error")
            if isinstance(error, BaseException):
                raise error
            raise RuntimeError(f"the dyngen engine failed this job: {error!r}")

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Result:
        """A result over ``data`` as it is (not copied: the caller hands it over)."""
        result = cls.__new__(cls)
        result._data = data
        return result

    def __getitem__(self, key: str) -> Any:
        return self._data[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)

    def __getattr__(self, key: str) -> Any:
        try:
            return self._data[key]
        except KeyError:
            raise AttributeError(
                f"result has no {key!r} at stage {self._data.get('stage')!r}"
            ) from None

    def __repr__(self) -> str:
        shown = {k: v for k, v in self._data.items() if k != "job"}
        return f"Result({shown})"


_STREAMING_KEYS = ("job", "identifier", "stage", "eos", "text", "token_ids")
_STREAMING_KEY_SET = frozenset(_STREAMING_KEYS)


class StreamingResult(Result):
    """The common "streaming" result: one step's ``text`` and single token of a job that asked
    for no extra outputs, and nothing else. It reads exactly like
    ``Result(job=job, identifier=identifier, stage="streaming", eos=False, text=text,
    token_ids=[token_id])`` (same keys in the same order, equal to it); the generator builds one
    per running job per step, so its fields are slots instead of a dict built for each, and
    ``token_ids`` is a new one-token list built when read (none is allocated per step).
    `streaming_result` builds one.
    """

    __slots__ = ("job", "identifier", "text", "_token_id")
    stage = "streaming"
    eos = False
    # Built without arguments, then filled: with object's own __init__ the class call runs in
    # C, so `streaming_result` (a call, then slot stores) costs about half a Python __init__.
    __init__ = object.__init__

    @property
    def token_ids(self) -> list[int]:
        """The step's token, as a one-token list (a new list at each read)."""
        return [self._token_id]

    @property
    def _data(self) -> dict[str, Any]:  # type: ignore[override]
        """The fields as the dict a plain `Result` holds (built on demand)."""
        return {"job": self.job, "identifier": self.identifier, "stage": "streaming",
                "eos": False, "text": self.text, "token_ids": self.token_ids}

    def __getitem__(self, key: str) -> Any:
        if key in _STREAMING_KEY_SET:
            return getattr(self, key)
        raise KeyError(key)

    def __contains__(self, key: object) -> bool:
        return key in _STREAMING_KEY_SET

    def __iter__(self) -> Iterator[str]:
        return iter(_STREAMING_KEYS)

    def __len__(self) -> int:
        return len(_STREAMING_KEYS)

    def __reduce__(self) -> tuple[Any, ...]:
        # Copies and pickles become the plain `Result` this one reads as.
        return (Result.from_dict, (self._data,))


def streaming_result(job: Any, text: str, token_id: int) -> StreamingResult:
    """The `StreamingResult` of ``job``'s step that released ``text`` and sampled ``token_id``
    (its identifier is ``job.identifier``)."""
    result = StreamingResult()
    result.job = job
    result.identifier = job.identifier
    result.text = text
    result._token_id = token_id
    return result


@dataclass(frozen=True)
class GeneratorStats:
    """A snapshot of the engine: pages by state, prefill work done and saved, jobs, drafts.

    pages_referenced / pages_cached / pages_free: the pool's three states (they sum to
    pages_total). prefill_tokens_computed: prefill tokens the model computed (recomputation
    after preemption included). prefill_tokens_reused: prefill tokens taken from the cache
    instead (prompt cache hits, pages shared with running jobs, partial-page copies).
    jobs_active: running jobs. jobs_pending: waiting jobs. draft_tokens_accepted /
    draft_tokens_rejected: speculative drafts (0 until speculative decoding lands).
    preemptions: running jobs sent back to the queue because the cache ran out of pages, so
    far (each recomputes its tokens, mostly from cached pages); a cache too small for the load
    shows here first.
    """

    pages_total: int
    pages_referenced: int
    pages_cached: int
    pages_free: int
    prefill_tokens_computed: int
    prefill_tokens_reused: int
    jobs_active: int
    jobs_pending: int
    draft_tokens_accepted: int = 0
    draft_tokens_rejected: int = 0
    preemptions: int = 0

    def as_dict(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self)}
