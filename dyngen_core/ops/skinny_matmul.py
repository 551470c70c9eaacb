"""The skinny matrix product: y = x @ W^T (+ bias) for x with few rows (decode steps), through
Triton kernels that stream W once with 16-byte loads and no split-K reduce launch, its torch twin
(``F.linear``), and the routing the layers call.

`linear(x, weight, bias, skinny_rows=...)` is what the layers call: it takes the Triton path
only for a 2-D CUDA x in bf16/fp16 (weight in the same dtype) with 1..skinny_rows rows; on the
CPU, products of up to `CPU_SWAPPED_MAX_ROWS` rows are `cpu_linear` (the weight as the long
side of the output); everything else is ``F.linear`` unchanged. ``skinny_rows`` is 0 (off)
unless the model is told otherwise (`Model.set_skinny_matmul`, or the runner's and generator's
``skinny_matmul_rows``), and is resolved to 0 where triton cannot run (`skinny_rows_for`).

The kernels read W [N, K] row-major, as ``F.linear`` takes it, once per launch (when the rows of
x fit one row block), accumulate in float32 and write y [M, N] in x's dtype:

- `skinny_reduce_kernel`: broadcast-multiply and sum over K, for 1 to 4 rows. Products
  accumulate element-wise in a [BLOCK_M, BLOCK_N, BLOCK_K] register tile and are summed over K
  once after the loop, so the loop body is loads and FMAs only; ``NUM_STAGES`` > 1 has Triton
  pipeline the loop through shared memory.
- `skinny_dot_kernel`: tensor-core products with the roles swapped (W's rows are the long side:
  acc[BLOCK_N, BLOCK_M] += W_tile @ x_tile^T), x padded to BLOCK_M = 16 rows.

Out-of-range rows of W (the N tail) and of x are clamped to the last valid row instead of
masked, so the K loop carries no row masks; their results are dropped by the masked store. A K
tail is masked only when K is not a multiple of BLOCK_K (``EVEN_K`` false).

Inside ``torch.compile`` the product is the custom op ``torch.ops.dyngen.skinny_linear`` (opaque
to the compiler; its fake implementation gives the output's shape); eager calls launch directly,
without the dispatcher's overhead. A launch allocates only its output and depends on the shapes
alone, so it is captured in CUDA graphs like any kernel. Which shapes take which launch is the
table `DEFAULT_CONFIGS` (benchmarks/kernels/skinny_matmul.py measures it against cuBLAS and
benchmarks/kernels/skinny_sweep.py sweeps its one-row settings; BENCHMARKS.md, section 1).

The gated MLP's one-row gate/up product and its SiLU are one launch, `gated_linear`
(`skinny_gated_kernel`, while `GATED` is on): each program reads its gate rows and the matching
up rows as interleaved (gate, up) pairs of one tile of the product's one-row shape, so every
output is summed in the same order as the product's and rounded as the product writes it, and
silu(gate) * up is the bits of the product followed by `fused_ops.silu_mul`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

import torch
import torch.nn.functional as F

from dyngen_core.ops.fused_ops import silu_times_up
from dyngen_core.ops.triton_support import (
    launch_device,
    tl,
    triton,
    triton_by_default,
)

HALF_DTYPES = (torch.bfloat16, torch.float16)
KERNELS = ("reduce", "dot")
# The reduce kernel handles up to this many rows in one row block (more rows re-read W).
REDUCE_MAX_BLOCK_M = 4


@dataclass(frozen=True)
class SkinnyConfig:
    """One launch configuration.

    kernel: "reduce" (broadcast-multiply and sum over K; 1 to 4 rows) or "dot" (tensor-core
        products, x padded to 16 rows).
    block_n: rows of W per program (a power of two; at least 16 for "dot").
    block_k: columns of K per loop step (a power of two; 8 bf16 per thread per load is 16 B).
    num_stages: software-pipelining depth of the K loop (1: loads issued in the loop body).
    num_warps: warps per program (a power of two).
    """

    kernel: str
    block_n: int
    block_k: int
    num_stages: int = 1
    num_warps: int = 4

    def __post_init__(self) -> None:
        if self.kernel not in KERNELS:
            raise ValueError(f"SkinnyConfig.kernel must be one of {KERNELS}; got {self.kernel!r}")
        for name in ("block_n", "block_k", "num_warps"):
            value = getattr(self, name)
            if value < 1 or value & (value - 1):
                raise ValueError(f"SkinnyConfig.{name} must be a power of two; got {value}")
        if self.kernel == "dot" and (self.block_n < 16 or self.block_k < 16):
            raise ValueError("SkinnyConfig: the dot kernel needs block_n and block_k >= 16")

    def rows_per_program(self, rows: int) -> int:
        """BLOCK_M for a product of ``rows`` rows: 16 for "dot", else the rows rounded up to a
        power of two, at most `REDUCE_MAX_BLOCK_M`."""
        if self.kernel == "dot":
            return 16
        return min(_next_pow2(rows), REDUCE_MAX_BLOCK_M)


# Launch configuration per shape class (`shape_class`): rows "1", "2-4" or "5+" by weight
# "narrow" (N and K <= 8192: q/k/v, output), "long_k" (N <= 8192 < K: down) or "wide"
# (N > 8192: gate/up, lm_head). None: F.linear, where cuBLAS is as fast.
DEFAULT_CONFIGS: Mapping[tuple[str, str], SkinnyConfig | None] = MappingProxyType({
    ("1", "narrow"): SkinnyConfig("reduce", block_n=4, block_k=256, num_stages=4, num_warps=2),
    ("1", "long_k"): SkinnyConfig("reduce", block_n=4, block_k=256, num_stages=4, num_warps=2),
    ("1", "wide"): SkinnyConfig("reduce", block_n=4, block_k=1024, num_stages=4, num_warps=2),
    ("2-4", "narrow"): None,
    ("2-4", "long_k"): None,
    ("2-4", "wide"): None,
    ("5+", "narrow"): SkinnyConfig("dot", block_n=64, block_k=128, num_stages=6),
    ("5+", "long_k"): None,
    ("5+", "wide"): SkinnyConfig("dot", block_n=64, block_k=128, num_stages=4),
})

# The row cut-off models start with on CUDA: one row (batch-1 decode) is where the kernel
# beats cuBLAS across the layer set; at 2-16 rows it loses on some shapes.
DEFAULT_SKINNY_ROWS = 1


# silu(gate) * up of a one-row gate/up product in one launch (`gated_linear`); False: the
# product, then the fused SiLU kernel. Read at every call.
GATED = True


def shape_class(rows: int, n: int, k: int) -> tuple[str, str]:
    """The `DEFAULT_CONFIGS` key of a [rows, k] x [n, k]^T product."""
    row_class = "1" if rows == 1 else "2-4" if rows <= REDUCE_MAX_BLOCK_M else "5+"
    weight_class = "wide" if n > 8192 else "long_k" if k > 8192 else "narrow"
    return row_class, weight_class


def default_config(rows: int, n: int, k: int) -> SkinnyConfig | None:
    """The launch configuration of a [rows, k] x [n, k]^T product (`DEFAULT_CONFIGS`); None
    where ``F.linear`` is as fast."""
    return DEFAULT_CONFIGS[shape_class(rows, n, k)]


def gated_config(rows: int, n: int, k: int) -> SkinnyConfig | None:
    """The launch configuration of `gated_linear` for x [rows, k] and a gate/up weight [n, k]:
    the product's own one-row "reduce" configuration (its row block split into gate/up pairs);
    None where the product and SiLU stay two launches (`GATED` off, more than one row, an odd n,
    or no one-row reduce configuration of an even row block for the shape)."""
    if not GATED or rows != 1 or n % 2:
        return None
    config = default_config(rows, n, k)
    if config is None or config.kernel != "reduce" or config.block_n % 2:
        return None
    return config


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
    contiguous along K, and as `cpu_linear` for a 2-D CPU x of at most `CPU_SWAPPED_MAX_ROWS`
    rows. ``skinny_rows``: the cut-off (0: always ``F.linear`` on CUDA); resolve it with
    `skinny_rows_for` once, not per call."""
    if skinny_rows and _routable(x, weight, bias, skinny_rows):
        if torch.compiler.is_compiling():
            return torch.ops.dyngen.skinny_linear(x, weight, bias)
        return skinny_linear(x, weight, bias)
    if x.device.type == "cpu" and x.dim() == 2 and x.shape[0] <= CPU_SWAPPED_MAX_ROWS:
        return cpu_linear(x, weight, bias)
    return F.linear(x, weight, bias)


