"""Scheduler behaviour, driven by a fake runner whose KV store is checked after every step."""

from __future__ import annotations

import random

import pytest

from dyngen_core.config import CacheConfig, SchedulerConfig
from dyngen_core.engine.plan import StepOutcome
from dyngen_core.engine.scheduler import Scheduler
from dyngen_core.engine.sequence import SequenceStatus
from dyngen_core.errors import JobError, JobTooLargeError
from tests.unit.fake_engine import FakeEngine, true_continuation

PS = 32


def engine(pages: int, page_size: int = PS, **config) -> FakeEngine:
    cache = CacheConfig(max_tokens=pages * page_size, page_size=page_size)
    return FakeEngine(Scheduler(cache, SchedulerConfig(**config)))


def tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(50) for _ in range(n)]


def solo_outputs(jobs: dict[int, tuple[list[int], int]]) -> dict[int, list[int]]:
    return {j: true_continuation(p, n) for j, (p, n) in jobs.items()}


def status(e: FakeEngine, job: int) -> SequenceStatus | None:
    seq = e.s.sequence(job)
    return None if seq is None else seq.status


def test_fifo_admission_and_max_batch_size() -> None:
    e = engine(64, max_batch_size=2)
    for j in range(4):
        e.add(j, tokens(10, j), 5)
    plan = e.step()
    assert [s.job_id for s in plan.slices] == [0, 1]
    assert e.s.num_running == 2 and e.s.num_waiting == 2
    e.s.finish(0)
    plan = e.step()
    assert [s.job_id for s in plan.slices] == [1, 2]  # 1 decodes, 2 is admitted next in order


def test_chunked_prefill_budget_shared_across_jobs() -> None:
    e = engine(64, max_chunk_size=100)
    e.add(0, tokens(250, 0), 3)
    e.add(1, tokens(30, 1), 3)
    chunks = []
    for _ in range(3):
        plan = e.step()
        chunks.append([(s.job_id, len(s.token_ids), s.sample) for s in plan.slices])
    assert chunks[0] == [(0, 100, False)]
    assert chunks[1] == [(0, 100, False)]
    assert chunks[2] == [(0, 50, True), (1, 30, True)]  # last chunk samples; job 1 fits beside
    assert sum(n for _, n, _ in chunks[2]) <= 100


def test_decode_and_prefill_in_one_plan_with_on_demand_pages() -> None:
    e = engine(64)
    e.add(0, tokens(40, 0), 200)
    e.step()
    assert len(e.s.sequence(0).page_table) == 2  # 40 tokens: two pages, not 240 tokens' worth
    e.add(1, tokens(20, 1), 5)
    plan = e.step()
    decode, prefill = plan.slices
    assert (decode.job_id, decode.token_ids, decode.start_pos, decode.sample) == (
        0, [e.s.sequence(0).token_ids[40]], 40, True)
    assert (prefill.job_id, len(prefill.token_ids), prefill.is_prefill) == (1, 20, True)
    for _ in range(24):
        e.step()
    assert len(e.s.sequence(0).page_table) == 3  # grew only when position 64 was written


def test_preempts_newest_and_recomputes_from_cache() -> None:
    jobs = {j: (tokens(60, j), 150) for j in range(2)} | {2: (tokens(200, 2), 5)}
    e = engine(10)  # 320 slots: two jobs of 210 tokens cannot both stay; job 2 waits
    for j, (prompt, n) in jobs.items():
        e.add(j, prompt, n)
    preempted_at = None
    for step in range(400):
        e.step()
        if status(e, 1) is SequenceStatus.WAITING:
            preempted_at = step
            break
    assert preempted_at is not None and status(e, 0) is SequenceStatus.RUNNING
    assert [seq.job_id for seq in e.s._waiting] == [1, 2]  # back at the front of the queue
    assert e.s.stats().preemptions == 1
    assert e.s.sequence(1).num_computed == 0 and not e.s.sequence(1).page_table
    reused_before = e.s.stats().prefill_tokens_reused
    outputs = e.run_until_done({j: n for j, (_, n) in jobs.items()})
    assert e.s.stats().prefill_tokens_reused - reused_before >= 3 * PS  # its prefix pages hit
    assert outputs == solo_outputs(jobs)


