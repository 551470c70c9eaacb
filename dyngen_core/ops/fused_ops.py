"""The decoder's element-wise ops (RMSNorm, the residual add in front of it, SiLU-and-mul) as
one Triton kernel each, and the routing the layers call; the torch twins are the reference.

Why: unfused, an RMSNorm is ~6 torch kernels with float32 intermediates and SiLU-and-mul 2, plus
two residual adds per layer: for an 8,030-token Llama-3-8B prefill ~1 GB of traffic per norm,
and ~15 small launches per layer in a decode step. The kernels read and write each tensor once
(`fused_ops_kernel`), rounding where the torch ops round (only the order of the norm's sum of
squares differs).

`rms_norm`, `add_rms_norm` and `silu_mul` take ``fused``: the layer's resolved setting
(`fused_ops_for`, from `Model.set_fused_ops`). With it, bf16/fp16 operands of supported shapes
run the kernels; float32, other shapes, ``fused=False`` and code traced by ``torch.compile``
run the torch twins. While compiling the torch ops are what inductor wants: it fuses them into
kernels of the same traffic (and with their neighbours), which an opaque custom op would block.
A launch allocates only its outputs and its grid depends on the shapes alone, so it is captured
in CUDA graphs like any kernel.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dyngen_core.ops.triton_support import (
    launch_device,
    require_triton,
    triton_by_default,
)

HALF_DTYPES = (torch.bfloat16, torch.float16)
# What `Model` starts with: None runs the kernels where triton runs by default (CUDA with triton
# installed); False keeps the torch ops unless a model is told otherwise.
DEFAULT_FUSED_OPS: bool | None = None
# Rows longer than this stay on the torch path (a program holds whole rows in registers).
MAX_NORM_DIM = 16384
# Norm launch defaults: elements per program for short rows (several rows a program), and
# elements per warp (8 warps for a 4096-wide row: 16 per thread, two 16-byte loads).
NORM_PROGRAM_ELEMENTS = 2048
NORM_WARP_ELEMENTS = 512
# SiLU-and-mul launch defaults: columns per program and warps (4 bf16 per thread). 512 x 4
# measured fastest on an H200 (benchmarks/fused_ops.py, 8030 x 14336: 168.6 us against 183.8
# at 1024 x 4, floor 162.5; equal at 1 to 256 rows).
SILU_BLOCK = 512
SILU_WARPS = 4


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
                    residual: torch.Tensor | None = None, *, block_m: int = 0,
                    num_warps: int = 0) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(normed, h) of one `rms_norm_kernel` launch (operands as `rms_norm` / `add_rms_norm`
    route them, unchecked); h = x + residual, None without a residual. Outputs are new
    contiguous tensors of x's shape.

    block_m: rows per program (a power of two); 0 fills `NORM_PROGRAM_ELEMENTS` with rows.
    num_warps: warps per program; 0 gives one per `NORM_WARP_ELEMENTS` elements (1 to 16).
    """
    from dyngen_core.ops.fused_ops_kernel import rms_norm_kernel

    n = x.shape[-1]
    rows = x.numel() // n
    block_n = _next_pow2(n)
    block_m = block_m or max(1, min(_next_pow2(rows), NORM_PROGRAM_ELEMENTS // block_n))
    num_warps = num_warps or max(1, min(16, block_m * block_n // NORM_WARP_ELEMENTS))
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


def launch_silu_mul(gate_up: torch.Tensor, *, block: int = 0,
                    num_warps: int = 0) -> torch.Tensor:
    """silu(gate) * up [T, I] of one `silu_mul_kernel` launch over gate_up [T, 2 * I]
    (contiguous along the last dimension, unchecked).

    block: columns per program (a power of two); 0: `SILU_BLOCK`.
    num_warps: warps per program; 0: `SILU_WARPS`.
    """
    from dyngen_core.ops.fused_ops_kernel import silu_mul_kernel

    rows, inter = gate_up.shape[0], gate_up.shape[1] // 2
    block = block or SILU_BLOCK
    y = torch.empty(rows, inter, dtype=gate_up.dtype, device=gate_up.device)
    with launch_device(gate_up.device):
        silu_mul_kernel[(rows, -(-inter // block))](
            gate_up, y, inter, gate_up.stride(0), y.stride(0), BLOCK=block,
            num_warps=num_warps or SILU_WARPS,
        )
    return y


def _norm_routable(x: torch.Tensor, weight: torch.Tensor) -> bool:
    # Compiling first: no shape or stride checks (guards) in a traced graph.
    return (not torch.compiler.is_compiling() and x.dtype in HALF_DTYPES
            and weight.dtype == x.dtype and x.dim() in (2, 3) and x.stride(-1) == 1
            and weight.stride(0) == 1 and x.numel() > 0 and x.shape[-1] <= MAX_NORM_DIM)


def _next_pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()
