"""The torch-free parts of speculative decoding: the accept rule, the n-gram index, each job's
draft length and the step cost model."""

from __future__ import annotations

import random

import pytest

from dyngen_core.engine import ngram_native
from dyngen_core.engine.speculation import (
    DraftStats,
    NgramIndex,
    StepCostModel,
    accept_run,
    accept_sampled,
)


@pytest.fixture(params=["python", "compiled"])
def index_type(request):
    """Each n-gram index test runs on the Python index and on the compiled one
    (`engine.ngram_native`), which must answer the same."""
    if request.param == "python":
        return NgramIndex
    compiled = ngram_native.compiled_ngram()
    if compiled is None:
        pytest.skip("the compiled n-gram index cannot be built here (no C compiler)")
    return compiled.NgramIndex


def test_accept_run_keeps_drafts_while_they_equal_the_draws():
    assert accept_run([5, 6, 7], [5, 6, 7, 8]) == [5, 6, 7, 8]
    assert accept_run([5, 6, 7], [5, 9, 7, 8]) == [5, 9]
    assert accept_run([5, 6, 7], [4, 6, 7, 8]) == [4]
    assert accept_run([], [3]) == [3]
    with pytest.raises(ValueError, match="one token per draft plus one"):
        accept_run([1, 2], [1, 2])


def test_ngram_index_proposes_the_latest_continuation_of_the_longest_suffix(index_type):
    index = index_type(max_n=3, min_n=1)
    history = [1, 2, 3, 4, 9, 2, 3, 5, 1, 2, 3]
    index.sync(history)
    # "1 2 3" occurred at the start, followed by 4 9 2 ...
    assert index.propose(history, 3) == [4, 9, 2]
    # A continuation reaching the end of the history repeats its own proposal.
    loop = [7, 8, 7, 8, 7]
    index = index_type(max_n=2, min_n=1)
    index.sync(loop)
    assert index.propose(loop, 5) == [8, 7, 8, 7, 8]
    assert index_type().propose([1, 2, 3], 4) == []  # nothing repeats


def test_ngram_index_follows_appends_and_rewinds(index_type):
    index = index_type(max_n=2, min_n=2)
    history = [1, 2, 3]
    index.sync(history)
    assert index.propose(history, 2) == []
    history += [1, 2]
    index.sync(history)
    assert index.propose(history, 2) == [3, 1]
    del history[-2:]  # a rewind, then new tokens: the index starts over
    history += [5, 3, 1]
    index.sync(history)
    assert index.propose(history, 1) == []  # "3 1" (stale: followed by 2) never occurred
    with pytest.raises(ValueError, match="min_n"):
        index_type(max_n=1, min_n=2)


def latest_continuation(history: list[int], k: int, max_n: int, min_n: int) -> list[int]:
    """What `NgramIndex.propose` must answer, by scanning: the continuation of the latest
    earlier occurrence of the longest suffix (``max_n`` down to ``min_n`` tokens)."""
    length = len(history)
    for n in range(min(max_n, length), min_n - 1, -1):
        for end in range(length - 1, n - 1, -1):
            if history[end - n:end] == history[length - n:]:
                out: list[int] = []
                for j in range(end, end + k):
                    out.append(history[j] if j < length else out[j - length])
                return out
    return []


@pytest.mark.parametrize("max_n,min_n", [(4, 1), (3, 2), (1, 1), (5, 3)])
def test_ngram_index_synced_step_by_step_matches_a_scan(index_type, max_n, min_n):
    """Appends of one or more tokens and rewinds (as deep as `NgramIndex.TAIL`, then new
    tokens) between syncs: every proposal equals the scan's."""
    if index_type is not NgramIndex and max_n > ngram_native.MAX_N:
        with pytest.raises(ValueError, match="at most"):
            index_type(max_n=max_n, min_n=min_n)
        return
    rng = random.Random(max_n * 10 + min_n)
    vocab = 4  # few tokens: suffixes recur, continuations run into the end
    for _ in range(20):
        index = index_type(max_n=max_n, min_n=min_n)
        history = [rng.randrange(vocab) for _ in range(rng.randrange(0, 6))]
        for _ in range(40):
            if history and rng.random() < 0.2:
                del history[-rng.randint(1, min(NgramIndex.TAIL, len(history))):]
            history += [rng.randrange(vocab) for _ in range(rng.randint(0, 4))]
            index.sync(history)
            k = rng.randint(0, 6)
            assert index.propose(history, k) == latest_continuation(history, k, max_n, min_n)


def base_answers(base, prefix: list[int]) -> tuple[int, list[list[int]]]:
    """What a base index answers for its tokens (unchanged while it is shared)."""
    return base.indexed, [base.propose(prefix, k) for k in range(1, 7)]


