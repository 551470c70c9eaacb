"""The Triton top-k (`sampling.fused.topk_rows`) against torch: the values of
``torch.topk`` exactly, and the ids of a stable descending ``torch.sort`` (ties to the lower
column, NaN first) exactly; -inf and NaN rows; float32, bfloat16 and float16 rows; vocabularies
that are not a multiple of the chunk; the fused draw with it drawing what it draws with
torch.topk; and (CUDA) a captured graph replaying what the eager call computes. Under
``TRITON_INTERPRET=1`` the shapes are small (the interpreter is slow).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from dyngen_core import SamplerSettings
from dyngen_core.engine.record import SampleRequest
from dyngen_core.sampling.sampler import Sampler

pytestmark = pytest.mark.gpu

# (rows, vocab, bound, `topk_plan` options): most leave a row more super-groups than k (each
# level's selection matters), a few fewer (padding super-groups are chosen and read).
CUDA_CASES: list[tuple[int, int, int, dict[str, int]]] = [
    (4, 128256, 50, {}), (3, 128256, 1024, {}), (5, 32000, 1, {}), (3, 50257, 64, {}),
    (2, 151936, 100, {"chunk": 4096}), (2, 5000, 256, {"chunk": 1024}), (40, 4097, 64, {})]
INTERPRETER_CASES: list[tuple[int, int, int, dict[str, int]]] = [
    (2, 2100, 64, {"chunk": 512, "group": 4, "super_group": 4}), (3, 700, 1, {}),
    (2, 4000, 8, {"chunk": 512}), (2, 1000, 50, {"chunk": 256}),
    (2, 300, 17, {"chunk": 64, "group": 2, "super_group": 2})]


def _topk_rows() -> tuple[Any, Any]:
    """(`fused.topk_plan`, `fused.topk_rows`), imported here: the module imports triton."""
    from dyngen_core.sampling.fused import topk_plan, topk_rows

    return topk_plan, topk_rows


def _cases(device: torch.device) -> list[tuple[int, int, int, dict[str, int]]]:
    return CUDA_CASES if device.type == "cuda" else INTERPRETER_CASES


def _one_case(device: torch.device) -> tuple[int, int, int, dict[str, int]]:
    """A multi-chunk case for the tests of one shape."""
    return CUDA_CASES[0] if device.type == "cuda" else INTERPRETER_CASES[-1]


def _expected(x: torch.Tensor, bound: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(torch.topk's values as float32, a stable descending sort's ids): the exact oracle
    of the ids, ties to the lower column and NaN first. Computed on the CPU: there every NaN
    is the largest value, as documented; on CUDA (H200, torch 2.11) torch.topk puts a
    negative NaN last of its k and torch.sort below the finite values."""
    cpu = x.cpu()
    values = torch.topk(cpu, bound, dim=-1).values.float()
    ids = torch.sort(cpu.float(), dim=-1, descending=True, stable=True).indices[:, :bound]
    return values.to(x.device), ids.to(x.device)


def _check(x: torch.Tensor, bound: int, options: dict[str, int]) -> None:
    topk_plan, topk_rows = _topk_rows()
    plan = topk_plan(x.shape[1], bound, **options)
    values, ids = topk_rows(x, bound, plan=plan)
    want_values, want_ids = _expected(x, bound)
    assert values.dtype == torch.float32 and ids.dtype == torch.int64
    assert values.shape == ids.shape == (x.shape[0], bound)
    assert torch.equal(values.isnan(), want_values.isnan())
    assert torch.equal(values.nan_to_num(0.5), want_values.nan_to_num(0.5))
    assert torch.equal(ids, want_ids), (ids[:, :8], want_ids[:, :8])


def test_values_and_ids_are_torch_topk_and_a_stable_sort(device: torch.device) -> None:
    generator = torch.Generator().manual_seed(0)
    for rows, vocab, bound, options in _cases(device):
        x = (torch.randn(rows, vocab, generator=generator) * 4).to(device)
        _check(x, bound, options)


def test_ties_go_to_the_lower_column(device: torch.device) -> None:
    generator = torch.Generator().manual_seed(1)
    for rows, vocab, bound, options in _cases(device):
        # A few distinct values: every candidate list is full of ties.
        x = torch.randint(-3, 4, (rows, vocab), generator=generator).float().to(device)
        _check(x, bound, options)


def test_rows_with_inf_and_nan(device: torch.device) -> None:
    _, vocab, bound, options = _one_case(device)
    rows = 6
    x = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(2))
    x[0, : vocab - 3] = float("-inf")  # 3 finite values, the rest -inf candidates
    x[1, 7] = float("nan")
    x[2, vocab // 2] = -float("nan")  # a negative NaN is still first
    x[2, vocab - 1] = float("nan")
    x[3] = float("-inf")
    x[4, 5] = float("inf")
    x[4, vocab - 2] = float("inf")
    x[5, ::2] = float("-inf")
    _check(x.to(device), bound, options)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_rows(device: torch.device, dtype: torch.dtype) -> None:
    rows, vocab, bound, options = _one_case(device)
    x = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(3)) * 4
    _check(x.to(dtype).to(device), bound, options)


