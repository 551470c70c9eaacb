"""Host planning of shared-prefix ("cascade") decode attention: which decodes share pages, and
the same plan across steps without planning again.

Prefix dedup gives sequences that share a prompt prefix the same page ids at the same leading
positions of their page tables. A cascade attends all query rows of such a group to the shared
pages in one pass (each shared key and value read once per group instead of once per member),
attends each member's own remainder separately, and merges the two by log-sum-exp.

`plan_shared_prefixes` finds the groups from host lists alone (no tensors, no device syncs) and
returns None when no cascade pays, so a step without sharing costs one dictionary pass. Only
decodes (query length 1) are grouped, and a shared prefix is whole pages that every member sees
entirely: a member at context length ``ctx`` (its query at position ``ctx - 1``) can share at most
``ctx // page_size`` pages.

Grouping: decodes are bucketed by their first page. Within a bucket, the pages all members
share are measured against one member's table (one slice comparison per member); the members
then either form one group over those pages, or split by the page that follows into subsets
planned the same way (a walk down the compressed trie of the tables), whichever saves more key
reads. A sequence is in at most one group (no nested cascades).

Across steps (`SharedPrefixTracker`): the planner reads the decodes' page tables only as far as
each context covers whole pages (its "visible" pages, for sequences long enough to be grouped:
the candidates), and from those only their pairwise common prefixes: two candidates fall in the
same subset of a level exactly when their common prefix reaches past it, and a level's shared
length is the shortest common prefix of its members. The plan, read as groups of jobs, is
therefore a function of the candidates and of the lengths of their pairwise common prefixes.
A step rarely changes one of those lengths: a common prefix changes only if the page a sequence
gains is also in another candidate's visible pages (the other table must hold it right there),
or if the first page of a sequence that comes or goes is (else all its common prefixes are
empty). The tracker keeps, per job, the table and page count it saw last and, per page, how
many candidates' visible pages hold it; a step whose changes all pass these checks reuses the
previous plan (its members renumbered when the batch order changed). Any other change (a shared
page gained or lost, a job sharing pages coming or going, copy-on-write, preemption,
defragmentation relabelling pages, a table rewritten in any way) plans the step from scratch, so
the plan is always exactly what `plan_shared_prefixes` returns for it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from operator import itemgetter

from dyngen_core.engine.pages import common_prefix_len
from dyngen_core.engine.plan import SequenceSlice

# Levels of sharing walked below a first page (system prompt, document, examples...: real
# prompts have a few); past it a level's members form one group. Bounds planning to about
# MAX_LEVELS slice comparisons per decode even for tables that part at every page.
MAX_LEVELS = 8


@dataclass(frozen=True)
class CascadePolicy:
    """When a shared prefix is worth a cascade.

    min_members: fewest decodes in a group (2: any sharing saves reads).
    min_prefix_pages: fewest shared pages in a group (1: a page of 256 keys is 16x the partial
        results a member's rows add per split, so even one page saves traffic in the kernels).
    min_saved_keys: fewest key reads per KV head and layer the whole plan must save, summed over
        groups as ``(members - 1) * prefix_tokens``, or the step plans no cascade. The cascade
        runs inside the decode CUDA graphs, so what it must win back is GPU time only: its
        extra launch per layer and the own keys' partials. The default, 32,768 keys (e.g. 2
        sequences sharing 128 pages, or 9 sharing 16), clears that cost with room for models
        with fewer KV heads (see BENCHMARKS.md, "3. Shared document").
    """

    min_members: int = 2
    min_prefix_pages: int = 1
    min_saved_keys: int = 32_768

    def __post_init__(self) -> None:
        if self.min_members < 2:
            raise ValueError(f"min_members must be at least 2 (a group shares between "
                             f"sequences); got {self.min_members}")
        if self.min_prefix_pages < 1:
            raise ValueError(f"min_prefix_pages must be at least 1; got {self.min_prefix_pages}")
        if self.min_saved_keys < 0:
            raise ValueError(f"min_saved_keys must be >= 0; got {self.min_saved_keys}")


@dataclass(frozen=True)
class PrefixGroup:
    """Decodes whose page tables begin with the same ``prefix_pages`` page ids.

    members: the sequences' indices in the batch (at least two, each in one group only).
    prefix_pages: the shared leading pages; each member's context covers all of them.
    """

    members: tuple[int, ...]
    prefix_pages: int

    def saved_keys(self, page_size: int) -> int:
        """Key reads (per KV head and layer) the group saves over attending member by member."""
        return (len(self.members) - 1) * self.prefix_pages * page_size


@dataclass(frozen=True)
class CascadePlan:
    """The groups of one step, and the page size their prefixes are counted in.

    groups: disjoint groups of decodes, each sharing its leading pages.
    page_size: slots per page.
    """

    groups: tuple[PrefixGroup, ...]
    page_size: int

    @property
    def saved_keys(self) -> int:
        """Key reads per KV head and layer the whole plan saves."""
        return sum(group.saved_keys(self.page_size) for group in self.groups)

    def kv_starts(self, num_seqs: int) -> list[int]:
        """Per sequence, where its own keys begin: its group's prefix tokens, else 0."""
        starts = [0] * num_seqs
        for group in self.groups:
            for member in group.members:
                starts[member] = group.prefix_pages * self.page_size
        return starts


