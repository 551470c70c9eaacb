"""The paged forward against transformers (the oracle), in float32 on the CPU.

Every architecture runs prompts of 5, 37 and 300 tokens: flattened into one batch, chunked over
several forwards mixed with other sequences' decodes (and drafts), over shuffled pages, after
page copies; and greedy decoding through the cache equals transformers' generate.
"""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

from dyngen_core.config import ModelConfig
from dyngen_core.engine.plan import PageCopy, SequenceSlice, StepPlan
from dyngen_core.kv.attention import SdpaBackend, get_backend
from dyngen_core.kv.attention.base import build_forward_batch
from dyngen_core.kv.cache import Cache
from dyngen_core.model import Model
from dyngen_core.model.rope import RotaryEmbedding

PROMPT_LENGTHS = (5, 37, 300)
TOLERANCE = 1e-4


@dataclass
class Oracle:
    """Our model, the transformers model, fixed prompts and transformers' logits for each
    prompt run alone ([len, vocab] per prompt)."""

    model: Model
    hf: Any
    prompts: list[list[int]]
    refs: list[torch.Tensor]


@pytest.fixture(scope="module")
def oracle(tiny_model_dir: Path) -> Oracle:
    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    model = Model.load(tiny_model_dir)
    rng = random.Random(0)
    prompts = [[rng.randrange(model.config.vocab_size) for _ in range(n)] for n in PROMPT_LENGTHS]
    with torch.no_grad():
        refs = [hf(torch.tensor([p])).logits[0].float() for p in prompts]
    return Oracle(model, hf, prompts, refs)


def run(model: Model, cache: Cache, slices: list[SequenceSlice],
        copies: list[PageCopy] | None = None, all_rows: bool = False) -> torch.Tensor:
    """One engine step: page copies, then one forward; logits at the plan's sample rows (or at
    every row)."""
    plan = StepPlan(slices=slices, copies=copies or [])
    cache.storage.copy_pages(plan.copies)
    batch = build_forward_batch(plan, cache.page_size, model.device)
    if all_rows:
        batch = dataclasses.replace(batch, logits_indices=torch.arange(batch.num_tokens))
    return model.forward(batch, cache.storage, SdpaBackend())


