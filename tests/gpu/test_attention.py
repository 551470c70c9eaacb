"""Every GPU attention backend x storage mode against the sdpa reference over the same pages.

Each case writes a random context into a paged cache (pages shuffled, so page tables are not the
identity), then runs one step of new tokens (decodes, prefill chunks, or both mixed) through the
backend under test and through `SdpaBackend`, and compares the outputs.
"""

from __future__ import annotations

import importlib.util
import math
import random

import pytest
import torch

from dyngen_core.config import ModelConfig
from dyngen_core.engine.plan import SequenceSlice, StepPlan
from dyngen_core.kv.attention.base import build_forward_batch
from dyngen_core.kv.attention.sdpa import SdpaBackend
from dyngen_core.kv.cache import make_storage
from tests.gpu.conftest import interpreter_mode

pytestmark = pytest.mark.gpu
MODES = ("fp16", "q8", "q6", "q4")


def _config(num_heads: int, num_kv_heads: int, head_dim: int) -> ModelConfig:
    return ModelConfig(architecture="LlamaForCausalLM", vocab_size=32,
                       hidden_size=num_heads * head_dim, intermediate_size=64, num_layers=2,
                       num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim)


def _make_storage(mode: str, config: ModelConfig, num_pages: int, page_size: int,
                  dtype: torch.dtype, device: torch.device):  # type: ignore[no-untyped-def]
    if mode == "fp16":
        return make_storage("fp16", config, num_pages, page_size, dtype, [device] * 2)
    from dyngen_core.kv.quant.storage import QuantStorage

    return QuantStorage(config, num_pages, page_size, dtype, [device] * 2, mode=mode)


def _shapes(device: torch.device) -> dict[str, object]:
    """Small shapes under the interpreter (it runs kernels in numpy); real ones on CUDA."""
    if device.type == "cuda":
        return {"page_size": 256, "dtype": torch.bfloat16,
                "lens": [(1, 1), (1, 300), (1, 1100), (37, 37), (200, 700), (1, 5000)]}
    return {"page_size": 16, "dtype": torch.float32, "lens": [(1, 1), (1, 21), (1, 70),
                                                               (5, 5), (9, 40)]}


