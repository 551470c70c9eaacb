"""`PromptLookup`: prompt-lookup (n-gram) drafts for a whole step's jobs at once, from their
token histories kept on the model's device.

A job's draft is the continuation of the most recent earlier occurrence of its last ``n``
tokens, the longest ``n`` from ``max_n`` down to ``min_n`` that occurred; a continuation that
runs into the end of the history repeats with its period (a repeating pattern keeps
repeating). One batched search answers every job of a step: each job's history is a row of a
device tensor, and a handful of tensor operations over the step's rows compare every position
with the job's suffix. The host's work per job is bookkeeping (which tokens are new, the row's
length), never a loop over tokens or a search, so its cost stays flat in the context length and
small in the batch; the search's work is on the device, beside the forward it precedes.

Rows are kept per job (`forget` frees one). Each call writes the tokens a job's history gained
since its last call; a history that no longer ends with what was written (a rewind, perhaps
followed by new tokens) is written afresh.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np
import torch

from dyngen_core.ops.suffix_match import suffix_match


class LookupRequest(Protocol):
    """One job's draft: up to ``length`` tokens after ``history`` (its prompt and accepted
    tokens, oldest first). The speculator's `DraftRequest` is one."""

    @property
    def job_id(self) -> int: ...

    @property
    def history(self) -> Sequence[int]: ...

    @property
    def length(self) -> int: ...


class PromptLookup:
    """Batched prompt lookup over histories kept on ``device`` (see the module docstring).

    device: where the histories are kept and searched (the target model's device).
    max_n / min_n: the longest and shortest suffix looked up (``1 <= min_n <= max_n``).
    use_kernel: search with the Triton kernel (`ops.suffix_match`); None: where triton runs by
        default (CUDA with triton installed), else the torch ops.
    """

    # Tokens compared to notice that a history was rewound since it was last written.
    TAIL = 4
    # The first rows' length; rows grow by doubling to the longest history.
    INITIAL_CAPACITY = 1024
    INITIAL_ROWS = 8

    def __init__(self, device: torch.device | str = "cpu", max_n: int = 4,
                 min_n: int = 1, *, use_kernel: bool | None = None) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"n-gram sizes must satisfy 1 <= min_n <= max_n; got min_n={min_n}, "
                             f"max_n={max_n}")
        self.device = torch.device(device)
        self.max_n, self.min_n = max_n, min_n
        self.use_kernel = use_kernel
        self._rows = torch.full((self.INITIAL_ROWS, self.INITIAL_CAPACITY), -1,
                                dtype=torch.int32, device=self.device)
        self._row_of: dict[int, int] = {}  # job id -> row
        self._free_rows = list(range(self.INITIAL_ROWS - 1, -1, -1))
        self._written: list[int] = [0] * self.INITIAL_ROWS  # tokens of each row's history
        self._tails: list[Sequence[int]] = [()] * self.INITIAL_ROWS
        self._warm_up()

    def draft(self, requests: Sequence[LookupRequest]) -> list[list[int]]:
        """Each request's draft: ``length`` tokens, or none when no suffix of its history
        occurred before (or ``length`` is 0)."""
        out: list[list[int]] = [[] for _ in requests]
        min_n = self.min_n
        live = [i for i, r in enumerate(requests) if r.length > 0 and len(r.history) >= min_n]
        if not live:
            return out
        asked = [requests[i] for i in live]
        width = max(r.length for r in asked)
        index = self._write(asked)
        answers = suffix_match(self._rows, index, width, self.max_n, self.min_n,
                               use_kernel=self.use_kernel).cpu().tolist()
        for i, request, answer in zip(live, asked, answers, strict=True):
            if answer[0]:
                out[i] = answer[1:1 + request.length]
        return out

    def _warm_up(self) -> None:
        """Search once at construction, so that the kernel's one-time compile is not paid (and
        measured as drafting's cost) in the first step that drafts."""
        index = torch.tensor([[0], [self.max_n + 1]], dtype=torch.int64, device=self.device)
        suffix_match(self._rows, index, 1, self.max_n, self.min_n, use_kernel=self.use_kernel)

    def forget(self, job_id: int) -> None:
        """The job ended: its row is free."""
        row = self._row_of.pop(job_id, None)
        if row is not None:
            self._written[row] = 0
            self._tails[row] = ()
            self._free_rows.append(row)

    def _write(self, requests: Sequence[LookupRequest]) -> torch.Tensor:
        """Write each history's new tokens into its row (one upload with the search's index);
        returns the search's ``[2, jobs]`` index (row, length) on the device."""
        rows, lengths = [], []
        starts, counts, written_rows = [], [], []
        tokens: list[int] = []
        row_of, written, tails, tail = self._row_of, self._written, self._tails, self.TAIL
        for request in requests:
            row = row_of.get(request.job_id)
            if row is None:
                row = self._new_row(request.job_id)
                written, tails = self._written, self._tails
            history = request.history
            length, done = len(history), written[row]
            if done and (length < done or history[done - len(tails[row]):done] != tails[row]):
                done = 0
            if length > done:
                tokens += history[done:]
                starts.append(done)
                counts.append(length - done)
                written_rows.append(row)
                written[row] = length
                tails[row] = history[-tail:]
            rows.append(row)
            lengths.append(length)
        self._reserve(max(lengths))
        jobs, total = len(rows), len(tokens)
        packed = np.empty(2 * jobs + 3 * total, dtype=np.int64)
        packed[:jobs] = rows
        packed[jobs:2 * jobs] = lengths
        if total:
            count = np.asarray(counts, dtype=np.int64)
            first = np.cumsum(count) - count  # where each row's tokens begin in ``tokens``
            at = 2 * jobs
            packed[at:at + total] = np.repeat(np.asarray(written_rows, dtype=np.int64), count)
            packed[at + total:at + 2 * total] = np.arange(total) + np.repeat(
                np.asarray(starts, dtype=np.int64) - first, count)
            packed[at + 2 * total:] = tokens
        on_device = torch.from_numpy(packed).to(self.device, non_blocking=True)
        if total:
            write = on_device[2 * jobs:].view(3, total)
            self._rows.index_put_((write[0], write[1]), write[2].to(torch.int32))
        return on_device[:2 * jobs].view(2, jobs)

    def _new_row(self, job_id: int) -> int:
        if not self._free_rows:
            old = self._rows.shape[0]
            grown = torch.full((2 * old, self._rows.shape[1]), -1, dtype=torch.int32,
                               device=self.device)
            grown[:old] = self._rows
            self._rows = grown
            self._free_rows = list(range(2 * old - 1, old - 1, -1))
            self._written = self._written + [0] * old
            self._tails = self._tails + [()] * old
        row = self._row_of[job_id] = self._free_rows.pop()
        return row

    def _reserve(self, length: int) -> None:
        """Grow the rows (doubling) to hold ``length`` tokens."""
        capacity = self._rows.shape[1]
        if length <= capacity:
            return
        while capacity < length:
            capacity *= 2
        grown = torch.full((self._rows.shape[0], capacity), -1, dtype=torch.int32,
                           device=self.device)
        grown[:, :self._rows.shape[1]] = self._rows
        self._rows = grown


__all__ = ["LookupRequest", "PromptLookup"]
