"""`DecodeStaging` writes exactly what staging each decode or verify row one by one writes.

The graphed decode and verify steps stage their inputs a column at a time and rewrite a row's
page table only when the row's slice brings another list or needs more pages. Against row-by-row
oracles (every field of every row written every step), over steps that advance, cross pages,
change and reorder jobs, shrink and grow the batch (padding rows), carry sequence slots and
alternate decode and verify steps, the whole staging buffers must stay equal. Pure numpy: runs
on the CPU.
"""

from __future__ import annotations

import random

import numpy as np
import pytest

from dyngen_core.engine.plan import SequenceSlice
from dyngen_core.runtime.graphs import DecodeStaging, DecodeViews, decode_query_len

PAGE = 4
ROWS = 12
WIDTH = 8
LONGS = 32  # token columns: a verify step packs at most this many


def _oracle(views: DecodeViews, slices: list[SequenceSlice], bucket: int,
            seq_slots: list[int] | None) -> None:
    """Every field of every row, one row at a time."""
    size = len(slices)
    views.slots[:size] = -1 if seq_slots is None else seq_slots
    views.query_start[:bucket + 1] = np.arange(bucket + 1)
    for row, piece in enumerate(slices):
        pos = piece.start_pos
        used = pos // PAGE + 1
        views.longs[0, row] = piece.token_ids[0]
        views.longs[1, row] = pos
        views.longs[2, row] = piece.page_table[pos // PAGE] * PAGE + pos % PAGE
        views.context[row] = pos + 1
        views.tables[row, :used] = piece.page_table[:used]
    if bucket > size:
        views.longs[:, size:bucket] = views.longs[:, size - 1:size]
        views.context[size:bucket] = views.context[size - 1]
        views.slots[size:bucket] = views.slots[size - 1]
        views.tables[size:bucket] = views.tables[size - 1]


def _verify_oracle(views: DecodeViews, slices: list[SequenceSlice], bucket: int,
                   query_len: int) -> int:
    """A verify step packed row by row, as `StepGraphs` staged it before the column form."""
    token = 0
    views.query_start[0] = 0
    for row, piece in enumerate(slices):
        ids = piece.token_ids + piece.draft_ids
        end = token + len(ids)
        positions = np.arange(piece.start_pos, piece.end_pos)
        pages = np.asarray(piece.page_table[:-(-piece.end_pos // PAGE)])
        views.longs[0, token:end] = ids
        views.longs[1, token:end] = positions
        views.longs[2, token:end] = pages[positions // PAGE] * PAGE + positions % PAGE
        views.context[row] = piece.end_pos
        views.tables[row, :len(pages)] = pages
        token = views.query_start[row + 1] = end
    size = len(slices)
    views.query_start[size + 1:bucket + 1] = token
    views.context[size:bucket] = 0
    views.longs[:2, token:bucket * query_len] = 0
    views.longs[2, token:bucket * query_len] = -1
    return token


class _Job:
    """A decoding job as the scheduler plans it: one table list while its pages do not change."""

    def __init__(self, job_id: int, rng: random.Random) -> None:
        self.job_id = job_id
        self.pos = rng.randrange(0, 3 * PAGE)
        self.spare = rng.choice((0, 1))  # room for drafts: a page past the one written
        self.pages = [rng.randrange(1000) for _ in range(self.pos // PAGE + 1 + self.spare)]
        self.table = self.pages[:]

    def slice(self, token: int, drafts: int = 0) -> SequenceSlice:
        while (self.pos + drafts) // PAGE + 1 + self.spare > len(self.pages):
            self.pages.append(self.pages[-1] + 1)
            self.table = self.pages[:]  # a new list once the table changes
        return SequenceSlice(self.job_id, [token], self.pos, self.table, True,
                             [token + 1 + d for d in range(drafts)])


@pytest.mark.parametrize("seed", range(8))
def test_column_staging_equals_row_by_row_staging(seed: int) -> None:
    rng = random.Random(seed)
    fast, slow = DecodeViews.zeros(ROWS, WIDTH, LONGS), DecodeViews.zeros(ROWS, WIDTH, LONGS)
    staging = DecodeStaging(fast, PAGE)
    jobs = [_Job(i, rng) for i in range(ROWS)]
    next_id = ROWS
    for step in range(60):
        size = rng.randrange(1, ROWS + 1)
        if rng.random() < 0.2:  # jobs end, new ones come, the order changes
            rng.shuffle(jobs)
            for k in range(rng.randrange(0, 3)):
                jobs[k] = _Job(next_id, rng)
                next_id += 1
        live = [job for job in jobs[:size] if job.pos < (WIDTH - 2) * PAGE]
        if not live:
            jobs = [_Job(next_id + i, rng) for i in range(ROWS)]
            next_id += ROWS
            continue
        bucket = rng.randrange(len(live), ROWS + 1)
        if rng.random() < 0.3:  # a verify step: each job its token and 0..3 drafts
            query_len = 4
            bucket = min(bucket, LONGS // query_len)
            slices = [job.slice(rng.randrange(500), rng.randrange(query_len))
                      for job in live[:bucket]]
            got = staging.stage_verify(slices, bucket, query_len)
            assert got == _verify_oracle(slow, slices, bucket, query_len), step
        else:
            slices = [job.slice(rng.randrange(-1, 500)) for job in live]
            seq_slots = None if rng.random() < 0.5 else [rng.randrange(-1, 8) for _ in slices]
            staging.stage(slices, bucket, seq_slots)
            _oracle(slow, slices, bucket, seq_slots)
        for name in ("longs", "context", "slots", "query_start", "tables"):
            assert np.array_equal(getattr(fast, name), getattr(slow, name)), (step, name)
        for job in live:
            job.pos += 1


def test_unchanged_rows_are_not_rewritten() -> None:
    """The point of the row cache: a row whose job kept its list is left as it is."""
    views = DecodeViews.zeros(ROWS, WIDTH, LONGS)
    staging = DecodeStaging(views, PAGE)
    table = [5, 6, 7]
    staging.stage([SequenceSlice(0, [1], 5, table, True)], 1, None)
    views.tables[0, 0] = 99  # not something staging would write: it must survive
    staging.stage([SequenceSlice(0, [1], 6, table, True)], 1, None)
    assert views.tables[0, 0] == 99
    staging.stage([SequenceSlice(0, [1], 8, table, True)], 1, None)  # a third page needed
    assert views.tables[0, :3].tolist() == [5, 6, 7]
    assert views.longs[2, 0] == 7 * PAGE


def test_decode_query_len_names_the_graphable_steps() -> None:
    def piece(tokens: int = 1, start: int = 0, sample: bool = True,
              drafts: int = 0) -> SequenceSlice:
        return SequenceSlice(0, [1] * tokens, start, [0, 1], sample, [2] * drafts)

    assert decode_query_len([piece(), piece(start=7)], 8) == 1
    assert decode_query_len([piece(drafts=2), piece(), piece(drafts=4)], 16) == 5
    assert decode_query_len([piece(start=5, drafts=2)], 8) == 3  # ends at position 8
    assert decode_query_len([piece(start=6, drafts=2)], 8) is None  # would end at 9
    assert decode_query_len([piece(start=8)], 8) is None
    assert decode_query_len([piece(), piece(tokens=2)], 8) is None  # a prefill chunk
    assert decode_query_len([piece(sample=False)], 8) is None
