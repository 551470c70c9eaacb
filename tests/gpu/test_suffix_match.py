"""The Triton suffix search (`ops.suffix_match`, prompt lookup's search) against its torch twin:
the same found flags and, where found, the same continuation; histories shorter than a suffix,
of exactly one block, and ending on both sides of block edges; continuations running into the
end (periodic); several suffix sizes. Under ``TRITON_INTERPRET=1`` the shapes are small."""

from __future__ import annotations

import random
from typing import NamedTuple

import pytest
import torch

from dyngen_core.ops import suffix_match as suffix_match_module
from dyngen_core.ops.suffix_match import MATCH_BLOCK, suffix_match_torch, suffix_match_triton
from dyngen_core.runtime.prompt_lookup import PromptLookup

pytestmark = pytest.mark.gpu


def _agree(rows: torch.Tensor, index: torch.Tensor, width: int, max_n: int, min_n: int) -> None:
    want = suffix_match_torch(rows, index, width, max_n, min_n).cpu()
    got = suffix_match_triton(rows, index, width, max_n, min_n).cpu()
    assert torch.equal(got[:, 0], want[:, 0])
    found = want[:, 0].bool()
    assert torch.equal(got[found], want[found])


@pytest.mark.parametrize("split_blocks", [4, 1])
@pytest.mark.parametrize("max_n,min_n", [(4, 1), (3, 2), (1, 1), (5, 3)])
def test_kernel_finds_what_the_torch_ops_find(device, max_n, min_n, split_blocks, monkeypatch):
    """With one program a job (these rows are shorter than 4 blocks) and with three (one block
    each: the programs' maxima meet in the job's atomic best)."""
    monkeypatch.setattr(suffix_match_module, "SPLIT_BLOCKS", split_blocks)
    rng = random.Random(max_n * 10 + min_n)
    capacity = 2 * MATCH_BLOCK + 300
    lengths = [0, 1, 2, 3, 5, 17, MATCH_BLOCK - 1, MATCH_BLOCK, MATCH_BLOCK + 1, MATCH_BLOCK + 2,
               2 * MATCH_BLOCK + 1, capacity]
    for vocab in (2, 4, 50):
        rows = torch.randint(0, vocab, (len(lengths) + 2, capacity), dtype=torch.int32,
                             device=device)
        order = rng.sample(range(rows.shape[0]), len(lengths))
        index = torch.tensor([order, lengths], dtype=torch.int64, device=device)
        for width in (1, 4, 7):
            _agree(rows, index, width, max_n, min_n)


class Ask(NamedTuple):
    job_id: int
    history: list[int]
    length: int


def test_lookup_with_the_kernel_drafts_what_the_torch_ops_draft(device):
    rng = random.Random(5)
    kernel = PromptLookup(device, use_kernel=True)
    twin = PromptLookup("cpu", use_kernel=False)
    histories = {job: [rng.randrange(20) for _ in range(rng.randrange(1, 1500))]
                 for job in range(20)}
    for _ in range(5):
        for history in histories.values():
            history += [rng.randrange(20) for _ in range(rng.randint(1, 5))]
        asks = [Ask(job, history, rng.randint(1, 6)) for job, history in histories.items()]
        assert kernel.draft(asks) == twin.draft(asks)
