"""The Triton skinny matmul (`ops.skinny_matmul`) against a float64 product: both kernels,
every row count 1..16, bf16 and fp16,
with and without bias, K and N tails (K not a multiple of the K block, or shorter than one; N
not a multiple of the N block), x rows strided, outputs written into a poisoned larger buffer
(nothing outside [M, N] may change). The custom op passes torch's opcheck; on CUDA the routed
product also runs inside torch.compile(dynamic=True) and a replayed CUDA graph. Runs on CUDA,
or on the CPU under TRITON_INTERPRET=1 (small shapes)."""

from __future__ import annotations

import pytest
import torch

from dyngen_core.ops.skinny_matmul import SkinnyConfig, launch, linear, skinny_linear
from tests.gpu.conftest import interpreter_mode

pytestmark = pytest.mark.gpu

MAX_ROWS = 16
CONFIGS = {"reduce": SkinnyConfig("reduce", block_n=8, block_k=64, num_stages=3),
           # The one-row table's narrow form: 4 rows of W a program, 2 warps, 4 stages.
           "reduce_two_warps": SkinnyConfig("reduce", block_n=4, block_k=32, num_stages=4,
                                            num_warps=2),
           "dot": SkinnyConfig("dot", block_n=16, block_k=32, num_stages=2)}
TOLERANCE = {torch.bfloat16: 1e-2, torch.float16: 2e-3}