@pytest.mark.parametrize("max_n,min_n", [(4, 1), (3, 2), (1, 1)])
def test_an_index_extending_a_base_proposes_what_a_whole_index_proposes(index_type, max_n,
                                                                        min_n):
    """An index over a base (an index of the history's first tokens, shared) proposes the
    scan's drafts through appends and rewinds, including rewinds into the base's tokens (then
    it indexes the whole history itself); the base is never changed."""
    rng = random.Random(max_n * 7 + min_n)
    vocab = 4
    for _ in range(20):
        prefix = [rng.randrange(vocab) for _ in range(rng.randrange(1, 12))]
        base = index_type(max_n=max_n, min_n=min_n)
        base.sync(prefix)
        snapshot = base_answers(base, prefix)
        index = index_type(max_n=max_n, min_n=min_n, base=base)
        assert index.indexed == len(prefix)
        history = list(prefix)
        for _ in range(30):
            if rng.random() < 0.15:
                del history[-rng.randint(1, min(NgramIndex.TAIL, len(history))):]
            history += [rng.randrange(vocab) for _ in range(rng.randint(0, 3))]
            index.sync(history)
            k = rng.randint(0, 6)
            assert index.propose(history, k) == latest_continuation(history, k, max_n, min_n)
        assert base_answers(base, prefix) == snapshot
    with pytest.raises(ValueError, match="same n-gram sizes"):
        index_type(max_n=3, min_n=1, base=index_type(max_n=4, min_n=1))


def test_ngram_index_rejects_token_ids_outside_its_range(index_type):
    index = index_type()
    with pytest.raises(ValueError, match="outside the n-gram index's range"):
        index.sync([1, 2, -1])
    with pytest.raises(ValueError, match="outside the n-gram index's range"):
        index.sync([1, 2 ** NgramIndex.TOKEN_BITS])
    history = [1, 2, 1]
    index.sync(history)  # a failed sync leaves nothing half indexed
    assert index.propose(history, 2) == [2, 1]


def test_draft_length_follows_acceptance_and_probes_when_drafts_fail():
    good = DraftStats()
    assert good.length(8, threshold=0.05, step=0) > 0
    for _ in range(12):
        good.record(proposed=4, accepted=4)
    assert good.length(8, threshold=0.05, step=1) == 8
    before = good.alpha
    good.record(proposed=8, accepted=1)
    assert good.alpha < before
    stats = DraftStats()  # a drafter that is always wrong
    for _ in range(12):
        stats.record(proposed=2, accepted=0)
    assert stats.alpha < 0.05
    interval = DraftStats.PROBE_INTERVAL
    lengths = [stats.length(8, threshold=0.05, step=s) for s in range(1, 3 * interval + 1)]
    assert lengths.count(1) == 3 and lengths.count(0) == len(lengths) - 3
    # Steps it was not asked about count too: a probe is due at the first ask after 16 steps.
    assert stats.length(8, threshold=0.05, step=10 * DraftStats.PROBE_INTERVAL) == 1
    assert stats.length(0, threshold=0.0, step=100 * DraftStats.PROBE_INTERVAL) == 0


def test_failed_probes_back_off_and_an_accepted_one_resets_the_interval():
    stats = DraftStats()
    for _ in range(12):
        stats.record(proposed=2, accepted=0)
    probes = []
    # A cheap probe (threshold 0.1: its cost stays within the budget every 10 steps): the
    # interval alone spaces the probes.
    for step in range(1, 1200):
        if stats.length(8, threshold=0.1, step=step):
            probes.append(step)
            stats.record(proposed=1, accepted=0)
    gaps = [b - a for a, b in zip(probes, probes[1:], strict=False)]
    assert gaps[:5] == [32, 64, 128, 256, 256]  # doubling from 16, capped
    assert stats.probe_interval == DraftStats.MAX_PROBE_INTERVAL
    step = probes[-1] + stats.probe_interval
    assert stats.length(8, threshold=0.1, step=step) == 1
    stats.record(proposed=1, accepted=1)
    assert stats.probe_interval == DraftStats.PROBE_INTERVAL
    # A draft offered because it pays is no probe: its outcome leaves the interval alone.
    stats.record(proposed=3, accepted=0)
    assert stats.probe_interval == DraftStats.PROBE_INTERVAL


