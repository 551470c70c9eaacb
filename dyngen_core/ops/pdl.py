"""The start of every Triton kernel that may be launched as a programmatic dependent launch
(PDL): `pdl_start`. `triton_support.pdl_launch` says whether a launch uses it.

Why: in a CUDA graph of a decode step each kernel otherwise starts only after the one before
it has finished and the launch has gone through the hardware queue, about a microsecond of idle
GPU per kernel boundary (a batch-1 Llama-3-8B step has ~12 kernels a layer). Launched with PDL
(sm_90+), a kernel's programs may start while the previous kernel is finishing; each waits at
its first statement (`griddepcontrol.wait`) until that kernel has completed and its writes are
visible, so it reads and writes nothing early, and it at once lets the next kernel start the
same way (`griddepcontrol.launch_dependents`). A kernel launched without PDL after one of these
waits for it as usual, so PDL and other kernels mix in any order. Measured on an H200
(a chain of three small kernels in a graph): 7.97 -> 5.68 us per chain. End to end they
measured no faster (a decode step is a few hundred kernels, most of them long enough that the
gap hardly counts, and early-launched programs wait on multiprocessors the running kernel
could use), so they are opt-in: ``DYNGEN_PDL=1`` (`triton_support.PDL_ENV`).

This module imports triton at the top: only kernel modules import it.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def pdl_start(GDC: tl.constexpr):
    """With GDC (the launch used PDL): wait for the previous kernel to complete, then allow the
    next one to launch. Without it: nothing (the CPU interpreter, GPUs before sm_90)."""
    if GDC:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
