"""`PromptLookup`: batched prompt-lookup drafts, checked against a scan of each history."""

from __future__ import annotations

import random
from typing import NamedTuple

import pytest
import torch

from dyngen_core.runtime.prompt_lookup import PromptLookup


class Ask(NamedTuple):
    job_id: int
    history: list[int]
    length: int


def latest_continuation(history: list[int], k: int, max_n: int, min_n: int) -> list[int]:
    """What `PromptLookup.draft` must answer, by scanning: the continuation of the latest
    earlier occurrence of the longest suffix (``max_n`` down to ``min_n`` tokens), repeating
    with its period where it runs into the end."""
    length = len(history)
    if k <= 0:
        return []
    for n in range(min(max_n, length), min_n - 1, -1):
        for end in range(length - 1, n - 1, -1):
            if history[end - n:end] == history[length - n:]:
                out: list[int] = []
                for j in range(end, end + k):
                    out.append(history[j] if j < length else out[j - length])
                return out
    return []


def test_drafts_continue_the_latest_occurrence_of_the_longest_suffix():
    lookup = PromptLookup(max_n=3, min_n=1)
    history = [1, 2, 3, 4, 9, 2, 3, 5, 1, 2, 3]
    loop = [7, 8, 7, 8, 7]
    asks = [Ask(0, history, 3), Ask(1, loop, 5), Ask(2, [1, 2, 3], 4), Ask(3, history, 0)]
    # "1 2 3" occurred at the start, followed by 4 9 2; a continuation reaching the end of the
    # history repeats its own proposal; nothing repeats in 1 2 3; a length of 0 drafts nothing.
    assert lookup.draft(asks) == [[4, 9, 2], [8, 7, 8, 7, 8], [], []]


def test_appends_and_rewinds_rewrite_what_changed():
    lookup = PromptLookup(max_n=2, min_n=2)
    history = [1, 2, 3]
    assert lookup.draft([Ask(0, history, 2)]) == [[]]
    history += [1, 2]
    assert lookup.draft([Ask(0, history, 2)]) == [[3, 1]]
    del history[-2:]  # a rewind, then new tokens
    history += [5, 3, 1]
    assert lookup.draft([Ask(0, history, 1)]) == [[]]  # "3 1" (stale: followed by 2) is gone
    with pytest.raises(ValueError, match="min_n"):
        PromptLookup(max_n=1, min_n=2)


@pytest.mark.parametrize("max_n,min_n", [(4, 1), (3, 2), (1, 1), (5, 3)])
def test_a_batch_of_changing_histories_matches_a_scan(max_n, min_n):
    """Jobs appending one or more tokens (now and then hundreds: the rows grow), rewinding (as
    deep as `PromptLookup.TAIL`, then new tokens), ending (their rows reused) and asking in
    varying subsets: every draft equals the scan's."""
    rng = random.Random(max_n * 10 + min_n)
    vocab = 4  # few tokens: suffixes recur, continuations run into the end
    lookup = PromptLookup(max_n=max_n, min_n=min_n)
    histories = {job: [rng.randrange(vocab) for _ in range(rng.randrange(0, 6))]
                 for job in range(12)}  # more jobs than the first rows: rows are added
    next_job = len(histories)
    for _ in range(50):
        for history in histories.values():
            if history and rng.random() < 0.2:
                del history[-rng.randint(1, min(PromptLookup.TAIL, len(history))):]
            grow = rng.randint(0, 4) if rng.random() < 0.9 else rng.randint(100, 400)
            history += [rng.randrange(vocab) for _ in range(grow)]
        if rng.random() < 0.2:
            ended = rng.choice(list(histories))
            lookup.forget(ended)
            del histories[ended]
            histories[next_job] = [rng.randrange(vocab) for _ in range(rng.randrange(0, 6))]
            next_job += 1
        asks = [Ask(job, history, rng.randint(0, 6)) for job, history in histories.items()
                if rng.random() < 0.8]
        assert lookup.draft(asks) == [latest_continuation(a.history, a.length, max_n, min_n)
                                      for a in asks]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_histories_on_cuda_give_the_cpu_drafts():
    rng = random.Random(3)
    histories = [[rng.randrange(50) for _ in range(rng.randrange(1, 3000))] for _ in range(40)]
    asks = [Ask(job, history, 4) for job, history in enumerate(histories)]
    assert PromptLookup("cuda").draft(asks) == PromptLookup("cpu").draft(asks)