def test_offers_the_drafter_misses_stop_drafting_until_a_probe_finds_one():
    """A drafter with nothing to offer (an n-gram lookup that finds no earlier occurrence) is
    asked `MAX_MISSES` times, then only probed, at multiples of `PROBE_INTERVAL`, backing off
    while probes miss; a draft found resets the count."""
    stats = DraftStats()
    for step in range(1, DraftStats.MAX_MISSES + 1):
        assert stats.pays(0.05) and stats.length(4, threshold=0.05, step=step) == 4
        stats.miss()
    assert not stats.pays(0.05)
    # The last offer was at step 8: the first probe is at the first multiple of 16 after 24.
    step = DraftStats.MAX_MISSES + 1
    while not stats.length(4, threshold=0.05, step=step):
        step += 1
    assert step == 2 * DraftStats.PROBE_INTERVAL and stats.probing
    stats.miss()  # the probe missed: the interval doubles, the next probe is aligned too
    assert stats.probe_interval == 2 * DraftStats.PROBE_INTERVAL
    assert stats.next_probe(0.05) == 4 * DraftStats.PROBE_INTERVAL
    assert stats.length(4, threshold=0.05, step=stats.next_probe(0.05)) == 1
    stats.record(proposed=1, accepted=1)  # the probe found a draft, and it was accepted
    assert stats.misses == 0 and stats.probe_interval == DraftStats.PROBE_INTERVAL
    assert stats.pays(0.05)


def test_probes_of_all_jobs_fall_on_the_same_steps():
    """Jobs whose last offers were at different steps probe at the same multiples of
    `PROBE_INTERVAL`: the steps before probes, which give up overlap, are few."""
    due = set()
    for last in range(1, 40):
        stats = DraftStats(last_offer=last)
        stats.misses = DraftStats.MAX_MISSES
        due.add(stats.next_probe(0.05))
        assert stats.next_probe(0.05) % DraftStats.PROBE_INTERVAL == 0
        assert stats.next_probe(0.05) >= last + DraftStats.PROBE_INTERVAL
    assert due == {32, 48, 64}


@pytest.mark.parametrize("threshold", [0.5, 1.0, 3.0, 40.0])
def test_probes_are_spaced_to_cost_at_most_their_budget(threshold):
    """A probe costs ``threshold - alpha`` produced tokens (a draft token's cost, less what
    an accepted one makes): a job probes at most once in the steps over which that is
    `PROBE_BUDGET` of its tokens, up to `MAX_PROBE_WAIT` (so that a cost measured once too
    high is measured again)."""
    stats = DraftStats()
    for _ in range(12):
        stats.record(proposed=2, accepted=0)  # an always-wrong drafter
    cost = threshold - stats.alpha  # the most a failed probe lowers alpha to costs more
    wait = min(cost / DraftStats.PROBE_BUDGET, DraftStats.MAX_PROBE_WAIT)
    probes = [step for step in range(1, 8000) if stats.length(4, threshold, step)]
    gaps = [b - a for a, b in zip(probes, probes[1:], strict=False)]
    assert len(gaps) >= 3 and min(gaps) >= max(wait, 2 * DraftStats.PROBE_INTERVAL)
    assert max(gaps) <= max(threshold / DraftStats.PROBE_BUDGET + DraftStats.PROBE_INTERVAL,
                            DraftStats.MAX_PROBE_INTERVAL)
    if wait < DraftStats.MAX_PROBE_WAIT:  # the probes cost at most the budget
        assert len(gaps) * cost / (probes[-1] - probes[0]) <= DraftStats.PROBE_BUDGET
    # A job whose drafts almost pay probes as often as the interval allows.
    assert DraftStats(prior=0.5).next_probe(0.55) == DraftStats.PROBE_INTERVAL


def test_step_cost_model_fits_fixed_and_per_token_costs():
    model = StepCostModel(decay=1.0)
    assert model.ratio() == model.prior_ratio
    for tokens in (1, 2, 8, 32, 64) * 3:
        model.record(tokens, 0.010 + 0.0005 * tokens)  # fixed cost = 20 tokens' worth
    assert model.ratio() == pytest.approx(20.0, rel=1e-6)
    # A draft token pays when it survives more often than batch / (ratio + batch), and at
    # least MIN_SURVIVAL of the time (it also costs the next step's overlap).
    assert model.threshold(5) == pytest.approx(5 / 25)
    assert model.threshold(60) == pytest.approx(60 / 80)
    assert model.threshold(1) == StepCostModel.MIN_SURVIVAL  # 1 / 21 by the fit
    assert model.threshold(1, drafter_ratio=0.5) == pytest.approx(1 / 21 + 0.5)
    # Above 1 no draft pays, and the threshold is what a one-token probe costs.
    assert model.threshold(1000, drafter_ratio=0.5) == pytest.approx(1000 / 1020 + 0.5)


def test_accept_sampled_keeps_accepted_drafts_then_one_replacement():
    assert accept_sampled([5, 6], [True, True], [1, 2, 3]) == [5, 6, 3]
    assert accept_sampled([5, 6], [True, False], [1, 2, 3]) == [5, 2]
    assert accept_sampled([5, 6], [False, True], [1, 2, 3]) == [1]
    with pytest.raises(ValueError, match="one replacement"):
        accept_sampled([5], [True], [1])
