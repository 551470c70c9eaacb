"""`NgramDrafter`: jobs that begin with the same full pages share one index of them, and
sharing never changes a draft."""

from __future__ import annotations

import random

from dyngen_core.engine.speculation import NgramIndex
from dyngen_core.runtime.drafters import DraftRequest, NgramDrafter

PAGE = 8


def ask(job_id: int, history: list[int], pages: list[int], length: int = 4) -> DraftRequest:
    return DraftRequest(job_id, history, pages, length)


def alone(history: list[int], length: int = 4) -> list[int]:
    """What an index of the whole history proposes."""
    index = NgramIndex()
    index.sync(history)
    return index.propose(history, length)


def test_jobs_on_one_document_share_its_index_and_draft_as_if_alone():
    rng = random.Random(0)
    document = [rng.randrange(30) for _ in range(3 * PAGE)]  # three full pages
    drafter = NgramDrafter(page_size=PAGE)
    histories = {job: document + [rng.randrange(30) for _ in range(3)] for job in range(4)}
    # Deduplicated: the document's pages have the same ids in every page table.
    tables = {job: [10, 11, 12, 20 + job] for job in histories}
    for _ in range(12):
        asks = [ask(job, history, tables[job]) for job, history in histories.items()]
        drafts = drafter.draft(asks)
        assert [d.tokens for d in drafts] == [alone(h) for h in histories.values()]
        for history in histories.values():
            history += [rng.randrange(30) for _ in range(rng.randint(1, 3))]
    assert drafter.shared_prefixes() == (1, 1)
    for job in histories:
        drafter.forget(job)
    assert drafter.shared_prefixes() == (0, 0)


def test_a_reused_page_id_with_other_tokens_is_not_shared():
    """Page ids freed and reused hold other tokens: a job is matched by content too."""
    first = list(range(PAGE)) + [1, 2]
    other = list(range(100, 100 + PAGE)) + [1, 2]
    drafter = NgramDrafter(page_size=PAGE)
    drafter.draft([ask(0, first, [5, 6])])
    assert [d.tokens for d in drafter.draft([ask(1, other, [5, 7])])] == [alone(other)]
    assert drafter.shared_prefixes() == (2, 0)  # two prefixes, neither shared


def test_jobs_share_the_pages_they_have_in_common_whatever_follows():
    """Questions longer than the document's last partial page fill full pages of their own:
    the jobs still share the document's pages (the longest run of leading pages in common)."""
    rng = random.Random(1)
    document = [rng.randrange(50) for _ in range(2 * PAGE)]
    drafter = NgramDrafter(page_size=PAGE)

    def question(length: int) -> list[int]:
        return document + [rng.randrange(50) for _ in range(length)]

    first = question(PAGE + 2)  # a third full page of its own
    assert [d.tokens for d in drafter.draft([ask(0, first, [1, 2, 3, 4])])] == [alone(first)]
    assert drafter.shared_prefixes() == (1, 0)  # pages 1, 2, 3 known, not shared yet
    second = question(2)
    assert [d.tokens for d in drafter.draft([ask(1, second, [1, 2, 9])])] == [alone(second)]
    assert drafter.shared_prefixes() == (2, 1)  # pages 1, 2 shared by jobs 0 and 1
    third = question(PAGE + 3)
    assert [d.tokens for d in drafter.draft([ask(2, third, [1, 2, 10, 11])])] == [alone(third)]
    assert drafter.shared_prefixes() == (2, 1)  # job 2 extends the same two pages
    drafter.forget(1)
    assert drafter.shared_prefixes() == (2, 1)  # still used by job 2
    drafter.forget(2)
    assert drafter.shared_prefixes() == (1, 0)
    drafter.forget(0)
    assert drafter.shared_prefixes() == (0, 0)