def pages_for(num_tokens: int, page_size: int, pool: list[int]) -> list[int]:
    """Take the pages for ``num_tokens`` tokens off the front of ``pool``."""
    count = -(-num_tokens // page_size)
    taken, pool[:] = pool[:count], pool[count:]
    return taken


def assert_close(ours: torch.Tensor, ref: torch.Tensor) -> None:
    assert ours.shape == ref.shape
    diff = (ours - ref).abs().max().item() if ref.numel() else 0.0
    assert diff <= TOLERANCE, f"max abs diff {diff:.2e} > {TOLERANCE}"


def test_one_flattened_batch_matches_each_prompt_alone(oracle: Oracle) -> None:
    cache = Cache(oracle.model, max_tokens=8 * 256)  # default 256-slot pages
    pool = [5, 0, 7, 2, 3]
    slices = [SequenceSlice(i, p, 0, pages_for(len(p), 256, pool), sample=True)
              for i, p in enumerate(oracle.prompts)]
    logits = run(oracle.model, cache, slices, all_rows=True)
    assert logits.dtype == torch.float32
    assert_close(logits, torch.cat(oracle.refs))
    # Without the override, only each sequence's last row comes back, in slice order.
    sampled = run(oracle.model, Cache(oracle.model, max_tokens=8 * 256), slices)
    assert_close(sampled, torch.stack([ref[-1] for ref in oracle.refs]))


def test_shuffled_small_pages_match(oracle: Oracle) -> None:
    page_size = 16
    cache = Cache(oracle.model, max_tokens=40 * page_size, page_size=page_size)
    pool = list(range(cache.num_pages))
    random.Random(1).shuffle(pool)
    slices = [SequenceSlice(i, p, 0, pages_for(len(p), page_size, pool), sample=True)
              for i, p in enumerate(oracle.prompts)]
    assert slices[2].page_table != sorted(slices[2].page_table)
    logits = run(oracle.model, cache, slices, all_rows=True)
    assert_close(logits, torch.cat(oracle.refs))


def test_chunked_prefill_mixed_with_decodes_and_drafts(oracle: Oracle) -> None:
    """Seq 2 (300 tokens) prefills in three chunks while seq 1 decodes one token per step (then
    verifies drafts) and seq 0 joins later; every sampled row equals transformers'."""
    page_size = 16
    cache = Cache(oracle.model, max_tokens=48 * page_size, page_size=page_size)
    pool = list(range(cache.num_pages))
    random.Random(2).shuffle(pool)
    short, mid, long = oracle.prompts
    tables = {i: pages_for(len(p), page_size, pool) for i, p in enumerate(oracle.prompts)}

    def piece(seq: int, start: int, end: int, sample: bool, drafts: int = 0) -> SequenceSlice:
        ids = oracle.prompts[seq]
        return SequenceSlice(seq, ids[start:end - drafts], start, tables[seq], sample,
                             draft_ids=ids[end - drafts:end])

    steps = [
        [piece(2, 0, 100, False), piece(1, 0, 30, False)],
        [piece(1, 30, 31, True), piece(2, 100, 250, False), piece(0, 0, 3, True)],
        [piece(0, 3, 4, True), piece(1, 31, 32, True), piece(2, 250, 300, True)],
        [piece(1, 32, 35, True, drafts=2), piece(0, 4, 5, True)],
        [piece(1, 35, 36, True)],
    ]
    for step in steps:
        logits = run(oracle.model, cache, step)
        expected = [oracle.refs[s.job_id][s.end_pos - s.num_logits:s.end_pos] for s in step]
        assert_close(logits, torch.cat(expected))


def test_page_copies_before_forward(oracle: Oracle) -> None:
    """A job reusing two full pages and a copied partial page continues exactly; the second
    run copies through a chain (src of one copy is the dst of an earlier one)."""
    page_size, prefix = 16, 40
    long = oracle.prompts[2]
    for copies, last_page in (
        ([PageCopy(2, 9, 8)], 9),
        ([PageCopy(2, 9, 8), PageCopy(9, 11, 8)], 11),
    ):
        cache = Cache(oracle.model, max_tokens=16 * page_size, page_size=page_size)
        run(oracle.model, cache, [SequenceSlice(0, long[:prefix], 0, [0, 1, 2], False)])
        follow = SequenceSlice(1, long[prefix:prefix + 3], prefix, [0, 1, last_page], True)
        logits = run(oracle.model, cache, [follow], copies=copies, all_rows=True)
        assert_close(logits, oracle.refs[2][prefix:prefix + 3])


def test_greedy_decode_matches_generate(oracle: Oracle) -> None:
    prompt, new_tokens, page_size = oracle.prompts[1][:12], 10, 16
    with torch.no_grad():
        expected = oracle.hf.generate(
            torch.tensor([prompt]), max_new_tokens=new_tokens, do_sample=False,
            eos_token_id=None, pad_token_id=0,
        )[0, len(prompt):].tolist()
    assert len(expected) == new_tokens
    cache = Cache(oracle.model, max_tokens=4 * page_size, page_size=page_size)
    pages = [3, 1]
    logits = run(oracle.model, cache, [SequenceSlice(0, prompt, 0, pages, True)])
    generated = [int(logits[-1].argmax())]
    while len(generated) < new_tokens:
        step = SequenceSlice(0, generated[-1:], len(prompt) + len(generated) - 1, pages, True)
        generated.append(int(run(oracle.model, cache, [step])[-1].argmax()))
    assert generated == expected


def test_build_forward_batch_fields() -> None:
    plan = StepPlan(slices=[
        SequenceSlice(7, [11, 12, 13], 0, [4], sample=False),
        SequenceSlice(8, [21], 5, [2, 6], sample=True, draft_ids=[22, 23]),
    ])
    batch = build_forward_batch(plan, page_size=4, device="cpu")
    assert batch.input_ids.tolist() == [11, 12, 13, 21, 22, 23]
    assert batch.positions.tolist() == [0, 1, 2, 5, 6, 7]
    assert batch.slot_mapping.tolist() == [16, 17, 18, 25, 26, 27]
    assert batch.query_start.tolist() == [0, 3, 6]
    assert batch.context_lens.tolist() == [3, 8]
    assert batch.page_table.tolist() == [[4, 0], [2, 6]]
    assert batch.logits_indices.tolist() == [3, 4, 5]
    assert (batch.query_lens_host, batch.context_lens_host) == ([3, 3], [3, 8])
    with pytest.raises(ValueError, match="page table has 1 pages"):
        build_forward_batch(StepPlan([SequenceSlice(1, [1] * 5, 0, [0], True)]), 4, "cpu")
    with pytest.raises(ValueError, match="at least one token"):
        build_forward_batch(StepPlan([SequenceSlice(1, [], 0, [0], True)]), 4, "cpu")


def test_cache_geometry_and_memory(tiny_llama_dir: Path) -> None:
    model = Model.load(tiny_llama_dir)
    cache = Cache(model, max_tokens=1000)
    config = model.config
    assert (cache.page_size, cache.num_pages, cache.max_tokens, cache.mode) == (256, 4, 1024,
                                                                                "fp16")
    per_layer = 4 * 256 * config.num_kv_heads * config.head_dim * 4  # float32 pages
    assert cache.nbytes() == 2 * config.num_layers * per_layer
    with pytest.raises(ValueError, match="cache mode 'bogus'"):
        Cache(model, max_tokens=1000, mode="bogus")


@pytest.mark.parametrize("scaling", [
    None,
    {"rope_type": "linear", "factor": 4.0},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 512},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024},
    {"type": "yarn", "factor": 8.0, "original_max_position_embeddings": 1024, "mscale": 1.0,
     "mscale_all_dim": 0.5, "beta_fast": 16},
], ids=["default", "linear", "llama3", "yarn", "yarn-mscale"])
def test_rotary_tables_match_transformers(scaling: dict[str, Any] | None) -> None:
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    hf_config = LlamaConfig(hidden_size=256, num_attention_heads=4, head_dim=64,
                            rope_theta=500000.0, max_position_embeddings=8192,
                            rope_scaling=scaling)
    raw = {**hf_config.to_dict(), "architectures": ["LlamaForCausalLM"]}
    rotary = RotaryEmbedding(ModelConfig.from_dict(raw), torch.device("cpu"))
    positions = torch.tensor([0, 1, 17, 511, 1500, 4000, 8191])
    cos, sin = rotary.cos_sin(positions, torch.float32)
    ref_cos, ref_sin = LlamaRotaryEmbedding(hf_config)(torch.zeros(1), positions[None])
    assert torch.equal(cos, ref_cos[0]) and torch.equal(sin, ref_sin[0])


def test_get_backend() -> None:
    assert get_backend().name == "sdpa"
    assert get_backend("sdpa", "cpu").name == "sdpa"
    with pytest.raises(ValueError, match="'nope' is unknown"):
        get_backend("nope")
    built = SdpaBackend()
    assert get_backend(built, "cpu") is built  # a backend built with options is used as it is