def test_fairness_blocks_small_jobs_behind_a_skipped_big_one() -> None:
    e = engine(10, max_skips=2)
    e.add(0, tokens(200, 0), 30)  # 7 pages running
    e.step()
    e.add(1, tokens(150, 1), 10)  # needs 5 pages: does not fit yet
    admitted_small = 0
    for j in range(2, 12):
        e.add(j, tokens(8, j), 2)
        e.step()
        admitted_small += status(e, j) is not SequenceStatus.WAITING
        for k in range(2, j + 1):
            if status(e, k) is SequenceStatus.RUNNING and e.s.sequence(k).num_generated >= 2:
                e.s.finish(k)
        if status(e, 1) is not SequenceStatus.WAITING:
            break
    assert e.s._jobs[1].num_skips == 2
    assert admitted_small == 2  # two jobs overtook it, then admission waited for it
    results = e.run_until_done({j: 2 for j in e.generated if e.s.sequence(j)} | {0: 30, 1: 10})
    assert results[1] == true_continuation(tokens(150, 1), 10)


def test_job_too_large_error_names_pages_and_cache() -> None:
    e = engine(4)
    with pytest.raises(JobTooLargeError) as err:
        e.add(0, tokens(100, 0), 40, num_draft_tokens=4)
    text = str(err.value)
    assert "5 pages" in text and "4 pages" in text and "128 tokens" in text
    assert "larger cache" in text
    with pytest.raises(JobError, match="empty prompt"):
        e.add(1, [], 5)
    e.add(2, tokens(5, 2), 5)
    with pytest.raises(JobError, match="already"):
        e.add(2, tokens(5, 2), 5)


def test_dedup_of_shared_1024_token_prefix() -> None:
    e = engine(64, page_size=256)
    doc = tokens(1024, 99)
    jobs = {j: (doc + tokens(20, j), 8) for j in range(8)}
    for j, (prompt, n) in jobs.items():
        e.add(j, prompt, n)
    e.step()
    e.step()
    stats = e.s.stats()
    assert stats.jobs_active == 8
    assert stats.pages_referenced == 4 + 8  # prefix pages held once, one own page per job
    assert stats.prefill_tokens_computed == 1024 + 8 * 20  # the prefix computed once
    assert stats.prefill_tokens_reused == 7 * 1024
    tables = [e.s.sequence(j).page_table[:4] for j in jobs]
    assert all(t == tables[0] for t in tables)
    assert e.run_until_done({j: n for j, (_, n) in jobs.items()}) == solo_outputs(jobs)


def test_unaligned_shared_document_is_prefilled_once() -> None:
    e = engine(64, page_size=256)
    doc = tokens(1000, 42)  # three full pages, then 232 document tokens in the fourth
    jobs = {j: (doc + tokens(20, 1000 + j), 3) for j in range(16)}
    for j, (prompt, n) in jobs.items():
        e.add(j, prompt, n)
    e.step()
    assert e.s.num_waiting == 15  # they wait for the first job's pages rather than recompute
    plan = e.step()
    assert e.s.num_waiting == 0
    assert sorted(c.num_slots for c in plan.copies) == [232] * 15  # the document's tail, copied
    assert e.s.stats().prefill_tokens_computed == 1020 + 15 * 20
    assert e.run_until_done({j: n for j, (_, n) in jobs.items()}) == solo_outputs(jobs)


def test_dedup_off_computes_every_prompt() -> None:
    e = engine(64, page_size=256, dedup=False, max_chunk_size=4096)
    doc = tokens(1024, 99)
    for j in range(3):
        e.add(j, doc + tokens(20, j), 4)
    e.step()
    assert e.s.stats().prefill_tokens_computed == 3 * 1044
    assert e.s.stats().pages_referenced == 3 * 5


