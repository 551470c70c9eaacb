"""The gated MLP's one-row gate/up product and SiLU in one launch (`skinny_matmul.gated_linear`):
the same bits as the product followed by the fused SiLU kernel, for bf16 and fp16, K and I
tails and several K steps; the routing takes exactly the one-row products the table gives a
reduce configuration of pairs; a model's decode logits are the same bits with the switch on and
off, replayed from a CUDA graph; a generator's mixture ends with the same tokens; and a chain
of norm -> gated launches replayed from a CUDA graph gives the eager two-launch result. Kernel
logic also runs on the CPU under TRITON_INTERPRET=1."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from dyngen_core import Cache, DynamicGenerator, Job, Model, SamplerSettings, Tokenizer
from dyngen_core.engine.plan import SequenceSlice, StepPlan
from dyngen_core.kv.attention import get_backend
from dyngen_core.ops import fused_ops, skinny_matmul
from dyngen_core.ops.skinny_matmul import SkinnyConfig, gated_config, gated_linear, gated_routable
from dyngen_core.runtime.graphs import StepGraphs
from tests.engine.step_helpers import run_mixed_jobs, run_to_finals
from tests.gpu.conftest import interpreter_mode

pytestmark = pytest.mark.gpu

# A one-row configuration with several K steps on small shapes (the table's narrow one-row
# block_k of 256 covers them in one).
SHORT_K = SkinnyConfig("reduce", block_n=4, block_k=32, num_stages=4, num_warps=2)


@pytest.fixture
def gated_on() -> Iterator[None]:
    saved = skinny_matmul.GATED
    skinny_matmul.GATED = True
    yield
    skinny_matmul.GATED = saved


def _table_with(monkeypatch: pytest.MonkeyPatch, config: SkinnyConfig | None) -> None:
    """The table with ``config`` for every one-row shape class."""
    table = dict(skinny_matmul.DEFAULT_CONFIGS)
    for weights in ("narrow", "long_k", "wide"):
        table[("1", weights)] = config
    monkeypatch.setattr(skinny_matmul, "DEFAULT_CONFIGS", table)


def _operands(inter: int, k: int, dtype: torch.dtype, device: torch.device,
              seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [1, k] (a view into a wider row) and a gate/up weight [2 * inter, k]."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(1, k + 8, generator=gen)[:, 3:3 + k].to(dtype).to(device)
    weight = (torch.randn(2 * inter, k, generator=gen) / k**0.5).to(dtype).to(device)
    return x, weight


def _two_launches(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return fused_ops.silu_mul(skinny_matmul.skinny_linear(x, weight), fused=True)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("inter", "k", "short_k"),
                         [(37, 100, False), (64, 256, False), (6, 24, False),
                          (37, 100, True), (16, 128, True)])
def test_same_bits_as_the_product_then_silu(device: torch.device, gated_on: None,
                                           monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype,
                                           inter: int, k: int, short_k: bool) -> None:
    if short_k:
        _table_with(monkeypatch, SHORT_K)
    x, weight = _operands(inter, k, dtype, device, seed=inter + k)
    hidden = gated_linear(x, weight)
    assert hidden.shape == (1, inter) and hidden.dtype == dtype
    assert torch.equal(hidden, _two_launches(x, weight))
    gate, up = (x.double() @ weight.double().t()).split(inter, dim=1)
    reference = torch.nn.functional.silu(gate) * up
    error = ((hidden.double() - reference).norm() / reference.norm()).item()
    assert error < 2e-2, error


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_same_bits_in_the_wide_class(device: torch.device, gated_on: None,
                                     dtype: torch.dtype) -> None:
    """Gate/up products of more than 8,192 rows take the table's "wide" one-row entry (its own
    K block), with an I tail."""
    if interpreter_mode():
        pytest.skip("thousands of programs: slow under the interpreter")
    inter, k = 4100, 2048 + 64
    assert skinny_matmul.shape_class(1, 2 * inter, k) == ("1", "wide")
    x, weight = _operands(inter, k, dtype, device, seed=5)
    assert torch.equal(gated_linear(x, weight), _two_launches(x, weight))


def test_the_table_picks_the_one_row_pairs(gated_on: None,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    assert gated_config(1, 2 * 14336, 4096) == skinny_matmul.default_config(1, 2 * 14336, 4096)
    assert gated_config(1, 2 * 512, 256) is not None
    assert gated_config(2, 2 * 512, 256) is None, "more than one row: product then SiLU"
    assert gated_config(1, 2 * 512 + 1, 256) is None, "an odd row count has no gate/up halves"
    _table_with(monkeypatch, SkinnyConfig("reduce", block_n=1, block_k=64))
    assert gated_config(1, 1024, 256) is None, "a row block that holds no whole pair"
    _table_with(monkeypatch, SkinnyConfig("dot", block_n=16, block_k=32))
    assert gated_config(1, 1024, 256) is None, "the dot kernel has no gated form"
    _table_with(monkeypatch, None)
    assert gated_config(1, 1024, 256) is None, "F.linear's shapes stay F.linear"
    monkeypatch.undo()
    skinny_matmul.GATED = False
    assert gated_config(1, 1024, 256) is None, "the switch off"


def test_the_routing_takes_cuda_rows_the_product_would(gated_on: None) -> None:
    cpu_x, cpu_w = torch.randn(1, 64, dtype=torch.bfloat16), torch.randn(128, 64,
                                                                         dtype=torch.bfloat16)
    assert not gated_routable(cpu_x, cpu_w, 1), "the CPU keeps its own product"
    if not torch.cuda.is_available():
        return
    x, w = cpu_x.cuda(), cpu_w.cuda()
    assert gated_routable(x, w, 1)
    assert not gated_routable(x, w, 0), "the skinny product off"
    assert not gated_routable(x.float(), w.float(), 1), "float32 stays F.linear"
    assert not gated_routable(torch.cat([x, x]), w, 4), "two rows"


def test_refuses_what_it_cannot_take(device: torch.device, gated_on: None) -> None:
    x, weight = _operands(8, 32, torch.float16, device, seed=1)
    with pytest.raises(ValueError, match="one row"):
        gated_linear(torch.cat([x, x]), weight)
    with pytest.raises(ValueError, match="one row"):
        gated_linear(x, weight[:-1])
    with pytest.raises(ValueError, match="one dtype"):
        gated_linear(x, weight.float())


def _decode_logits(model: Model) -> list[torch.Tensor]:
    """A one-row decode step's logits at context 41, replayed three times from a CUDA graph."""
    plan = StepPlan([SequenceSlice(0, [17], 40, [1, 2, 3], sample=True)])
    cache = Cache(model, max_tokens=8 * 16, page_size=16)
    graphs = StepGraphs(model, cache.storage, get_backend("triton", model.device), page_size=16,
                        max_context=64, buckets=[1], compile_model=False)
    return [graphs.run(plan).clone() for _ in range(3)]


