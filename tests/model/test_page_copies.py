"""Page copies resolved into moves that run at once (`kv.storage.resolve_copies`): a plan's
ordered copies (partial-page reuse, defragmentation's chains and cycles) leave what running them
one by one leaves, in every storage mode; whole pages move as pages."""

from __future__ import annotations

import random

import pytest
import torch

from dyngen_core.config import ModelConfig
from dyngen_core.engine.defrag import plan_defrag
from dyngen_core.engine.plan import PageCopy
from dyngen_core.kv.fp16 import FP16Storage
from dyngen_core.kv.quant.storage import QuantStorage
from dyngen_core.kv.storage import copy_page_slots, resolve_copies

PAGES, PAGE_SIZE = 12, 8


def model_config() -> ModelConfig:
    return ModelConfig(architecture="LlamaForCausalLM", vocab_size=32, hidden_size=128,
                       intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                       head_dim=64, max_position_embeddings=512)


def one_by_one(tensor: torch.Tensor, copies: list[PageCopy]) -> torch.Tensor:
    """What running ``copies`` in order leaves in (a copy of) ``tensor``."""
    out = tensor.clone()
    for c in copies:
        out[c.dst, :c.num_slots] = out[c.src, :c.num_slots].clone()
    return out


def random_copies(rng: random.Random, count: int) -> list[PageCopy]:
    copies = []
    for _ in range(count):
        src, dst = rng.sample(range(PAGES), 2)
        copies.append(PageCopy(src, dst, rng.choice([1, 3, PAGE_SIZE])))
    return copies


def moves(copies: list[PageCopy], page_size: int = 4) -> list[tuple[int, int, int]]:
    """Every slot's move, whole pages as their slots."""
    resolved = resolve_copies(copies, page_size)
    slots = list(zip(resolved.slot_src.tolist(), resolved.slot_dst.tolist(),
                     resolved.slot.tolist(), strict=True))
    for src, dst in zip(resolved.page_src.tolist(), resolved.page_dst.tolist(), strict=True):
        slots += [(src, dst, slot) for slot in range(page_size)]
    return sorted(slots)


def test_chains_and_cycles_resolve_to_their_first_source() -> None:
    chain = [PageCopy(3, 4, 2), PageCopy(2, 3, 2), PageCopy(1, 2, 2)]  # each into the next
    assert moves(chain) == [(1, 2, 0), (1, 2, 1), (2, 3, 0), (2, 3, 1), (3, 4, 0), (3, 4, 1)]
    # A read of a written page reads that write's source; the later write of a slot wins.
    assert moves([PageCopy(0, 5, 2), PageCopy(5, 6, 2)]) == [
        (0, 5, 0), (0, 5, 1), (0, 6, 0), (0, 6, 1)]
    assert moves([PageCopy(0, 5, 2), PageCopy(1, 5, 1)]) == [(0, 5, 1), (1, 5, 0)]
    # A swap through a spare page (9): the spare keeps a copy, the two pages trade places.
    swap = [PageCopy(1, 9, 1), PageCopy(2, 1, 1), PageCopy(9, 2, 1)]
    assert moves(swap) == [(1, 2, 0), (1, 9, 0), (2, 1, 0)]
    # Copied there and back: the first page ends as it was.
    assert moves([PageCopy(1, 2, 3), PageCopy(2, 1, 3)]) == [(1, 2, 0), (1, 2, 1), (1, 2, 2)]
    assert moves([]) == []
    # Whole pages are page moves: a full copy, and a page filled in two parts from one source.
    whole = resolve_copies([PageCopy(1, 2, 4), PageCopy(3, 5, 2), PageCopy(3, 5, 4)], 4)
    assert whole.page_src.tolist() == [1, 3] and whole.page_dst.tolist() == [2, 5]
    assert not len(whole.slot)
    part = resolve_copies([PageCopy(1, 2, 4), PageCopy(3, 2, 1)], 4)
    assert not len(part.page_src) and part.slot_src.tolist() == [3, 1, 1, 1]


@pytest.mark.parametrize("seed", range(40))
def test_resolved_moves_give_the_in_order_result(seed: int) -> None:
    rng = random.Random(seed)
    tensor = torch.randn(PAGES, PAGE_SIZE, 2, 4)
    copies = random_copies(rng, rng.randint(1, 14))
    expected = one_by_one(tensor, copies)
    copy_page_slots([tensor], resolve_copies(copies, PAGE_SIZE))
    assert torch.equal(tensor, expected)


def test_a_defragmentation_plan_moves_every_page_at_once() -> None:
    """Interleaved jobs (chains and cycles): one gather and scatter lands every page where the
    plan's mapping says."""
    tables = [[7, 2, 9, 4], [3, 8, 0, 5], [1, 6]]  # 1 -> 8 -> 3 -> ... : chains and cycles
    plan = plan_defrag(tables, [], num_pages=PAGES, page_size=PAGE_SIZE, max_moves=PAGES)
    assert plan is not None
    assert len(plan.copies) > len(plan.mapping)  # a cycle went through the spare page
    tensor = torch.randn(PAGES, PAGE_SIZE, 2, 4)
    before = tensor.clone()
    moves = resolve_copies(plan.copies, PAGE_SIZE)
    assert len(moves.page_src) == len(plan.mapping) + 1 and not len(moves.slot)  # + the spare
    copy_page_slots([tensor], moves)
    for old, new in plan.mapping.items():
        assert torch.equal(tensor[new], before[old])


@pytest.mark.parametrize("mode", ["fp16", "q8", "q4"])
@pytest.mark.parametrize("seed", range(4))
def test_every_storage_copies_at_once_as_in_order(mode: str, seed: int) -> None:
    """Codes, scales and head rows (quantized) or rows (fp16) after a random ordered plan equal
    what copying one by one leaves."""
    rng = random.Random(100 + seed)
    config = model_config()
    if mode == "fp16":
        storage: FP16Storage | QuantStorage = FP16Storage(
            config, PAGES, PAGE_SIZE, torch.float32, ["cpu", "cpu"])
    else:
        storage = QuantStorage(config, PAGES, PAGE_SIZE, torch.float32, ["cpu", "cpu"], mode)
    generator = torch.Generator().manual_seed(seed)
    slots = torch.arange(PAGES * PAGE_SIZE)
    for layer in range(2):
        rows = torch.randn(len(slots), 2, 64, generator=generator)
        storage.write(layer, rows, -rows, slots)
    copies = random_copies(rng, 10)
    everything = torch.arange(PAGES).view(1, PAGES)
    before = [storage.gather(layer, everything) for layer in range(2)]
    storage.copy_pages(copies)
    for layer in range(2):
        for new, old in zip(storage.gather(layer, everything), before[layer], strict=True):
            expected = one_by_one(old.view(PAGES, PAGE_SIZE, 2, 64), copies)
            assert torch.equal(new.view(PAGES, PAGE_SIZE, 2, 64), expected)
