"""Shared-prefix plans across decode steps: planned again only when a step changes what they
depend on.

`plan_shared_prefixes` reads the decodes' page tables only as far as each context covers whole
pages (its "visible" pages, for sequences long enough to be grouped: the candidates), and from
those only their pairwise common prefixes: two candidates fall in the same subset of a level
exactly when their common prefix reaches past it, and a level's shared length is the shortest
common prefix of its members. The plan, read as groups of jobs, is therefore a function of
the candidates and of the lengths of their pairwise common prefixes.

In steady decoding a step rarely changes one of those lengths. A sequence gains a visible page
every 256 tokens, and jobs come and go; a common prefix changes only if the page a sequence
gains is also in another candidate's visible pages (the other table must hold it right there),
or if the first page of a sequence that comes or goes is (else all its common prefixes are
empty). `SharedPrefixTracker` keeps, per job, the table and page count it saw last and, per
page, how many candidates' visible pages hold it; a step whose changes all pass these checks
reuses the previous plan (its members renumbered when the batch order changed). Any other
change (a shared page gained or lost, a job sharing pages coming or going, copy-on-write,
preemption, defragmentation relabelling pages, a table rewritten in any way) plans the step
from scratch, so the plan is always exactly what `plan_shared_prefixes` returns for it.
"""

from __future__ import annotations

from collections.abc import Sequence

from dyngen_core.engine.cascade import (
    CascadePlan,
    CascadePolicy,
    PrefixGroup,
    plan_shared_prefixes,
)
from dyngen_core.engine.plan import SequenceSlice


class SharedPrefixTracker:
    """`plan_shared_prefixes` of successive decode steps, reusing the previous step's plan
    whenever the step changed nothing it depends on (module docstring).

    page_size: slots per page.
    policy: thresholds (default `CascadePolicy()`).

    ``replans`` counts the steps planned from scratch.
    """

    def __init__(self, page_size: int, policy: CascadePolicy | None = None) -> None:
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1; got {page_size}")
        self.page_size = page_size
        self.policy = policy or CascadePolicy()
        self.replans = 0
        # job -> (context pages, own copy of its table, visible pages if a candidate else -1)
        self._seen: dict[int, tuple[int, list[int], int]] = {}
        self._holders: dict[int, int] = {}  # page -> candidates whose visible pages hold it
        self._order: list[int] = []
        self._plan: CascadePlan | None = None
        self._valid = False

    def plan(self, slices: Sequence[SequenceSlice]) -> CascadePlan | None:
        """The plan of a step of decodes: always equal to ``plan_shared_prefixes`` over the
        slices' page tables and context lengths (``start_pos + 1``), each a query of one
        token. None as well when a slice is not a decode of one token (no drafts).

        slices: the step's slices; a job in a later step is the same sequence, its table
            grown, shrunk or rewritten. A step repeating a job is planned from scratch.
        """
        seen, page_size = self._seen, self.page_size
        get = seen.get
        job_ids: list[int] = []
        add_job = job_ids.append
        changed: list[tuple[SequenceSlice, int]] = []
        for piece in slices:  # the one pass every step makes: keep it lean
            if len(piece.token_ids) != 1 or piece.draft_ids:
                return None
            job = piece.job_id
            add_job(job)
            pages = (piece.start_pos + 1) // page_size
            entry = get(job)
            if entry is None or entry[0] != pages or entry[1] != piece.page_table:
                changed.append((piece, pages))
        kept = self._valid
        for piece, pages in changed:
            kept = self._record(piece.job_id, piece.page_table, pages) and kept
        if len(seen) != len(job_ids):  # jobs left (or one came twice)
            for job in seen.keys() - set(job_ids):
                kept = self._forget(job) and kept
        same_order = job_ids == self._order
        if len(seen) != len(job_ids):  # a job twice in the step: its entries mean nothing
            self.reset()
            self.replans += 1
            return self._plan_from_scratch(slices)
        if not kept:
            self.replans += 1
            plan = self._plan_from_scratch(slices)
        elif same_order:
            plan = self._plan
        else:
            plan = self._renumbered(job_ids)
        self._order, self._plan, self._valid = job_ids, plan, True
        return plan

    def reset(self) -> None:
        """Forget every step seen (the next one is planned from scratch)."""
        self._seen.clear()
        self._holders.clear()
        self._order = []
        self._plan, self._valid = None, False

    def _plan_from_scratch(self, slices: Sequence[SequenceSlice]) -> CascadePlan | None:
        return plan_shared_prefixes([piece.page_table for piece in slices],
                                    [piece.start_pos + 1 for piece in slices],
                                    [1] * len(slices), self.page_size, self.policy)

    def _record(self, job: int, table: Sequence[int], pages: int) -> bool:
        """Store a job's changed table or page count; True when no common prefix changed."""
        entry = self._seen.get(job)
        visible = min(pages, len(table))
        new = visible if pages >= self.policy.min_prefix_pages and visible > 0 else -1
        old, old_table = (entry[2], entry[1]) if entry is not None else (-1, [])
        kept = True
        if old >= 0 and new >= old and table[:old] == old_table[:old]:
            if new > old:  # grown: its first new page must be nobody else's
                self._hold(table[old:new])
                kept = self._holders[table[old]] == 1
        else:  # left the candidates, joined them, or rewritten: as leaving, then joining
            if old >= 0:
                self._release(old_table[:old])
                kept = self._holders.get(old_table[0], 0) == 0
            if new >= 0:
                self._hold(table[:new])
                kept = self._holders[table[0]] == 1 and kept
        self._seen[job] = (pages, list(table), new)
        return kept

    def _forget(self, job: int) -> bool:
        """Drop a job that left; True when it shared no first page with a candidate."""
        _, table, visible = self._seen.pop(job)
        if visible < 0:
            return True
        self._release(table[:visible])
        return self._holders.get(table[0], 0) == 0

    def _hold(self, pages: Sequence[int]) -> None:
        holders = self._holders
        for page in pages:
            holders[page] = holders.get(page, 0) + 1

    def _release(self, pages: Sequence[int]) -> None:
        holders = self._holders
        for page in pages:
            left = holders[page] - 1
            if left:
                holders[page] = left
            else:
                del holders[page]

    def _renumbered(self, job_ids: Sequence[int]) -> CascadePlan | None:
        """The previous plan's groups (the same jobs) at the jobs' places in this step."""
        previous = self._plan
        if previous is None:
            return None
        index = {job: i for i, job in enumerate(job_ids)}
        order = self._order
        groups = [PrefixGroup(tuple(sorted(index[order[m]] for m in group.members)),
                              group.prefix_pages) for group in previous.groups]
        groups.sort(key=lambda group: group.members[0])
        return CascadePlan(tuple(groups), previous.page_size)


__all__ = ["SharedPrefixTracker"]
