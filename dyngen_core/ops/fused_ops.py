"""The decoder's element-wise ops (RMSNorm, the residual add in front of it, SiLU-and-mul, the
rotary embedding of q and k): one Triton kernel each, its torch twin, and the routing the
layers call.

Unfused, an RMSNorm is ~6 torch kernels with float32 intermediates, SiLU-and-mul 2 and the
rotary embedding 5, plus two residual adds per layer. The kernels read and write each tensor
once, rounding where the torch ops round (float32 arithmetic on half inputs, one rounding per
torch op), so only the order of the norm's sum of squares differs:

- `rms_norm_kernel`: h = x + out rounded to the dtype (written when ``HAS_RESIDUAL``), then
  normed = (h32 * rsqrt(mean(h32^2) + eps)) rounded to the dtype, then y = weight * normed
  rounded. A program holds ``BLOCK_M`` whole rows in registers (one read, one write each).
  Input rows are addressed as (row // inner) * stride_xo + (row % inner) * stride_xi, so a
  3-D view [A, B, N] (per-head q/k of a fused projection) needs no copy; outputs are contiguous.
- `silu_mul_kernel`: y = (silu(gate) rounded) * up rounded, gate and up the two halves of each
  [2 * I] row; program (row, block) writes ``BLOCK`` columns of one row.
- `rotary_kernel`: y = x * cos + rotate_half(x) * sin with each product and the sum rounded to
  the dtype, as the torch ops round (the compiler may keep a product in float32: then the
  result is closer to the exact one than theirs); program (token, block) rotates ``BLOCK_H``
  heads of one token. Input heads may be strided (the q and k heads of a fused projection);
  the output is contiguous [T, H, D].

`rms_norm`, `add_rms_norm`, `silu_mul` and `rotary` take ``fused``: the layer's resolved setting
(`fused_ops_for`, from `Model.set_fused_ops`). With it, bf16/fp16 operands of supported shapes
run the kernels; float32, other shapes, ``fused=False`` and code traced by ``torch.compile``
run the torch twins (inductor fuses the torch ops itself, which an opaque custom op would
block). A launch allocates only its outputs and its grid depends on the shapes alone, so it is
captured in CUDA graphs like any kernel; the norm's row count is not specialized on, so prefill
chunks of every length share one compile.

The launch shapes are module constants (`NORM_PROGRAM_ELEMENTS`, `NORM_WARP_ELEMENTS`,
`SILU_BLOCK`, `SILU_WARPS`) that benchmarks/kernels/fused_ops.py patches (BENCHMARKS.md,
section 1).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dyngen_core.ops.triton_support import (
    launch_device,
    require_triton,
    tl,
    triton,
    triton_by_default,
)

HALF_DTYPES = (torch.bfloat16, torch.float16)
# What `Model` starts with: None runs the kernels where triton runs by default (CUDA with triton
# installed); False keeps the torch ops unless a model is told otherwise.
DEFAULT_FUSED_OPS: bool | None = None
# Rows longer than this stay on the torch path (a program holds whole rows in registers).
MAX_NORM_DIM = 16384
# Norm launches: elements per program for short rows (several rows a program), and elements
# per warp (8 warps for a 4096-wide row: 16 per thread, two 16-byte loads).
NORM_PROGRAM_ELEMENTS = 2048
NORM_WARP_ELEMENTS = 512
# SiLU-and-mul launches: columns per program and warps (4 bf16 per thread).
SILU_BLOCK = 512
SILU_WARPS = 4
# Rotary launches: at most this many elements (heads x head_dim) a program.
ROTARY_PROGRAM_ELEMENTS = 2048


def fused_ops_for(device: torch.device, enabled: bool | None) -> bool:
    """The resolved setting for layers on ``device``: None runs the kernels where triton runs
    by default (CUDA with triton installed); True asks for them (ValueError where they cannot
    run: no triton, or neither CUDA nor ``TRITON_INTERPRET=1``); False keeps the torch ops."""
    if enabled is None:
        return triton_by_default(device)
    if enabled:
        require_triton(device, "fused_ops")
    return enabled


def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension as transformers computes it: float32 statistics, cast to
    x's dtype before the weight multiply (one fused op when everything is float32)."""
    if x.dtype == torch.float32 and weight.dtype == torch.float32:
        # One fused kernel; in float32 it rounds exactly like the unfused steps below.
        return F.rms_norm(x, weight.shape, weight, eps)
    x32 = x.to(torch.float32)
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def silu_mul_torch(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for the two halves of the last dimension."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def rotary_torch(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, head_dim] rotated by per-token cos/sin [T, head_dim] (the halves of each
    head are the rotated pairs, as transformers' ``rotate_half``)."""
    cos, sin = cos[:, None, :], sin[:, None, :]
    first, second = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-second, first), dim=-1) * sin


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *,
           fused: bool = False) -> torch.Tensor:
    """`rotary_torch` of x [T, H, D]; one `rotary_kernel` launch when ``fused``, x is bf16/fp16
    contiguous along D, cos and sin are contiguous [T, D] in x's dtype and D / 2 is a power of
    two. Either way the result is a new contiguous [T, H, D] tensor."""
    if fused and _rotary_routable(x, cos, sin):
        return launch_rotary(x, cos, sin)
    return rotary_torch(x, cos, sin)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, *,
             fused: bool = False) -> torch.Tensor:
    """RMSNorm of x [..., N] with weight [N]; through `rms_norm_kernel` when ``fused`` and x is a
    2-D or 3-D bf16/fp16 tensor (weight in its dtype) contiguous along N, else `rms_norm_torch`.
    """
    if fused and _norm_routable(x, weight):
        return launch_rms_norm(x, weight, eps)[0]
    return rms_norm_torch(x, weight, eps)