def _operands(rows: int, n: int, k: int, dtype: torch.dtype, device: torch.device, *,
              bias: bool, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """x [rows, k] as a row-strided view (stride k + 8), weight [n, k], bias [n] or None."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k + 8, generator=gen)[:, 3:3 + k].to(dtype).to(device)
    weight = (torch.randn(n, k, generator=gen) / k**0.5).to(dtype).to(device)
    b = torch.randn(n, generator=gen).to(dtype).to(device) if bias else None
    return x, weight, b


def _relative_error(y: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                    bias: torch.Tensor | None) -> float:
    reference = x.double() @ weight.double().t()
    if bias is not None:
        reference += bias.double()
    return ((y.double() - reference).norm() / reference.norm()).item()


def _skip_interpreter_bf16_dot(kernel: str, dtype: torch.dtype) -> None:
    if interpreter_mode() and kernel == "dot" and dtype == torch.bfloat16:
        # Triton 3.6's interpreter multiplies bf16 tl.dot operands as raw bits (errors ~1e10
        # on a plain 16x16 product); the kernel itself is checked in bf16 on CUDA.
        pytest.skip("the Triton interpreter's tl.dot is wrong for bf16")


@pytest.mark.parametrize("kernel", list(CONFIGS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("n", "k", "bias"), [(37, 100, True), (48, 128, False), (20, 24, True)])
def test_every_row_count_matches_float64(device: torch.device, kernel: str, dtype: torch.dtype,
                                         n: int, k: int, bias: bool) -> None:
    _skip_interpreter_bf16_dot(kernel, dtype)
    config = CONFIGS[kernel]
    for rows in range(1, MAX_ROWS + 1):
        x, weight, b = _operands(rows, n, k, dtype, device, bias=bias, seed=rows)
        poisoned = torch.full((rows + 2, n + 5), float("nan"), dtype=dtype, device=device)
        out = poisoned[1:rows + 1, 2:n + 2]
        launch(x, weight, b, out, config)
        assert torch.isfinite(out).all(), f"rows={rows}: output left unwritten"
        border = poisoned.clone()
        border[1:rows + 1, 2:n + 2] = 0
        assert border.isnan().sum() == border.numel() - rows * n, f"rows={rows}: wrote outside"
        error = _relative_error(out, x, weight, b)
        assert error < TOLERANCE[dtype], f"rows={rows}: relative error {error}"


@pytest.mark.parametrize("kernel", ["reduce", "dot"])
def test_rows_in_several_blocks(device: torch.device, kernel: str) -> None:
    """More rows than one program's BLOCK_M (4 for reduce, 16 for dot): row blocks along the
    grid's second axis."""
    rows = 35 if kernel == "dot" else 7
    x, weight, b = _operands(rows, 40, 96, torch.float16, device, bias=True, seed=9)
    y = torch.empty(rows, 40, dtype=torch.float16, device=device)
    launch(x, weight, b, y, SkinnyConfig(kernel, block_n=16, block_k=32))
    assert _relative_error(y, x, weight, b) < TOLERANCE[torch.float16]


def test_default_configs_match_float64(device: torch.device) -> None:
    """`skinny_linear` without a config (the shape-class defaults), small and tail shapes."""
    n, k = (4104, 4096) if device.type == "cuda" else (72, 64)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float16
    for rows in (1, 2, 3, 4, 5, 16):
        x, weight, b = _operands(rows, n, k, dtype, device, bias=rows % 2 == 1, seed=rows)
        error = _relative_error(skinny_linear(x, weight, b), x, weight, b)
        assert error < TOLERANCE[dtype], f"rows={rows}: relative error {error}"


def test_rejects_operands_it_cannot_take(device: torch.device) -> None:
    x, weight, _ = _operands(2, 16, 32, torch.float16, device, bias=False, seed=0)
    with pytest.raises(ValueError, match="one dtype"):
        skinny_linear(x, weight.float())
    with pytest.raises(ValueError, match="contiguous along K"):
        skinny_linear(x, weight.t().contiguous().t())
    with pytest.raises(ValueError, match=r"x \[M >= 1, K\]"):
        skinny_linear(x[:, :16], weight)


def test_custom_op_passes_opcheck(device: torch.device) -> None:
    x, weight, b = _operands(3, 24, 64, torch.float16, device, bias=True, seed=1)
    torch.library.opcheck(torch.ops.dyngen.skinny_linear.default, (x, weight, b))
    torch.library.opcheck(torch.ops.dyngen.skinny_linear.default, (x, weight, None))


def test_custom_op_compiles_once_for_every_row_count(device: torch.device) -> None:
    """torch.compile(dynamic=True) traces the op through its fake implementation with the
    row count symbolic: one graph serves 2 to 16 rows."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    _, weight, b = _operands(1, 40, 64, torch.float16, device, bias=True, seed=2)
    product = torch.compile(lambda x: torch.ops.dyngen.skinny_linear(x, weight, b) * 2,
                            dynamic=True, backend="aot_eager", fullgraph=True)
    for rows in (3, 5, 16, 2):
        x = _operands(rows, 40, 64, torch.float16, device, bias=False, seed=rows)[0]
        y = product(x.contiguous())
        assert _relative_error(y / 2, x, weight, b) < TOLERANCE[torch.float16]
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1


def test_compiled_and_graphed_route_matches_f_linear(cuda_device: torch.device) -> None:
    """The routed product inside torch.compile(dynamic=True), captured in a CUDA graph and
    replayed with new inputs, for a skinny and a wide batch (the latter stays F.linear)."""
    gen = torch.Generator(device=cuda_device).manual_seed(0)
    weight = torch.randn(1000, 512, generator=gen, device=cuda_device, dtype=torch.bfloat16)
    bias = torch.randn(1000, generator=gen, device=cuda_device, dtype=torch.bfloat16)
    step = torch.compile(lambda x: linear(x, weight, bias, skinny_rows=MAX_ROWS), dynamic=True)
    for rows in (24, 16, 5):
        static_x = torch.randn(rows, 512, generator=gen, device=cuda_device, dtype=torch.bfloat16)
        for _ in range(3):
            step(static_x)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_y = step(static_x)
        static_x.copy_(torch.randn(rows, 512, generator=gen, device=cuda_device,
                                   dtype=torch.bfloat16))
        graph.replay()
        error = _relative_error(static_y, static_x, weight, bias)
        assert error < TOLERANCE[torch.bfloat16], f"rows={rows}: relative error {error}"
