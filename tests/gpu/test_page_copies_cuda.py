"""Resolved page copies (`kv.storage.resolve_copies`) on CUDA: random ordered plans (chains,
cycles, partial pages) and a defragmentation plan over bf16 pages of a large head leave what
copying one at a time leaves, in the fp16 storage's and the quantized storage's layouts."""

from __future__ import annotations

import random

import pytest
import torch

from dyngen_core.engine.defrag import plan_defrag
from dyngen_core.engine.plan import PageCopy
from dyngen_core.kv.storage import copy_page_slots, resolve_copies
from tests.model.test_page_copies import one_by_one

pytestmark = pytest.mark.gpu

PAGES, PAGE_SIZE = 40, 256


def pages(device: torch.device, head_major: bool) -> torch.Tensor:
    """[PAGES, PAGE_SIZE, 8, 128] bf16 noise, each page's rows slot-major (fp16 storage) or
    head-major (quantized storage)."""
    generator = torch.Generator(device=device).manual_seed(0)
    shape = (PAGES, 8, PAGE_SIZE, 128) if head_major else (PAGES, PAGE_SIZE, 8, 128)
    tensor = torch.randn(shape, device=device, dtype=torch.bfloat16, generator=generator)
    return tensor.transpose(1, 2) if head_major else tensor


@pytest.mark.parametrize("head_major", [False, True])
@pytest.mark.parametrize("seed", range(6))
def test_random_plans_match_copying_one_by_one(cuda_device: torch.device, head_major: bool,
                                                  seed: int) -> None:
    rng = random.Random(seed)
    tensor = pages(cuda_device, head_major)
    copies = [PageCopy(*rng.sample(range(PAGES), 2), rng.choice([1, 100, PAGE_SIZE]))
              for _ in range(rng.randint(1, 30))]
    expected = one_by_one(tensor, copies)
    copy_page_slots([tensor], resolve_copies(copies, PAGE_SIZE))
    assert torch.equal(tensor, expected)


def test_a_defragmentation_plan_matches_copying_one_by_one(cuda_device: torch.device) -> None:
    order = list(range(32))
    random.Random(1).shuffle(order)
    plan = plan_defrag([order[:16], order[16:]], [], PAGES, PAGE_SIZE, min_fraction=0.0,
                       max_moves=PAGES)
    assert plan is not None
    tensors = [pages(cuda_device, head_major) for head_major in (False, True)]
    expected = [one_by_one(t, plan.copies) for t in tensors]
    copy_page_slots(tensors, resolve_copies(plan.copies, PAGE_SIZE))
    assert all(torch.equal(a, b) for a, b in zip(tensors, expected, strict=True))