def add_rms_norm(x: torch.Tensor, out: torch.Tensor, weight: torch.Tensor, eps: float, *,
                 fused: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(RMSNorm(h), h) for h = x + out, the residual stream after a sublayer: one kernel when
    ``fused`` and x, out are 2-D [T, N] in one half dtype, contiguous along N."""
    if (fused and _norm_routable(x, weight) and x.dim() == 2 and out.shape == x.shape
            and out.dtype == x.dtype and out.stride(-1) == 1):
        normed, h = launch_rms_norm(x, weight, eps, residual=out)
        assert h is not None
        return normed, h
    h = x + out
    return rms_norm_torch(h, weight, eps), h


def silu_mul(gate_up: torch.Tensor, *, fused: bool = False) -> torch.Tensor:
    """silu(gate) * up of gate_up [T, 2 * I] (gate first): [T, I]; one kernel when ``fused`` and
    gate_up is a bf16/fp16 2-D tensor contiguous along its last dimension."""
    if (fused and not torch.compiler.is_compiling() and gate_up.dtype in HALF_DTYPES
            and gate_up.dim() == 2 and gate_up.numel() and gate_up.shape[1] % 2 == 0
            and gate_up.stride(1) == 1):
        return launch_silu_mul(gate_up)
    return silu_mul_torch(gate_up)


def launch_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
                    residual: torch.Tensor | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(normed, h) of one `rms_norm_kernel` launch (operands as `rms_norm` / `add_rms_norm`
    route them, unchecked); h = x + residual, None without a residual. Outputs are new
    contiguous tensors of x's shape. Rows per program fill `NORM_PROGRAM_ELEMENTS`; one warp
    per `NORM_WARP_ELEMENTS` elements (1 to 16)."""
    n = x.shape[-1]
    rows = x.numel() // n
    block_n = _next_pow2(n)
    block_m = max(1, min(_next_pow2(rows), NORM_PROGRAM_ELEMENTS // block_n))
    num_warps = max(1, min(16, block_m * block_n // NORM_WARP_ELEMENTS))
    inner, stride_inner = (x.shape[1], x.stride(1)) if x.dim() == 3 else (1, 0)
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    h = torch.empty_like(y) if residual is not None else None
    with launch_device(x.device):
        rms_norm_kernel[(-(-rows // block_m),)](
            x, y if residual is None else residual, weight, y if h is None else h, y,
            rows, n, inner, x.stride(0), stride_inner,
            0 if residual is None else residual.stride(0), eps,
            HAS_RESIDUAL=residual is not None, BLOCK_M=block_m, BLOCK_N=block_n,
            num_warps=num_warps,
        )
    return y, h


def launch_silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up [T, I] of one `silu_mul_kernel` launch over gate_up [T, 2 * I]
    (contiguous along the last dimension, unchecked): `SILU_BLOCK` columns and `SILU_WARPS`
    warps a program."""
    rows, inter = gate_up.shape[0], gate_up.shape[1] // 2
    y = torch.empty(rows, inter, dtype=gate_up.dtype, device=gate_up.device)
    with launch_device(gate_up.device):
        silu_mul_kernel[(rows, -(-inter // SILU_BLOCK))](
            gate_up, y, inter, gate_up.stride(0), y.stride(0), BLOCK=SILU_BLOCK,
            num_warps=SILU_WARPS,
        )
    return y


def launch_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """One `rotary_kernel` launch (operands as `rotary` routes them, unchecked): heads per
    program fill `ROTARY_PROGRAM_ELEMENTS`."""
    tokens, heads, dim = x.shape
    block_h = max(1, min(_next_pow2(heads), ROTARY_PROGRAM_ELEMENTS // dim))
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    with launch_device(x.device):
        rotary_kernel[(tokens, -(-heads // block_h))](
            x, cos, sin, y, heads, x.stride(0), x.stride(1), cos.stride(0),
            HALF=dim // 2, BLOCK_H=block_h, num_warps=max(1, min(8, block_h * dim // 512)),
        )
    return y


def _rotary_routable(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    half = x.shape[-1] // 2 if x.dim() == 3 else 0
    return (not torch.compiler.is_compiling() and x.dtype in HALF_DTYPES and x.dim() == 3
            and x.stride(-1) == 1 and x.numel() > 0 and half > 0 and half & (half - 1) == 0
            and 2 * half == x.shape[-1]
            and all(t.dtype == x.dtype and t.dim() == 2 and t.shape == (x.shape[0], x.shape[2])
                    and t.stride(1) == 1 and t.stride(0) == cos.stride(0) for t in (cos, sin)))


def _norm_routable(x: torch.Tensor, weight: torch.Tensor) -> bool:
    # Compiling first: no shape or stride checks (guards) in a traced graph.
    return (not torch.compiler.is_compiling() and x.dtype in HALF_DTYPES
            and weight.dtype == x.dtype and x.dim() in (2, 3) and x.stride(-1) == 1
            and weight.stride(0) == 1 and x.numel() > 0 and x.shape[-1] <= MAX_NORM_DIM)


def _next_pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


@triton.jit(do_not_specialize=["rows"])
def rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, h_ptr, y_ptr,
    rows, n, inner, stride_xo, stride_xi, stride_res, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """Program m normalizes rows [m * BLOCK_M, (m + 1) * BLOCK_M) (module docstring)."""
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    mask = (offs_m < rows)[:, None] & (offs_n < n)[None, :]
    row = offs_m.to(tl.int64)
    x_rows = (row // inner) * stride_xo + (row % inner) * stride_xi
    x = tl.load(x_ptr + x_rows[:, None] + offs_n[None, :], mask=mask, other=0.0)
    out_rows = row[:, None] * n + offs_n[None, :]
    if HAS_RESIDUAL:
        res = tl.load(res_ptr + row[:, None] * stride_res + offs_n[None, :], mask=mask,
                      other=0.0)
        x = (x.to(tl.float32) + res.to(tl.float32)).to(y_ptr.dtype.element_ty)
        tl.store(h_ptr + out_rows, x, mask=mask)
    x32 = x.to(tl.float32)
    mean_square = tl.sum(x32 * x32, axis=1) / n
    normed = (x32 * tl.math.rsqrt(mean_square + eps)[:, None]).to(y_ptr.dtype.element_ty)
    weight = tl.load(w_ptr + offs_n, mask=offs_n < n, other=0.0)
    y = normed.to(tl.float32) * weight.to(tl.float32)[None, :]
    tl.store(y_ptr + out_rows, y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def silu_mul_kernel(x_ptr, y_ptr, inter, stride_x, stride_y, BLOCK: tl.constexpr):
    """Program (row, b) writes y[row, b * BLOCK : (b + 1) * BLOCK]."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    x_row = x_ptr + row * stride_x
    gate = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_row + inter + cols, mask=mask, other=0.0)
    y = silu_times_up(gate, up.to(tl.float32), y_ptr)
    tl.store(y_ptr + row * stride_y + cols, y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def silu_times_up(gate, up, y_ptr):
    """silu(gate) * up in float32 (gate and up float32), the SiLU rounded to ``y_ptr``'s element
    type first: what every SiLU-and-mul of the package computes, so that they agree bit for
    bit (`silu_mul_kernel`, `skinny_matmul.skinny_gated_kernel`)."""
    silu = (gate / (1.0 + tl.exp(-gate))).to(y_ptr.dtype.element_ty)
    return silu.to(tl.float32) * up


@triton.jit
def rotary_kernel(x_ptr, cos_ptr, sin_ptr, y_ptr, heads, stride_xt, stride_xh, stride_ct,
                  HALF: tl.constexpr, BLOCK_H: tl.constexpr):
    """Program (t, b) rotates heads [b * BLOCK_H, (b + 1) * BLOCK_H) of token t (module
    docstring): first half x1 * c - x2 * s, second half x2 * c + x1 * s, each term rounded."""
    token = tl.program_id(0).to(tl.int64)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, HALF)
    mask = (offs_h < heads)[:, None] & (offs_d < HALF)[None, :]
    x_first = x_ptr + token * stride_xt + offs_h[:, None] * stride_xh + offs_d[None, :]
    x1 = tl.load(x_first, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_first + HALF, mask=mask, other=0.0).to(tl.float32)
    table = token * stride_ct + offs_d
    c1 = tl.load(cos_ptr + table).to(tl.float32)[None, :]
    c2 = tl.load(cos_ptr + table + HALF).to(tl.float32)[None, :]
    s1 = tl.load(sin_ptr + table).to(tl.float32)[None, :]
    s2 = tl.load(sin_ptr + table + HALF).to(tl.float32)[None, :]
    dtype = y_ptr.dtype.element_ty
    first = (x1 * c1).to(dtype).to(tl.float32) - (x2 * s1).to(dtype).to(tl.float32)
    second = (x2 * c2).to(dtype).to(tl.float32) + (x1 * s2).to(dtype).to(tl.float32)
    y_first = y_ptr + (token * heads + offs_h[:, None]) * (2 * HALF) + offs_d[None, :]
    tl.store(y_first, first.to(dtype), mask=mask)
    tl.store(y_first + HALF, second.to(dtype), mask=mask)