def test_prompt_cache_reuse_after_finish_and_switch_off() -> None:
    for prompt_cache, expect_reused in ((True, 96), (False, 0)):
        e = engine(16, prompt_cache=prompt_cache)
        prompt = tokens(100, 1)
        e.add(0, prompt, 4)
        e.run_until_done({0: 4})
        e.add(1, prompt + tokens(10, 2), 4)
        e.step()
        assert e.s.sequence(1).num_cached_tokens == expect_reused
        assert e.run_until_done({1: 4})[1] == true_continuation(prompt + tokens(10, 2), 4)


def test_full_prompt_hit_recomputes_only_the_last_token() -> None:
    e = engine(16)
    prompt = tokens(2 * PS, 3)
    e.add(0, prompt, 3)
    e.run_until_done({0: 3})
    e.add(1, prompt, 3)
    plan = e.step()
    (sl,) = plan.slices
    assert (sl.start_pos, sl.token_ids, sl.sample) == (2 * PS - 1, [prompt[-1]], True)
    assert [(c.num_slots) for c in plan.copies] == [PS - 1]  # the last page copied, not shared
    assert e.s.sequence(1).num_cached_tokens == 2 * PS - 1
    assert e.run_until_done({1: 3})[1] == true_continuation(prompt, 3)


def test_partial_page_copy_for_matching_leading_tokens() -> None:
    e = engine(16)
    first = tokens(PS + 25, 4)
    e.add(0, first, 2)
    e.run_until_done({0: 2})
    second = first[:PS + 20] + tokens(9, 5)
    e.add(1, second, 2)
    plan = e.step()
    (copy,) = plan.copies
    assert copy.num_slots == 20 and copy.dst == e.s.sequence(1).page_table[1]
    assert plan.slices[0].start_pos == PS + 20
    assert e.run_until_done({1: 2})[1] == true_continuation(second, 2)


def test_generated_pages_are_folded_into_identical_ones() -> None:
    e = engine(16)
    prompt = tokens(20, 6)
    e.add(0, prompt, 80)
    e.add(1, prompt, 80)
    for _ in range(60):
        e.step()
    t0, t1 = e.s.sequence(0).page_table, e.s.sequence(1).page_table
    assert t0[:2] == t1[:2]  # full pages (the second one all generated) are held once
    assert t0[2] != t1[2]  # the pages still being written are each job's own
    assert e.s.stats().pages_referenced == 4


def test_cancel_waiting_and_running_releases_pages() -> None:
    e = engine(16, max_batch_size=1)
    e.add(0, tokens(70, 0), 10)
    e.add(1, tokens(10, 1), 10)
    e.step()
    assert e.s.cancel(1) and e.s.num_waiting == 0
    assert e.s.cancel(0) and e.s.num_running == 0
    assert not e.s.cancel(0)
    assert e.s.stats().pages_referenced == 0
    e.s.check_invariant()


def test_rewind_drops_tokens_and_pages_then_regenerates() -> None:
    e = engine(16)
    prompt = tokens(30, 7)
    e.add(0, prompt, 40)
    for _ in range(10):
        e.step()
    seq = e.s.sequence(0)
    assert len(seq.page_table) == 2 and seq.num_generated == 10
    e.s.rewind(0, 8)
    seq = e.s.sequence(0)
    assert seq.num_tokens == 32 and seq.num_computed == 31 and len(seq.page_table) == 1
    e.s.check_invariant()
    assert e.run_until_done({0: 40})[0] == true_continuation(prompt, 40)