def test_strided_rows_and_given_outputs(device: torch.device) -> None:
    _, topk_rows = _topk_rows()
    rows, vocab, bound, _ = _one_case(device)
    wide = torch.randn(rows, vocab + 40, generator=torch.Generator().manual_seed(4)).to(device)
    x = wide[:, :vocab]  # the sampler's view of logits wider than the vocabulary
    values = torch.full((rows, bound + 3), 7.0, device=device)
    ids = torch.full((rows, bound + 3), -5, dtype=torch.int64, device=device)
    topk_rows(x, bound, values=values[:, :bound], ids=ids[:, :bound])
    want_values, want_ids = _expected(x, bound)
    assert torch.equal(values[:, :bound], want_values)
    assert torch.equal(ids[:, :bound], want_ids)
    assert (values[:, bound:] == 7.0).all() and (ids[:, bound:] == -5).all()


def test_plan_rejects_what_it_cannot_do(device: torch.device) -> None:
    topk_plan, _ = _topk_rows()
    with pytest.raises(ValueError, match="bound"):
        topk_plan(100, 101)
    with pytest.raises(ValueError, match="bound"):
        topk_plan(128256, 1025)
    with pytest.raises(ValueError, match="power of two"):
        topk_plan(128256, 50, chunk=3000)
    plan = topk_plan(128256, 50)
    assert plan.k == 64 and plan.chunks * plan.chunk >= 128256


FUSABLE = [SamplerSettings(temperature=0.8, top_p=0.9, top_k=50),
           SamplerSettings(temperature=1.3, top_k=7),
           SamplerSettings(top_k=40, top_p=0.5)]


def _requests(rows: int, step: int) -> list[SampleRequest]:
    return [SampleRequest(settings=FUSABLE[i % len(FUSABLE)], seed=500 + i, counter=step)
            for i in range(rows)]


def test_fused_draw_with_the_triton_topk_draws_what_torch_topk_draws(
        device: torch.device) -> None:
    vocab, rows = (128256, 64) if device.type == "cuda" else (1500, 3)
    triton_topk = Sampler(vocab, device, fused_draw=True, draw_graphs=False,
                          fused_topk="triton")
    torch_topk = Sampler(vocab, device, fused_draw=True, draw_graphs=False,
                         fused_topk="torch")
    generator = torch.Generator().manual_seed(5)
    for step in range(2 if device.type == "cuda" else 1):
        logits = (torch.randn(rows, vocab, generator=generator) * 3).to(device)
        got = triton_topk.launch_tokens(logits, _requests(rows, step))
        want = torch_topk.launch_tokens(logits, _requests(rows, step))
        assert got is not None and want is not None
        assert got.tolist() == want.tolist(), step
    logits[1, 3] = float("nan")  # the fused draw still sees the NaN and reports the row
    got = triton_topk.launch_tokens(logits, _requests(rows, 0))
    assert got is not None and got[1].item() == -1


def test_sampler_validates_the_option(device: torch.device) -> None:
    with pytest.raises(ValueError, match="fused_topk"):
        Sampler(100, device, fused_draw=True, fused_topk="radix")
    with pytest.raises(ValueError, match="fused draw"):
        Sampler(100, device, fused_draw=False, fused_topk="triton")


def test_captured_top_k_replays_what_the_eager_call_computes(
        cuda_device: torch.device) -> None:
    _, topk_rows = _topk_rows()
    x = torch.randn(64, 128256, device=cuda_device)
    values = torch.empty(64, 50, device=cuda_device)
    ids = torch.empty(64, 50, dtype=torch.int64, device=cuda_device)
    side = torch.cuda.Stream(cuda_device)
    side.wait_stream(torch.cuda.current_stream(cuda_device))
    with torch.cuda.stream(side):
        topk_rows(x, 50, values=values, ids=ids)  # compiles outside the capture
    torch.cuda.current_stream(cuda_device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        topk_rows(x, 50, values=values, ids=ids)
    for scale in (1.0, 5.0):
        x.normal_(0, scale)
        graph.replay()
        want_values, want_ids = topk_rows(x, 50)
        assert torch.equal(values, want_values) and torch.equal(ids, want_ids)
        assert torch.equal(ids, _expected(x, 50)[1])


def test_graphed_fused_draw_with_the_triton_topk_equals_eager(
        cuda_device: torch.device) -> None:
    graphed = Sampler(128256, cuda_device, draw_graphs=True, fused_topk="triton")
    eager = Sampler(128256, cuda_device, draw_graphs=False, fused_topk="torch")
    buffer = torch.empty(96, 128256, device=cuda_device)
    for step, count in enumerate((70, 96, 33)):
        buffer.normal_(0, 3)
        got = graphed.launch_tokens(buffer[:count], _requests(count, step))
        want = eager.launch_tokens(buffer[:count], _requests(count, step))
        assert got is not None and want is not None
        assert got.tolist() == want.tolist(), step
    assert graphed.draw_graphs is not None and graphed.draw_graphs.failure is None
    assert len(graphed.draw_graphs) == 2  # buckets of 96 rows (70, 96) and 64 (33)