def test_model_logits_same_bits_on_and_off(bf16_fused_model: Model, gated_on: None) -> None:
    on = _decode_logits(bf16_fused_model)
    skinny_matmul.GATED = False
    off = _decode_logits(bf16_fused_model)
    assert all(torch.isfinite(logits).all() for logits in on)
    for with_it, without in zip(on, off, strict=True):
        assert torch.equal(with_it, without)


def test_a_generators_mixture_ends_the_same(bf16_fused_model: Model, bf16_fused_folder: Path,
                                            gated_on: None) -> None:
    model = bf16_fused_model
    tokenizer = Tokenizer.from_model_dir(bf16_fused_folder)
    finals = {}
    for on in (False, True):
        skinny_matmul.GATED = on
        generator = DynamicGenerator(model=model, cache=Cache(model, max_tokens=4096),
                                     tokenizer=tokenizer)
        mixture = run_mixed_jobs(generator)
        alone = Job(input_ids=list(range(20, 80)), max_new_tokens=12, stop_conditions=[],
                    identifier="alone", gen_settings=SamplerSettings.greedy())
        final = run_to_finals(generator, [alone])["alone"]
        assert final["eos_reason"] == "max_new_tokens" and len(alone.new_token_ids) == 12
        finals[on] = (mixture, list(alone.new_token_ids), final["full_completion"])
        generator.check_invariant()
    assert finals[True] == finals[False]


def test_a_chain_replays_from_a_graph(cuda_device: torch.device, gated_on: None) -> None:
    """norm -> gated launch, ten times over, eagerly and replayed from a CUDA graph: the same
    bits as the two-launch chain."""
    gen = torch.Generator(device=cuda_device).manual_seed(0)
    hidden = 512
    weights = [torch.randn(2 * hidden, hidden, device=cuda_device, generator=gen,
                           dtype=torch.bfloat16) / hidden**0.5 for _ in range(10)]
    norm = torch.ones(hidden, device=cuda_device, dtype=torch.bfloat16)
    x = torch.randn(1, hidden, device=cuda_device, generator=gen, dtype=torch.bfloat16)

    def chain(launch: bool) -> torch.Tensor:
        y = x
        for weight in weights:
            normed = fused_ops.rms_norm(y, norm, 1e-5, fused=True)
            y = gated_linear(normed, weight) if launch else _two_launches(normed, weight)
        return y

    expected = chain(False)
    assert torch.equal(chain(True), expected)
    graph = torch.cuda.CUDAGraph()
    chain(True)
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        out = chain(True)
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, expected)