def test_rewind_into_a_shared_page_gives_it_up() -> None:
    e = engine(16)
    prompt = tokens(20, 6)
    e.add(0, prompt, 80)
    e.add(1, prompt, 80)
    for _ in range(60):
        e.step()
    shared = e.s.sequence(1).page_table[0]
    e.s.rewind(1, e.s.sequence(1).num_tokens - PS + 1)  # back into the shared first page
    seq = e.s.sequence(1)
    assert shared not in seq.page_table and seq.num_computed == 0
    assert e.s.pool.ref_count(shared) == 1
    assert e.run_until_done({0: 80, 1: 80}) == solo_outputs({0: (prompt, 80), 1: (prompt, 80)})


def test_defragment_compacts_and_moves_contents() -> None:
    e = engine(24, defrag=False)
    jobs = {j: (tokens(50, j), 40) for j in range(6)}
    for j, (prompt, n) in jobs.items():
        e.add(j, prompt, n)
    for _ in range(5):
        e.step()
    for j in (0, 2, 4):
        e.s.finish(j)
    for _ in range(20):
        e.step()
    assert e.s.defragment() == 0  # the default cap (1/16 of the cache) refuses this many moves
    moved = e.s.defragment(max_moves=24)
    assert moved > 0
    tables = [e.s.sequence(j).page_table for j in (1, 3, 5)]
    assert [p for t in tables for p in t] == list(range(sum(map(len, tables))))
    plan = e.step()  # the copies lead the next plan; verify() checks every slot after it
    assert len(plan.copies) >= moved
    survivors = {j: jobs[j] for j in (1, 3, 5)}
    assert e.run_until_done({j: n for j, (_, n) in survivors.items()}) == solo_outputs(survivors)
    e.add(10, jobs[0][0], 5)  # cached pages were moved too: the hit still reads right values
    e.step()
    assert e.s.sequence(10).num_cached_tokens > 0
    assert e.run_until_done({10: 5})[10] == true_continuation(jobs[0][0], 5)


def test_many_jobs_through_a_tiny_cache_match_solo_runs() -> None:
    jobs = {j: (tokens(5 + 7 * j % 40, j % 4), 12) for j in range(30)}
    e = engine(4, max_chunk_size=48)
    for j, (prompt, n) in jobs.items():
        e.add(j, prompt, n)
    assert e.run_until_done({j: n for j, (_, n) in jobs.items()}) == solo_outputs(jobs)


def test_drafts_accepted_in_part_keep_cache_consistent() -> None:
    def drafts(job: int, toks: list[int], n: int) -> list[int]:
        right = true_continuation(toks, n)
        return right[: n // 2] + [(t + 1) % 50 for t in right[n // 2:]]

    e = engine(16)
    e.drafts = drafts
    e.add(0, tokens(30, 8), 60, num_draft_tokens=4)
    results = e.run_until_done({0: 60})
    assert results[0] == true_continuation(tokens(30, 8), 60)


def test_apply_rejects_mismatched_outcomes() -> None:
    e = engine(8)
    e.add(0, tokens(10, 0), 5)
    plan = e.s.schedule()
    with pytest.raises(ValueError, match="no sampled tokens"):
        e.s.apply(plan, StepOutcome())
    plan = e.s.schedule()
    e.s.apply(plan, e.run(plan))
    with pytest.raises(RuntimeError, match="once, in order"):
        e.s.apply(plan, e.run(plan))


@pytest.mark.parametrize("dedup", [False, True])
def test_a_job_needing_the_whole_cache_skips_a_partial_copy_it_has_no_room_for(dedup) -> None:
    """A 129-token prompt needs all 5 pages; its first 16 tokens match a cached partial page.
    Copying them needs the source page alive beside 5 fresh ones: the job computes them
    instead of waiting forever (found by the state machine)."""
    e = engine(5, max_batch_size=1, max_chunk_size=8, dedup=dedup)
    document = tokens(129, 5)
    e.add(0, document[:16], 1)
    e.run_until_done({0: 1})
    e.add(1, document, 1)
    assert e.run_until_done({1: 1})[1] == true_continuation(document, 1)