def _run_case(backend, device: torch.device, mode: str, lens: list[tuple[int, int]],
              num_heads: int, num_kv_heads: int, head_dim: int, page_size: int,
              dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """lens: (query tokens this step, context length after it) per sequence."""
    gen = torch.Generator().manual_seed(seed)
    config = _config(num_heads, num_kv_heads, head_dim)
    pages_per_seq = [math.ceil(ctx / page_size) for _, ctx in lens]
    num_pages = sum(pages_per_seq) + 3
    storage = _make_storage(mode, config, num_pages, page_size, dtype, device)
    order = list(range(1, num_pages))
    random.Random(seed).shuffle(order)
    slices, offset = [], 0
    for job_id, ((qlen, ctx), count) in enumerate(zip(lens, pages_per_seq, strict=True)):
        table = order[offset:offset + count]
        offset += count
        slots = [table[p // page_size] * page_size + p % page_size for p in range(ctx - qlen)]
        if slots:
            k = torch.randn(len(slots), num_kv_heads, head_dim, generator=gen).to(device, dtype)
            v = torch.randn(len(slots), num_kv_heads, head_dim, generator=gen).to(device, dtype)
            for layer in range(2):
                storage.write(layer, k, v, torch.tensor(slots, device=device))
        slices.append(SequenceSlice(job_id=job_id, token_ids=[1] * qlen, start_pos=ctx - qlen,
                                    page_table=table, sample=True))
    batch = build_forward_batch(StepPlan(slices=slices), page_size, device)
    tokens = batch.num_tokens
    q = torch.randn(tokens, num_heads, head_dim, generator=gen).to(device, dtype)
    k = torch.randn(tokens, num_kv_heads, head_dim, generator=gen).to(device, dtype)
    v = torch.randn(tokens, num_kv_heads, head_dim, generator=gen).to(device, dtype)
    scale = head_dim ** -0.5
    out = backend.attend(1, q, k, v, storage, batch, scale)
    ref = SdpaBackend().attend(1, q, k, v, storage, batch, scale)
    return out.float(), ref.float()


def _relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert torch.isfinite(out).all(), "backend output holds NaN or inf"
    return float((out - ref).norm() / ref.norm())


def _tolerance(dtype: torch.dtype) -> float:
    return 2e-2 if dtype in (torch.bfloat16, torch.float16) else 2e-3


def _triton_backend():  # type: ignore[no-untyped-def]
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed")
    from dyngen_core.kv.attention.triton.paged import TritonPagedBackend

    return TritonPagedBackend()


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("step", ["decode", "prefill", "mixed"])
def test_triton_matches_sdpa(device: torch.device, mode: str, step: str) -> None:
    shapes = _shapes(device)
    lens = list(shapes["lens"])  # type: ignore[call-overload]
    if step == "decode":
        lens = [(1, ctx) for _, ctx in lens]
    elif step == "prefill":
        lens = [(ctx if q == 1 else q, ctx) for q, ctx in lens if ctx > 1]
    out, ref = _run_case(_triton_backend(), device, mode, lens, num_heads=8, num_kv_heads=2,
                         head_dim=64, page_size=shapes["page_size"],  # type: ignore[arg-type]
                         dtype=shapes["dtype"])  # type: ignore[arg-type]
    assert _relative_error(out, ref) < _tolerance(shapes["dtype"])  # type: ignore[arg-type]


@pytest.mark.parametrize("heads", [(4, 4, 64), (8, 1, 32), (12, 4, 96), (32, 8, 128)])
def test_triton_head_layouts(device: torch.device, heads: tuple[int, int, int]) -> None:
    """MHA, MQA, a non-power-of-two group and head_dim, and the Llama-3-8B layout."""
    shapes = _shapes(device)
    if interpreter_mode() and heads[2] == 128:
        pytest.skip("too slow under the interpreter")
    num_heads, num_kv_heads, head_dim = heads
    out, ref = _run_case(_triton_backend(), device, "fp16", [(1, 30), (6, 19), (1, 3)],
                         num_heads, num_kv_heads, head_dim,
                         page_size=shapes["page_size"],  # type: ignore[arg-type]
                         dtype=shapes["dtype"])  # type: ignore[arg-type]
    assert _relative_error(out, ref) < _tolerance(shapes["dtype"])  # type: ignore[arg-type]


def test_triton_splits_many_ways_agree(device: torch.device,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """The split-K merge: one split and many splits give the same decode output."""
    backend = _triton_backend()
    from dyngen_core.kv.attention.triton import decode

    shapes = _shapes(device)
    lens = [(1, 3 * shapes["page_size"] + 5), (1, 2)]  # type: ignore[operator]
    kwargs = {"num_heads": 4, "num_kv_heads": 2, "head_dim": 64,
              "page_size": shapes["page_size"], "dtype": shapes["dtype"]}
    monkeypatch.setattr(decode, "MAX_SPLITS", 1)
    one, ref = _run_case(backend, device, "q4", lens, **kwargs)  # type: ignore[arg-type]
    monkeypatch.setattr(decode, "MAX_SPLITS", 8)
    monkeypatch.setattr(decode, "PROGRAMS_PER_SM", 64)
    monkeypatch.setattr(decode, "BLOCK_N", 16)
    many, _ = _run_case(_triton_backend(), device, "q4", lens,
                        **kwargs)  # type: ignore[arg-type]
    assert _relative_error(one, ref) < _tolerance(shapes["dtype"])  # type: ignore[arg-type]
    assert _relative_error(many, one) < 1e-2


@pytest.mark.parametrize("mode", MODES)
def test_flash_matches_sdpa(cuda_device: torch.device, mode: str) -> None:
    if importlib.util.find_spec("flash_attn") is None:
        pytest.skip("flash_attn is not installed")
    from dyngen_core.kv.attention.flash import FlashBackend

    lens = [(1, 300), (1, 1100), (64, 64), (200, 700)]
    out, ref = _run_case(FlashBackend(), cuda_device, mode, lens, num_heads=32, num_kv_heads=8,
                         head_dim=128, page_size=256, dtype=torch.bfloat16)
    assert _relative_error(out, ref) < 2e-2


@pytest.mark.parametrize("mode", MODES)
def test_triton_paged_decode_matches_sdpa(device: torch.device,
                                         monkeypatch: pytest.MonkeyPatch, mode: str) -> None:
    """Decodes through the paged kernel in every storage mode (q8/q4 too, routed away from
    their word kernel, as pages the word block does not divide are), several splits; over
    float pages the key loop loads page ids 2 pages ahead of its tiles."""
    backend = _triton_backend()
    from dyngen_core.kv.attention.triton import decode, paged

    shapes = _shapes(device)
    page = int(shapes["page_size"])  # type: ignore[call-overload]
    monkeypatch.setattr(paged, "word_decode_fits", lambda *args: False)
    monkeypatch.setattr(paged, "deferred_word_write", lambda *args: None)  # nor its write
    monkeypatch.setattr(decode, "BLOCK_N", min(64, page))
    monkeypatch.setattr(decode, "MAX_SPLITS", 3)
    monkeypatch.setattr(decode, "PROGRAMS_PER_SM", 4096)
    monkeypatch.setattr(decode, "PAGE_WINDOW", 2)
    lens = [(1, ctx) for _, ctx in shapes["lens"]]  # type: ignore[attr-defined]
    out, ref = _run_case(backend, device, mode, lens, num_heads=8, num_kv_heads=2, head_dim=64,
                         page_size=page, dtype=shapes["dtype"])  # type: ignore[arg-type]
    assert _relative_error(out, ref) < _tolerance(shapes["dtype"])  # type: ignore[arg-type]
