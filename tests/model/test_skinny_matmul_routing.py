"""Routing of the matrix products between ``F.linear`` and the Triton skinny matmul, on the CPU:
which products take the kernel (checked on fake CUDA tensors, so no GPU is needed), that CPU
products give ``F.linear``'s values (few rows through `cpu_linear`, more exactly), how the
option reaches every layer through `Model.set_skinny_matmul` and the runner, and the custom
op's fake implementation under symbolic shapes (torch.export)."""

from __future__ import annotations

from typing import cast

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

from dyngen_core.config import ModelConfig
from dyngen_core.kv.attention import SdpaBackend
from dyngen_core.kv.cache import Cache
from dyngen_core.model import Model
from dyngen_core.model.layers import DecoderLayer
from dyngen_core.ops import skinny_matmul as sm
from dyngen_core.runtime.runner import ModelRunner

CONFIG = ModelConfig(architecture="LlamaForCausalLM", vocab_size=64, hidden_size=32,
                     intermediate_size=48, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8)


@pytest.fixture
def kernel_calls(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, ...]]:
    """Replace the kernel by a recorder of the operand shapes it was called with."""
    calls: list[tuple[int, ...]] = []

    def record(x: torch.Tensor, weight: torch.Tensor,
               bias: torch.Tensor | None = None) -> torch.Tensor:
        calls.append((*x.shape, weight.shape[0]))
        return x.new_empty((x.shape[0], weight.shape[0]))

    monkeypatch.setattr(sm, "skinny_linear", record)
    return calls


def _fake_cuda(*shape: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device="cuda")


def test_skinny_half_precision_cuda_products_take_the_kernel(
        kernel_calls: list[tuple[int, ...]]) -> None:
    with FakeTensorMode():
        weight = _fake_cuda(40, 64)
        for rows in (1, 7, 16):
            sm.linear(_fake_cuda(rows, 64), weight, skinny_rows=16)
        sm.linear(_fake_cuda(3, 64, dtype=torch.float16), _fake_cuda(40, 64, dtype=torch.float16),
                  _fake_cuda(40, dtype=torch.float16), skinny_rows=16)
    assert kernel_calls == [(1, 64, 40), (7, 64, 40), (16, 64, 40), (3, 64, 40)]


def test_other_products_stay_f_linear(kernel_calls: list[tuple[int, ...]]) -> None:
    with FakeTensorMode():
        weight = _fake_cuda(40, 64)
        sm.linear(_fake_cuda(17, 64), weight, skinny_rows=16)  # past the cut-off
        sm.linear(_fake_cuda(1, 64), weight, skinny_rows=0)  # option off
        sm.linear(_fake_cuda(0, 64), weight, skinny_rows=16)  # no rows
        sm.linear(_fake_cuda(2, 64, dtype=torch.float32), weight.float(), skinny_rows=16)
        sm.linear(_fake_cuda(2, 64), weight.float(), skinny_rows=16)  # mixed dtypes
        sm.linear(_fake_cuda(2, 3, 64), weight, skinny_rows=16)  # not 2-D
        sm.linear(_fake_cuda(64, 2).t(), weight, skinny_rows=16)  # x strided along K
        sm.linear(torch.empty(2, 64, dtype=torch.bfloat16), torch.empty(40, 64,
                  dtype=torch.bfloat16), skinny_rows=16)  # CPU
    assert kernel_calls == []


def test_cpu_products_equal_f_linear(kernel_calls: list[tuple[int, ...]]) -> None:
    """Few rows: `cpu_linear` (the same products summed in another order); more: F.linear."""
    gen = torch.Generator().manual_seed(0)
    for dtype, tolerance in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        weight, bias = torch.randn(24, 32, generator=gen).to(dtype), torch.randn(24).to(dtype)
        x = torch.randn(3, 32, generator=gen).to(dtype)
        torch.testing.assert_close(sm.linear(x, weight, bias, skinny_rows=16),
                                   F.linear(x, weight, bias), rtol=tolerance, atol=tolerance)
        tall = torch.randn(sm.CPU_SWAPPED_MAX_ROWS + 1, 32, generator=gen).to(dtype)
        assert torch.equal(sm.linear(tall, weight, bias, skinny_rows=16),
                           F.linear(tall, weight, bias))
    assert kernel_calls == []


