"""Defragmentation planner: a pure function from the page layout to a list of page moves.

Target layout: the pages of the running jobs' page tables, in job order and then page-table
order (a page shared by several jobs goes where it first appears), take ids ``0, 1, 2, ...``;
cached pages follow, keeping their id when it already lies in the cached range and filling the
gaps otherwise; free pages end up at the top.

Why: a job whose pages are consecutive ascending ids is one long run of memory, so paged
attention streams it without jumping around and gather-based backends can read slices instead of
gathering; keeping used pages low leaves the free pages in one block. The gain is modest and each
move copies one whole page in every layer, so a plan is made only when both hold:
- fragmentation — breaks in the running page tables (neighbours that are not consecutive ids)
  plus used pages lying above the used range — is at least ``min_fraction`` of the used pages;
- the moves fit in ``max_moves`` (default: 1/16 of the cache). Many running jobs that grew in
  step with one another interleave their pages completely; reordering them would copy the whole
  cache, so that layout is left alone until jobs finish and the rest is cheap to compact.
Cycles in the permutation go through a temporary page, which needs at least one free page; with
none, nothing is planned.

The caller (the scheduler) relabels the pool and the page tables with ``mapping`` and hands the
copies to the runner, which executes them in order before the next forward.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import pairwise

from dyngen_core.engine.plan import PageCopy

DEFAULT_MIN_FRACTION = 0.25
MOVES_FRACTION_OF_CACHE = 1 / 16
MIN_USED_PAGES = 4


@dataclass(frozen=True)
class DefragPlan:
    """copies: whole-page copies to run in order. mapping: old id -> new id of every moved page."""

    copies: list[PageCopy]
    mapping: dict[int, int]


def fragmentation(page_tables: Sequence[Sequence[int]], cached_pages: Sequence[int]) -> int:
    """Breaks in the page tables plus used pages above the used range (see module docstring)."""
    referenced = _referenced_order(page_tables)
    used = len(referenced) + len(cached_pages)
    breaks = sum(1 for a, b in pairwise(referenced) if b != a + 1)
    breaks += 1 if referenced and referenced[0] != 0 else 0
    above = sum(1 for p in referenced if p >= used) + sum(1 for p in cached_pages if p >= used)
    return breaks + above


def plan_defrag(page_tables: Sequence[Sequence[int]], cached_pages: Sequence[int],
                num_pages: int, page_size: int, *,
                min_fraction: float = DEFAULT_MIN_FRACTION,
                max_moves: int | None = None) -> DefragPlan | None:
    """Plan the moves that compact and order the used pages, or None when not worth it.

    page_tables: the running jobs' page tables, oldest job first.
    cached_pages: unreferenced pages holding data (any order).
    num_pages, page_size: the cache's shape (copies move ``page_size`` slots).
    min_fraction: run only when fragmentation >= this fraction of the used pages.
    max_moves: most pages moved in one plan (None: 1/16 of the cache, at least MIN_USED_PAGES);
        a layout needing more is left alone.
    """
    referenced = _referenced_order(page_tables)
    used = len(referenced) + len(cached_pages)
    if used < MIN_USED_PAGES or used >= num_pages:
        return None
    if fragmentation(page_tables, cached_pages) < min_fraction * used:
        return None
    mapping = _target_mapping(referenced, cached_pages)
    if max_moves is None:
        max_moves = max(MIN_USED_PAGES, int(num_pages * MOVES_FRACTION_OF_CACHE))
    if len(mapping) > max_moves:
        return None
    copies = _copies_for(mapping, temp_page=used, page_size=page_size)
    return DefragPlan(copies=copies, mapping=mapping)


def _referenced_order(page_tables: Sequence[Sequence[int]]) -> list[int]:
    seen: dict[int, None] = {}
    for table in page_tables:
        for page in table:
            seen.setdefault(page, None)
    return list(seen)


def _target_mapping(referenced: list[int], cached: Sequence[int]) -> dict[int, int]:
    """old -> new for every used page that moves."""
    mapping = {page: new for new, page in enumerate(referenced) if page != new}
    first_cached, used = len(referenced), len(referenced) + len(cached)
    staying = {p for p in cached if first_cached <= p < used}
    holes = iter(sorted(set(range(first_cached, used)) - staying))
    for page in cached:
        if page not in staying:
            mapping[page] = next(holes)
    return mapping


def _copies_for(mapping: dict[int, int], temp_page: int, page_size: int) -> list[PageCopy]:
    """Order the moves so no page is overwritten before it is read: chains that end in a
    vacated page run from their end; cycles rotate through ``temp_page`` (free once the chains
    have run, since every used page above the used range moved down)."""
    copies: list[PageCopy] = []
    targets = set(mapping.values())
    done: set[int] = set()
    for start in mapping:
        if start in targets:
            continue  # not the head of a chain
        chain = [start]
        while chain[-1] in mapping:
            chain.append(mapping[chain[-1]])
        for src, dst in reversed(list(pairwise(chain))):
            copies.append(PageCopy(src, dst, page_size))
        done.update(chain)
    for start in mapping:
        if start in done:
            continue
        cycle = [start]
        while mapping[cycle[-1]] != start:
            cycle.append(mapping[cycle[-1]])
        done.update(cycle)
        copies.append(PageCopy(cycle[-1], temp_page, page_size))
        for src, dst in reversed(list(pairwise(cycle))):
            copies.append(PageCopy(src, dst, page_size))
        copies.append(PageCopy(temp_page, start, page_size))
    return copies
