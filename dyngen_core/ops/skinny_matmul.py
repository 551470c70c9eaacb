"""The skinny matrix product: y = x @ W^T (+ bias) for x with few rows (decode steps), through
a Triton kernel that streams W once at full memory bandwidth, and the routing the layers call
instead of ``F.linear``.

Why: at batch 1 a decode step is weight reads (15 GB for Llama-3-8B). cuBLAS reads the q/k/v
and output projections at ~3.1 TB/s and adds split-K reduce kernels; the kernels of
`skinny_matmul_kernel` read each weight once, with no second launch.

`linear(x, weight, bias, skinny_rows=...)` is what the layers call: it takes the Triton path
only for a 2-D CUDA x in bf16/fp16 (weight in the same dtype) with 1..skinny_rows rows;
everything else (CPU, float32, prefill) is ``F.linear`` unchanged. ``skinny_rows`` is 0 (off)
unless the model is told otherwise (`Model.set_skinny_matmul`, or the runner's and generator's
``skinny_matmul_rows``), and is resolved to 0 where triton cannot run (`skinny_rows_for`).

Inside ``torch.compile`` the product is the custom op ``torch.ops.dyngen.skinny_linear`` (opaque
to the compiler; its fake implementation gives the output's shape); eager calls launch directly,
without the dispatcher's overhead. A launch allocates only its output and depends on the shapes
alone, so it is captured in CUDA graphs like any kernel.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import torch
import torch.nn.functional as F

from dyngen_core.ops.triton_support import launch_device, triton_by_default

HALF_DTYPES = (torch.bfloat16, torch.float16)
KERNELS = ("reduce", "dot")
# The reduce kernel handles up to this many rows in one row block (more rows re-read W).
REDUCE_MAX_BLOCK_M = 4


@dataclass(frozen=True)
class SkinnyConfig:
    """One launch configuration.

    kernel: "reduce" (broadcast-multiply and sum over K; best for 1 to 4 rows) or "dot"
        (tensor-core products, x padded to 16 rows).
    block_n: rows of W per program (a power of two; at least 16 for "dot").
    block_k: columns of K per loop step (a power of two; 8 bf16 per thread per load is 16 B).
    num_warps: warps per program.
    num_stages: software-pipelining depth of the K loop (1: loads issued in the loop body).
    block_m: rows of x per program; 0 picks the rows rounded up to a power of two (at most
        `REDUCE_MAX_BLOCK_M`) for "reduce", 16 for "dot".
    prefetch: ("reduce" only) load the next K tile into registers before multiplying this one,
        instead of ``num_stages`` pipelining through shared memory.
    """

    kernel: str
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 1
    block_m: int = 0
    prefetch: bool = False

    def __post_init__(self) -> None:
        if self.kernel not in KERNELS:
            raise ValueError(f"SkinnyConfig.kernel must be one of {KERNELS}; got {self.kernel!r}")
        for name in ("block_n", "block_k"):
            value = getattr(self, name)
            if value < 1 or value & (value - 1):
                raise ValueError(f"SkinnyConfig.{name} must be a power of two; got {value}")
        if self.kernel == "dot" and (self.block_n < 16 or self.block_k < 16 or self.prefetch):
            raise ValueError("SkinnyConfig: the dot kernel needs block_n and block_k >= 16, "
                             "and pipelines with num_stages (prefetch=False)")

    def rows_per_program(self, rows: int) -> int:
        """BLOCK_M for a product of ``rows`` rows."""
        if self.block_m:
            return self.block_m
        if self.kernel == "dot":
            return 16
        return min(_next_pow2(rows), REDUCE_MAX_BLOCK_M)


# Launch configuration per shape class (`shape_class`): rows "1", "2-4" or "5+" by weight
# "narrow" (N and K <= 8192: q/k/v, output), "long_k" (N <= 8192 < K: down) or "wide"
# (N > 8192: gate/up, lm_head). None: F.linear, where cuBLAS is as fast. Set from the sweep of
# benchmarks/skinny_matmul.py on the H200, which prints this table.
DEFAULT_CONFIGS: Mapping[tuple[str, str], SkinnyConfig | None] = MappingProxyType({
    # Measured by benchmarks/skinny_matmul.py on an H200 (2026-12-01; us per launch over the
    # Llama-3-8B shapes of the class, weights rotated past L2, kernel vs F.linear).
    ("1", "narrow"): SkinnyConfig("reduce", block_n=8, block_k=512),  # 884 vs 952
    ("1", "long_k"): SkinnyConfig("reduce", block_n=8, block_k=512, num_stages=3),  # 986 vs 1028
    ("1", "wide"): SkinnyConfig("reduce", block_n=8, block_k=512, num_stages=3),  # 2103 vs 2110
    ("2-4", "narrow"): None,  # 1994 vs 1902
    ("2-4", "long_k"): None,  # 2203 vs 2071
    ("2-4", "wide"): None,  # 4390 vs 4215
    ("5+", "narrow"): SkinnyConfig("dot", block_n=64, block_k=128, num_stages=6),  # 1817 vs 1889
    ("5+", "long_k"): None,  # 2182 vs 2117
    ("5+", "wide"): SkinnyConfig("dot", block_n=64, block_k=128, num_stages=4),  # 4344 vs 4413
})

# The row cut-off models start with on CUDA: one row (batch-1 decode) is where the kernel
# beats cuBLAS across the layer set (3.95 vs 4.09 ms of products per step on the H200); at
# 2-16 rows it saves at most 0.12 ms per step and loses on some shapes.
DEFAULT_SKINNY_ROWS = 1


def shape_class(rows: int, n: int, k: int) -> tuple[str, str]:
    """The `DEFAULT_CONFIGS` key of a [rows, k] x [n, k]^T product."""
    row_class = "1" if rows == 1 else "2-4" if rows <= REDUCE_MAX_BLOCK_M else "5+"
    weight_class = "wide" if n > 8192 else "long_k" if k > 8192 else "narrow"
    return row_class, weight_class


def default_config(rows: int, n: int, k: int) -> SkinnyConfig | None:
    """The launch configuration of a [rows, k] x [n, k]^T product (`DEFAULT_CONFIGS`); None
    where ``F.linear`` is as fast."""
    return DEFAULT_CONFIGS[shape_class(rows, n, k)]


def skinny_rows_for(device: torch.device, rows: int) -> int:
    """The row cut-off to use on ``device``: ``rows`` where the Triton kernel runs by default
    (CUDA with triton installed), else 0 (every product stays ``F.linear``)."""
    if rows < 0:
        raise ValueError(f"skinny_matmul_rows must be >= 0 (0 turns it off); got {rows}")
    return rows if rows and triton_by_default(device) else 0


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
           skinny_rows: int = 0) -> torch.Tensor:
    """``F.linear(x, weight, bias)``, through the Triton kernel when x is a 2-D CUDA tensor of
    1..``skinny_rows`` rows in bf16/fp16 with weight (and bias) in the same dtype, both
    contiguous along K. ``skinny_rows``: the cut-off (0: always ``F.linear``); resolve it with
    `skinny_rows_for` once, not per call."""
    if skinny_rows and _routable(x, weight, bias, skinny_rows):
        if torch.compiler.is_compiling():
            return torch.ops.dyngen.skinny_linear(x, weight, bias)
        return skinny_linear(x, weight, bias)
    return F.linear(x, weight, bias)


def _routable(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
              skinny_rows: int) -> bool:
    return (x.is_cuda and x.dim() == 2 and x.dtype in HALF_DTYPES and weight.dtype == x.dtype
            and (bias is None or bias.dtype == x.dtype) and 1 <= x.shape[0] <= skinny_rows
            and x.stride(1) == 1 and weight.stride(1) == 1)


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  config: SkinnyConfig | None = None) -> torch.Tensor:
    """y = x @ weight^T (+ bias) through the Triton kernel, y [M, N] in x's dtype (through
    ``F.linear`` when no config is given and `default_config` has none for the shape).

    x: [M, K], M >= 1, last dimension contiguous (rows may be strided).
    weight: [N, K], last dimension contiguous, same dtype as x.
    bias: [N] or None.
    config: the launch configuration; None picks `default_config` for the shape.

    Raises ValueError for shapes or dtypes the kernel does not take.
    """
    _check_operands(x, weight, bias)
    rows, n = x.shape[0], weight.shape[0]
    config = config or default_config(rows, n, x.shape[1])
    if config is None:
        return F.linear(x, weight, bias)
    out = torch.empty(rows, n, device=x.device, dtype=x.dtype)
    launch(x, weight, bias, out, config)
    return out


def launch(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
           out: torch.Tensor, config: SkinnyConfig) -> None:
    """Write x @ weight^T (+ bias) into ``out`` [M, N] (last dimension contiguous) with one
    kernel launch of ``config`` (operands as `skinny_linear` takes them, unchecked)."""
    from dyngen_core.ops import skinny_matmul_kernel as kernels

    rows, n = x.shape[0], weight.shape[0]
    block_m = config.rows_per_program(rows)
    kernel = (kernels.skinny_reduce_kernel if config.kernel == "reduce"
              else kernels.skinny_dot_kernel)
    grid = (-(-n // config.block_n), -(-rows // block_m))
    # Triton launches on the current device: a layer on another GPU needs its own.
    with launch_device(x.device):
        _launch(kernel, grid, x, weight, bias, out, config, block_m)


def _launch(kernel: Any, grid: tuple[int, int], x: torch.Tensor, weight: torch.Tensor,
            bias: torch.Tensor | None, out: torch.Tensor, config: SkinnyConfig,
            block_m: int) -> None:
    rows, k = x.shape
    extra = {"PREFETCH": config.prefetch} if config.kernel == "reduce" else {}
    kernel[grid](
        x, weight, weight if bias is None else bias, out,
        rows, weight.shape[0], k, x.stride(0), weight.stride(0), out.stride(0),
        HAS_BIAS=bias is not None, EVEN_K=k % config.block_k == 0,
        BLOCK_M=block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        NUM_STAGES=config.num_stages, num_warps=config.num_warps, num_stages=config.num_stages,
        **extra,
    )


def _check_operands(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1] or x.shape[0] < 1:
        raise ValueError(f"skinny_linear needs x [M >= 1, K] and weight [N, K]; got x "
                         f"{tuple(x.shape)}, weight {tuple(weight.shape)}")
    if x.dtype != weight.dtype or (bias is not None and bias.dtype != x.dtype):
        raise ValueError(f"skinny_linear needs x, weight and bias in one dtype; got {x.dtype}, "
                         f"{weight.dtype}, {None if bias is None else bias.dtype}")
    if x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError("skinny_linear needs x and weight contiguous along K (call "
                         ".contiguous() first)")
    if bias is not None and (bias.shape != (weight.shape[0],) or bias.stride(0) != 1):
        raise ValueError(f"skinny_linear needs a contiguous bias of shape ({weight.shape[0]},); "
                         f"got {tuple(bias.shape)}")


def _next_pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


@torch.library.custom_op("dyngen::skinny_linear", mutates_args=())
def skinny_linear_op(x: torch.Tensor, weight: torch.Tensor,
                     bias: torch.Tensor | None) -> torch.Tensor:
    """`skinny_linear` with the default configuration, as an op torch.compile does not trace.
    The compiled graph chooses its buffers' layouts: x gets a copy in the rare case its rows
    arrive strided along K (the routing checked the traced layout)."""
    return skinny_linear(x if x.stride(1) == 1 else x.contiguous(), weight, bias)


@skinny_linear_op.register_fake
def _skinny_linear_fake(x: torch.Tensor, weight: torch.Tensor,
                        bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty((x.shape[0], weight.shape[0]))