# On the CPU, products of at most this many rows run with the weight as the long side of the
# output (`cpu_linear`); above it ``F.linear`` is as fast (BENCHMARKS.md, "CPU products").
CPU_SWAPPED_MAX_ROWS = 128


def cpu_linear(x: torch.Tensor, weight: torch.Tensor,
               bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = x @ weight^T (+ bias) for a CPU x [M, K] with few rows, computed as the [N, M]
    product weight @ x^T: the CPU BLAS then streams the weight once, where ``F.linear``'s
    small-M product costs up to 3-4× (the same products, summed in another order). y is
    contiguous [M, N]."""
    if bias is None:
        out = torch.mm(weight, x.t())
    else:
        out = torch.addmm(bias.unsqueeze(1), weight, x.t())
    return out.t().contiguous()


def gated_routable(x: torch.Tensor, weight: torch.Tensor, skinny_rows: int) -> bool:
    """Whether `gated_linear` takes x @ weight^T (weight [2 * I, K], gate rows first) in one
    launch: `linear` would route the product to the Triton kernel (``skinny_rows``), the step is
    not being compiled, and `gated_config` has a configuration for its shape."""
    return (bool(skinny_rows) and not torch.compiler.is_compiling()
            and _routable(x, weight, None, skinny_rows)
            and gated_config(x.shape[0], weight.shape[0], x.shape[1]) is not None)


def gated_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up [1, I] of gate_up = x @ weight^T in one `skinny_gated_kernel` launch:
    the same bits as `skinny_linear` followed by `fused_ops.silu_mul` (the products rounded to
    x's dtype before the SiLU).

    x: [1, K], last dimension contiguous.
    weight: [2 * I, K], the I gate rows first, then the I up rows; last dimension contiguous,
        same dtype as x.

    Raises ValueError for operands the kernel does not take (check with `gated_routable`).
    """
    _check_operands(x, weight, None)
    rows, n, k = x.shape[0], weight.shape[0], x.shape[1]
    config = gated_config(rows, n, k)
    if config is None:
        raise ValueError(f"gated_linear takes one row and an even number of weight rows with a "
                         f"one-row reduce configuration (and GATED on); got x {tuple(x.shape)}, "
                         f"weight {tuple(weight.shape)}")
    inter = n // 2
    pairs = config.block_n // 2
    out = torch.empty(rows, inter, device=x.device, dtype=x.dtype)
    with launch_device(x.device):
        skinny_gated_kernel[(-(-inter // pairs),)](
            x, weight, out, inter, k, weight.stride(0),
            EVEN_K=k % config.block_k == 0, BLOCK_PAIRS=pairs, BLOCK_K=config.block_k,
            NUM_STAGES=config.num_stages,
            num_warps=config.num_warps, num_stages=config.num_stages,
        )
    return out


def _routable(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
              skinny_rows: int) -> bool:
    return (x.is_cuda and x.dim() == 2 and x.dtype in HALF_DTYPES and weight.dtype == x.dtype
            and (bias is None or bias.dtype == x.dtype) and 1 <= x.shape[0] <= skinny_rows
            and x.stride(1) == 1 and weight.stride(1) == 1)


def skinny_linear(x: torch.Tensor, weight: torch.Tensor,
                  bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = x @ weight^T (+ bias) through the Triton kernel of `default_config`, y [M, N] in x's
    dtype (``F.linear`` where the table has no kernel for the shape).

    x: [M, K], M >= 1, last dimension contiguous (rows may be strided).
    weight: [N, K], last dimension contiguous, same dtype as x.
    bias: [N] or None.

    Raises ValueError for shapes or dtypes the kernel does not take.
    """
    _check_operands(x, weight, bias)
    rows, n = x.shape[0], weight.shape[0]
    config = default_config(rows, n, x.shape[1])
    if config is None:
        return F.linear(x, weight, bias)
    out = torch.empty(rows, n, device=x.device, dtype=x.dtype)
    launch(x, weight, bias, out, config)
    return out


def launch(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
           out: torch.Tensor, config: SkinnyConfig) -> None:
    """Write x @ weight^T (+ bias) into ``out`` [M, N] (last dimension contiguous) with one
    kernel launch of ``config`` (operands as `skinny_linear` takes them, unchecked)."""
    rows, k = x.shape
    n = weight.shape[0]
    block_m = config.rows_per_program(rows)
    kernel = skinny_reduce_kernel if config.kernel == "reduce" else skinny_dot_kernel
    grid = (-(-n // config.block_n), -(-rows // block_m))
    # Triton launches on the current device: a layer on another GPU needs its own.
    with launch_device(x.device):
        kernel[grid](
            x, weight, weight if bias is None else bias, out,
            rows, n, k, x.stride(0), weight.stride(0), out.stride(0),
            HAS_BIAS=bias is not None, EVEN_K=k % config.block_k == 0,
            BLOCK_M=block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
            NUM_STAGES=config.num_stages, num_warps=config.num_warps,
            num_stages=config.num_stages,
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
    """`skinny_linear` as an op torch.compile does not trace. The compiled graph chooses its
    buffers' layouts: x gets a copy in the rare case its rows arrive strided along K (the
    routing checked the traced layout)."""
    return skinny_linear(x if x.stride(1) == 1 else x.contiguous(), weight, bias)


@skinny_linear_op.register_fake
def _skinny_linear_fake(x: torch.Tensor, weight: torch.Tensor,
                        bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty((x.shape[0], weight.shape[0]))


@triton.jit(do_not_specialize=["M"])
def skinny_reduce_kernel(
    x_ptr, w_ptr, bias_ptr, y_ptr,
    M, N, K, stride_xm, stride_wn, stride_ym,
    HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    NUM_STAGES: tl.constexpr,
):
    """Program (n, m) writes y[m*BLOCK_M : +BLOCK_M, n*BLOCK_N : +BLOCK_N]."""
    offs_m, offs_n, offs_k, x_ptrs, w_ptrs = _tile_pointers(
        x_ptr, w_ptr, M, N, stride_xm, stride_wn, BLOCK_M, BLOCK_N, BLOCK_K)
    out = _reduce_over_k(x_ptrs, w_ptrs, K, offs_k, EVEN_K, BLOCK_M, BLOCK_N, BLOCK_K,
                         NUM_STAGES)
    _store(out, bias_ptr, y_ptr, offs_m, offs_n, M, N, stride_ym, HAS_BIAS)


@triton.jit(do_not_specialize=["M"])
def skinny_dot_kernel(
    x_ptr, w_ptr, bias_ptr, y_ptr,
    M, N, K, stride_xm, stride_wn, stride_ym,
    HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    NUM_STAGES: tl.constexpr,
):
    """Program (n, m) writes y[m*BLOCK_M : +BLOCK_M, n*BLOCK_N : +BLOCK_N] through tl.dot
    (BLOCK_M and BLOCK_N at least 16)."""
    offs_m, offs_n, offs_k, x_ptrs, w_ptrs = _tile_pointers(
        x_ptr, w_ptr, M, N, stride_xm, stride_wn, BLOCK_M, BLOCK_N, BLOCK_K)
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k0 in tl.range(0, K, BLOCK_K, num_stages=NUM_STAGES):
        x, w = _load_tile(x_ptrs + k0, w_ptrs + k0, k0, K, offs_k, EVEN_K)
        acc = tl.dot(w, tl.trans(x), acc)
    _store(tl.trans(acc), bias_ptr, y_ptr, offs_m, offs_n, M, N, stride_ym, HAS_BIAS)


@triton.jit
def skinny_gated_kernel(
    x_ptr, w_ptr, y_ptr, INTER, K, stride_wn,
    EVEN_K: tl.constexpr, BLOCK_PAIRS: tl.constexpr, BLOCK_K: tl.constexpr,
    NUM_STAGES: tl.constexpr,
):
    """Program p writes y[0, p*BLOCK_PAIRS : +BLOCK_PAIRS] = silu(gate) * up for one row x,
    W [2 * INTER, K] holding the gate rows, then the up rows. Its tile is the one-row product's
    [1, 2 * BLOCK_PAIRS, BLOCK_K], rows interleaved (gate, up) per pair, summed over K by the
    reduce kernel's own loop (`_reduce_over_k`); both halves are rounded to y's dtype before
    the SiLU (`fused_ops.silu_times_up`), as the product then `fused_ops.silu_mul_kernel` do."""
    offs_j = tl.arange(0, 2 * BLOCK_PAIRS)
    pairs = tl.program_id(0) * BLOCK_PAIRS + offs_j // 2
    rows = (tl.minimum(pairs, INTER - 1) + (offs_j % 2) * INTER).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + offs_k[None, :]
    w_ptrs = w_ptr + rows[:, None] * stride_wn + offs_k[None, :]
    out = _reduce_over_k(x_ptrs, w_ptrs, K, offs_k, EVEN_K, 1, 2 * BLOCK_PAIRS, BLOCK_K,
                         NUM_STAGES)
    gate, up = tl.split(tl.reshape(out.to(y_ptr.dtype.element_ty).to(tl.float32),
                                   (BLOCK_PAIRS, 2)))
    y = silu_times_up(gate, up, y_ptr)
    offs_p = tl.program_id(0) * BLOCK_PAIRS + tl.arange(0, BLOCK_PAIRS)
    tl.store(y_ptr + offs_p, y.to(y_ptr.dtype.element_ty), mask=offs_p < INTER)


@triton.jit
def _tile_pointers(x_ptr, w_ptr, M, N, stride_xm, stride_wn, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Program (n, m)'s row, column and K offsets, and the pointers to its first x [BLOCK_M,
    BLOCK_K] and W [BLOCK_N, BLOCK_K] tiles; rows past M or N read the last row (in bounds,
    and never stored)."""
    offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    rows_m = tl.minimum(offs_m, M - 1).to(tl.int64)
    rows_n = tl.minimum(offs_n, N - 1).to(tl.int64)
    x_ptrs = x_ptr + rows_m[:, None] * stride_xm + offs_k[None, :]
    w_ptrs = w_ptr + rows_n[:, None] * stride_wn + offs_k[None, :]
    return offs_m, offs_n, offs_k, x_ptrs, w_ptrs


@triton.jit
def _reduce_over_k(x_ptrs, w_ptrs, K, offs_k, EVEN_K: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr):
    """[BLOCK_M, BLOCK_N] float32 sums over K of x [BLOCK_M, BLOCK_K] tiles times W [BLOCK_N,
    BLOCK_K] tiles (pointers at K offset 0): the products accumulate element-wise in a
    [BLOCK_M, BLOCK_N, BLOCK_K] register tile, summed over K once after the loop, so the loop
    body is loads and FMAs only; ``NUM_STAGES`` > 1 pipelines it through shared memory."""
    acc = tl.zeros((BLOCK_M, BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in tl.range(0, K, BLOCK_K, num_stages=NUM_STAGES):
        x, w = _load_tile(x_ptrs + k0, w_ptrs + k0, k0, K, offs_k, EVEN_K)
        acc += x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :]
    return tl.sum(acc, axis=2)


@triton.jit
def _load_tile(x_ptrs, w_ptrs, k0, K, offs_k, EVEN_K: tl.constexpr):
    """The x and W tiles at K offset ``k0`` (pointers already advanced there); columns past K
    read as 0 unless K is a multiple of the block (``EVEN_K``)."""
    if EVEN_K:
        return tl.load(x_ptrs), tl.load(w_ptrs)
    k_mask = (k0 + offs_k)[None, :] < K
    return tl.load(x_ptrs, mask=k_mask, other=0.0), tl.load(w_ptrs, mask=k_mask, other=0.0)


@triton.jit
def _store(out, bias_ptr, y_ptr, offs_m, offs_n, M, N, stride_ym, HAS_BIAS: tl.constexpr):
    """Add the bias (float32) to out [BLOCK_M, BLOCK_N] and store the in-range part."""
    n_mask = offs_n < N
    if HAS_BIAS:
        bias = tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0)
        out += bias.to(tl.float32)[None, :]
    y_ptrs = y_ptr + offs_m[:, None].to(tl.int64) * stride_ym + offs_n[None, :]
    mask = (offs_m[:, None] < M) & n_mask[None, :]
    tl.store(y_ptrs, out.to(y_ptr.dtype.element_ty), mask=mask)
