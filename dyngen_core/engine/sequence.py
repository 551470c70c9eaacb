"""Per-job sequence state kept by the scheduler, its read-only view, and the scheduler's stats.

A `Sequence` is the scheduler's bookkeeping for one job: its token ids (prompt then generated),
how many of them have their keys and values in the cache (``num_computed``), its page table and
the chain hashes of its full pages. It holds no reference to the job object or to tensors.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from dyngen_core.engine.pages import ROOT_HASH, chain_hash


class SequenceStatus(enum.Enum):
    """WAITING: queued (or preempted), holds no pages. RUNNING: admitted, holds pages.
    FINISHED: finished or cancelled, pages released."""

    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False, slots=True)
class Sequence:
    """The scheduler's state for one job.

    token_ids: prompt then generated tokens. The last one's keys/values are never in the cache
        while running: it is fed by the next decode.
    num_computed: leading tokens whose keys/values are in the cache.
    page_table: page ids covering positions ``0 ..``; may run ahead of ``num_computed``.
    page_hashes: chain hashes of the full pages of ``token_ids`` (extended lazily).
    prefill_end: token count at the last admission; positions before it are prefill.
    num_cached_tokens: prompt tokens served from the cache, dedup or copies at first admission.
    num_skips: times later jobs were admitted while this one waited for pages.
    planned_pages / planned_ids / planned_drafts: the page table, fed tokens and (empty) drafts
        of the job's last decode slice, handed to its next decode slices while they still equal
        the job's (a plan's lists are never changed in place): a decode allocates no lists
        while nothing changed.
    """

    job_id: int
    token_ids: list[int]
    prompt_len: int
    max_new_tokens: int
    num_draft_tokens: int
    arrival: int
    num_computed: int = 0
    page_table: list[int] = field(default_factory=list)
    page_hashes: list[bytes] = field(default_factory=list)
    prefill_end: int = 0
    num_cached_tokens: int = 0
    num_skips: int = 0
    num_preemptions: int = 0
    admitted: bool = False
    status: SequenceStatus = SequenceStatus.WAITING
    planned_pages: list[int] | None = None
    planned_ids: list[int] | None = None
    planned_drafts: list[int] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_generated(self) -> int:
        return len(self.token_ids) - self.prompt_len

    @property
    def num_pending(self) -> int:
        """Tokens not yet in the cache; 1 means prefill is done and the next step decodes."""
        return len(self.token_ids) - self.num_computed

    def parent_hash(self, page_index: int, page_size: int) -> bytes:
        """The chain hash of the page before ``page_index`` (ROOT_HASH for the first page)."""
        return self.hashes_upto(page_index, page_size)[page_index - 1] if page_index else ROOT_HASH

    def hashes_upto(self, num_pages: int, page_size: int) -> list[bytes]:
        """Chain hashes of the first ``num_pages`` pages, which must be full; computed once."""
        hashes, tokens = self.page_hashes, self.token_ids
        while len(hashes) < num_pages:
            k = len(hashes)
            parent = hashes[k - 1] if k else ROOT_HASH
            hashes.append(chain_hash(parent, tokens[k * page_size:(k + 1) * page_size]))
        return hashes

    def page_tokens(self, page_index: int, page_size: int) -> list[int]:
        """The token ids that page ``page_index`` holds when complete (fewer for the last)."""
        return self.token_ids[page_index * page_size:(page_index + 1) * page_size]


class SequenceView:
    """Read-only view of a job's sequence state (copies are made only when asked for)."""

    __slots__ = ("_seq",)

    def __init__(self, seq: Sequence) -> None:
        self._seq = seq

    @property
    def job_id(self) -> int:
        return self._seq.job_id

    @property
    def token_ids(self) -> tuple[int, ...]:
        """Prompt then generated tokens (a copy)."""
        return tuple(self._seq.token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self._seq.token_ids)

    @property
    def last_token(self) -> int:
        return self._seq.token_ids[-1]

    @property
    def prompt_len(self) -> int:
        return self._seq.prompt_len

    @property
    def num_generated(self) -> int:
        return self._seq.num_generated

    @property
    def num_computed(self) -> int:
        return self._seq.num_computed

    @property
    def num_cached_tokens(self) -> int:
        return self._seq.num_cached_tokens

    @property
    def page_table(self) -> tuple[int, ...]:
        return tuple(self._seq.page_table)

    @property
    def status(self) -> SequenceStatus:
        return self._seq.status

    @property
    def num_preemptions(self) -> int:
        return self._seq.num_preemptions

    def __repr__(self) -> str:
        s = self._seq
        return (f"SequenceView(job_id={s.job_id}, status={s.status.value}, tokens={s.num_tokens}, "
                f"computed={s.num_computed}, pages={len(s.page_table)})")