def plan_shared_prefixes(page_tables: Sequence[Sequence[int]], context_lens: Sequence[int],
                         query_lens: Sequence[int], page_size: int,
                         policy: CascadePolicy | None = None) -> CascadePlan | None:
    """Groups of decodes sharing leading pages, or None when no cascade pays.

    page_tables: each sequence's page ids (at least its context's pages; more are ignored).
    context_lens: each sequence's context length once this step's tokens are written.
    query_lens: tokens each sequence feeds this step; only sequences feeding 1 are grouped.
    page_size: slots per page.
    policy: thresholds (default `CascadePolicy()`).
    """
    policy = policy or CascadePolicy()
    if len(page_tables) != len(context_lens) or len(context_lens) != len(query_lens):
        raise ValueError(f"{len(page_tables)} page tables, {len(context_lens)} context lengths "
                         f"and {len(query_lens)} query lengths: give one of each per sequence")
    min_context = policy.min_prefix_pages * page_size
    candidates = [index for index, (table, ctx, qlen)
                  in enumerate(zip(page_tables, context_lens, query_lens, strict=True))
                  if qlen == 1 and ctx >= min_context and table]
    firsts = [page_tables[index][0] for index in candidates]
    if len(set(firsts)) == len(firsts):
        return None  # no two decodes share even a first page (runs every step: keep it cheap)
    buckets: dict[int, list[int]] = {}
    for index, first in zip(candidates, firsts, strict=True):
        buckets.setdefault(first, []).append(index)
    groups: list[PrefixGroup] = []
    for members in buckets.values():
        if len(members) >= policy.min_members:
            visible = {i: min(context_lens[i] // page_size, len(page_tables[i])) for i in members}
            groups.extend(_best_groups(members, 1, page_tables, visible, policy)[1])
    if not groups:
        return None
    plan = CascadePlan(tuple(sorted(groups, key=lambda g: g.members[0])), page_size)
    return plan if plan.saved_keys >= policy.min_saved_keys else None


def _best_groups(members: list[int], depth: int, tables: Sequence[Sequence[int]],
                 visible: dict[int, int], policy: CascadePolicy,
                 levels_left: int = MAX_LEVELS) -> tuple[int, list[PrefixGroup]]:
    """The most saved pages among ``members`` (which all share their first ``depth`` pages) and
    the groups that save them: one group over all the pages every member shares, or the best
    groups of each subset that shares the next page too, whichever saves more.

    visible: each sequence's pages that its context covers whole.
    levels_left: how many more levels of the trie to walk before grouping what a level shares.
    """
    if len(members) < policy.min_members:
        return 0, []
    levels_left -= 1
    reference = tables[members[0]]
    shared = visible[members[0]]
    # Usually every member shares all of the first member's pages: checked in C loops (map,
    # count) before the member-by-member search for where some part.
    member_visible = list(map(visible.__getitem__, members))
    slices = map(itemgetter(slice(depth, shared)), map(tables.__getitem__, members))
    if min(member_visible) < shared or list(slices).count(reference[depth:shared]) < len(members):
        for member in members[1:]:
            table = tables[member]
            limit = min(shared, visible[member])
            if limit < shared or table[depth:shared] != reference[depth:shared]:
                shared = _common_length(table, reference, depth, limit)
    whole = (len(members) - 1) * shared if shared >= policy.min_prefix_pages else 0
    deeper: dict[int, list[int]] = {}
    if levels_left > 0 and max(member_visible) > shared:
        for member in members:
            if visible[member] > shared:
                deeper.setdefault(tables[member][shared], []).append(member)
    split_saved, split = 0, []
    min_members = policy.min_members
    for subset in deeper.values():
        if len(subset) >= min_members:  # most subsets are one sequence's own pages
            saved, groups = _best_groups(subset, shared + 1, tables, visible, policy,
                                         levels_left)
            split_saved += saved
            split += groups
    if whole > 0 and whole >= split_saved:
        return whole, [PrefixGroup(tuple(members), shared)]
    return split_saved, split


def _common_length(a: Sequence[int], b: Sequence[int], lo: int, hi: int) -> int:
    """How many leading page ids ``a`` and ``b`` share, knowing the first ``lo`` agree and
    looking no further than ``hi``. Tables sharing a prefix usually part near their ends, so
    the search gallops back from ``hi`` (1, 2, 4... pages) before the pool's bisection; each
    step is a slice comparison, which runs in C."""
    if a[lo:hi] == b[lo:hi]:
        return hi
    step = 1
    while True:  # invariant: the first lo ids agree, the first hi do not
        below = max(lo, hi - step)
        if below == lo or a[lo:below] == b[lo:below]:
            lo = below
            break
        hi, step = below, step * 2
    return common_prefix_len(a, b, lo, hi)


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
        # job -> (context pages, its table's list, visible pages if a candidate else -1): the
        # slice's own list, which plans never change in place (`SequenceSlice`), so a job's
        # unchanged table is seen by identity (the scheduler hands a job's decodes one list).
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
            grown, shrunk or rewritten (in a new list: a slice's list is never changed once
            passed here). A step repeating a job is planned from scratch.
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
            if entry is None or entry[0] != pages or (entry[1] is not piece.page_table
                                                      and entry[1] != piece.page_table):
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

    def _record(self, job: int, table: list[int], pages: int) -> bool:
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
        self._seen[job] = (pages, table, new)
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


__all__ = ["CascadePlan", "CascadePolicy", "PrefixGroup", "SharedPrefixTracker",
           "plan_shared_prefixes"]