def test_set_skinny_matmul_resolves_to_off_on_the_cpu() -> None:
    model = Model(CONFIG, device=torch.device("cpu"), dtype=torch.float32)
    model.set_skinny_matmul(16)
    assert model.skinny_rows == 0 and _layer_rows(model) == [(0, 0), (0, 0)]
    with pytest.raises(ValueError, match="skinny_matmul_rows must be >= 0"):
        model.set_skinny_matmul(-1)


def test_runner_option_reaches_every_layer(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sm, "triton_by_default", lambda device: True)
    model = Model(CONFIG, device=torch.device("cpu"), dtype=torch.float32)
    cache = Cache(model, max_tokens=512)
    ModelRunner(model, cache, SdpaBackend(), cuda_graphs=False, skinny_matmul_rows=8)
    assert model.skinny_rows == 8 and _layer_rows(model) == [(8, 8), (8, 8)]
    ModelRunner(model, cache, SdpaBackend(), cuda_graphs=False)  # None: left as it is
    assert model.skinny_rows == 8
    ModelRunner(model, cache, SdpaBackend(), cuda_graphs=False, skinny_matmul_rows=0)
    assert model.skinny_rows == 0 and _layer_rows(model) == [(0, 0), (0, 0)]


def _layer_rows(model: Model) -> list[tuple[int, int]]:
    """(attention, MLP) cut-off of every decoder layer."""
    layers = [cast(DecoderLayer, layer) for layer in model.layers]
    return [(layer.attn.skinny_rows, layer.mlp.skinny_rows) for layer in layers]


def test_fake_impl_gives_symbolic_shapes() -> None:
    class Product(torch.nn.Module):
        def forward(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
            return torch.ops.dyngen.skinny_linear(x, weight, None)

    rows = torch.export.Dim("rows", min=2, max=16)
    exported = torch.export.export(
        Product(), (torch.empty(3, 32, dtype=torch.bfloat16),
                    torch.empty(24, 32, dtype=torch.bfloat16)),
        dynamic_shapes={"x": {0: rows}, "weight": None})
    nodes = [n for n in exported.graph.nodes if n.target is torch.ops.dyngen.skinny_linear.default]
    assert len(nodes) == 1
    value = nodes[0].meta["val"]
    assert isinstance(value.shape[0], torch.SymInt)
    assert value.shape[1] == 24 and value.dtype == torch.bfloat16


def test_every_shape_class_has_an_entry_and_none_means_f_linear(
        monkeypatch: pytest.MonkeyPatch) -> None:
    shapes = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (128256, 4096)]
    for rows in (1, 3, 4, 5, 16, 40):
        for n, k in shapes:
            assert sm.shape_class(rows, n, k) in sm.DEFAULT_CONFIGS
    assert sm.shape_class(1, 4096, 14336) == ("1", "long_k")
    assert sm.shape_class(3, 128256, 4096) == ("2-4", "wide")

    def no_launch(*args: object) -> None:
        raise AssertionError("launched a kernel where the table says F.linear")

    monkeypatch.setattr(sm, "launch", no_launch)
    monkeypatch.setattr(sm, "DEFAULT_CONFIGS", {key: None for key in sm.DEFAULT_CONFIGS})
    gen = torch.Generator().manual_seed(1)
    x, weight = torch.randn(2, 32, generator=gen), torch.randn(24, 32, generator=gen)
    assert torch.equal(sm.skinny_linear(x, weight), F.linear(x, weight))


def test_config_rejects_what_the_kernels_cannot_launch() -> None:
    with pytest.raises(ValueError, match="kernel must be one of"):
        sm.SkinnyConfig("gemv", block_n=8, block_k=256)
    with pytest.raises(ValueError, match="block_k must be a power of two"):
        sm.SkinnyConfig("reduce", block_n=8, block_k=384)
    with pytest.raises(ValueError, match="num_warps must be a power of two"):
        sm.SkinnyConfig("reduce", block_n=8, block_k=256, num_warps=3)
    with pytest.raises(ValueError, match="dot kernel needs block_n and block_k >= 16"):
        sm.SkinnyConfig("dot", block_n=8, block_k=256)
    assert sm.SkinnyConfig("reduce", 8, 256).rows_per_program(3) == 4
    assert sm.SkinnyConfig("reduce", 8, 256).rows_per_program(9) == sm.REDUCE_MAX_BLOCK_M
    assert sm.SkinnyConfig("dot", 16, 256).rows_per_program(1) == 16
