"""Registers, spills and layout conversions of the paged decode kernels, compiled for a GPU
that need not be present (no device: Triton compiles for the target and runs its bundled
ptxas, cuobjdump and nvdisasm).

One line per kernel variant (decode of Llama-3-8B shape by default: GQA group 4, head_dim 128,
256-token pages): registers per thread, spilled bytes (stack), shared memory, the TTGIR's
``convert_layout`` and ``local_alloc`` counts, and SASS counts of the instructions that tell
where a loop's time goes (shared-memory traffic, int-to-float conversions, tensor-core ops,
local-memory spills).

    python benchmarks/triton_resources.py [--arch 90] [--dtype bf16] [--dump DIR]

``--dump DIR`` writes each variant's TTGIR, PTX and SASS there for reading.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from dyngen_core.attention.triton_kernels import paged_attention_kernel  # noqa: E402
from dyngen_core.attention.triton_quant_kernels import quant_decode_kernel  # noqa: E402

SASS_KINDS = ("LDS", "STS", "LDSM", "BAR", "I2F", "I2FP", "F2FP", "HMMA", "LDL", "STL", "LDG",
              "PRMT", "LOP3")


def _signature(fn: Any, constexprs: dict[str, Any], dtype: str, bits: int) -> dict[str, str]:
    """Argument types: pointers by role, ints for strides and sizes, fp32 for the scale."""
    codes = "*i32" if bits in (4, 8) else ("*u8" if bits == 6 else f"*{dtype}")
    roles = {"k_ptr": codes, "v_ptr": codes, "ks_ptr": "*fp16", "vs_ptr": "*fp16",
             "rot_ptr": "*fp32", "part_out_ptr": "*fp32", "part_lse_ptr": "*fp32"}
    signature = {}
    for name in fn.arg_names:
        if name in constexprs:
            signature[name] = "constexpr"
        elif name in roles:
            signature[name] = roles[name]
        elif name in ("page_table_ptr", "context_lens_ptr", "query_start_ptr", "block_seq_ptr",
                      "block_first_ptr", "kv_start_ptr", "ring_pos_ptr", "seq_slots_ptr"):
            signature[name] = "*i32"
        elif name.endswith("_ptr"):
            signature[name] = f"*{dtype}"
        else:
            signature[name] = "fp32" if name == "scale_log2" else "i32"
    return signature


def _tool(name: str) -> str:
    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)


def measure(fn: Any, constexprs: dict[str, Any], warps: int, dtype: str, bits: int, arch: int,
            dump: Path | None, label: str) -> dict[str, Any]:
    """Compile one variant; its resource figures."""
    source = ASTSource(fn=fn, signature=_signature(fn, constexprs, dtype, bits),
                       constexprs=constexprs)
    kernel = triton.compile(source, target=GPUTarget("cuda", arch, 32),
                            options={"num_warps": warps})
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(kernel.asm["cubin"])
        cubin.flush()
        usage = subprocess.run([_tool("cuobjdump"), "-res-usage", cubin.name],
                               capture_output=True, text=True, check=True).stdout
        sass = subprocess.run([_tool("nvdisasm"), "-c", cubin.name], capture_output=True,
                              text=True, check=True).stdout
    ttgir = kernel.asm["ttgir"]
    opcodes = Counter(m.group(1).split(".")[0] for m in
                      re.finditer(r"^\s*/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9.]*)",
                                  sass, re.MULTILINE))
    if dump is not None:
        dump.mkdir(parents=True, exist_ok=True)
        for suffix, text in (("ttgir", ttgir), ("ptx", kernel.asm["ptx"]), ("sass", sass)):
            (dump / f"{label}.{suffix}").write_text(text)
    return {
        "regs": int(re.search(r"REG:(\d+)", usage).group(1)),  # type: ignore[union-attr]
        "stack": int(re.search(r"STACK:(\d+)", usage).group(1)),  # type: ignore[union-attr]
        "smem": kernel.metadata.shared,
        "convert": ttgir.count("ttg.convert_layout"),
        "local_alloc": ttgir.count("ttg.local_alloc"),
        "sass": sum(opcodes.values()),
        **{kind: opcodes.get(kind, 0) for kind in SASS_KINDS},
    }


def variants(group: int, head_dim: int) -> list[tuple[str, Any, dict[str, Any], int, int]]:
    """(label, kernel, constexprs, warps, code bits) of the decode variants compared."""
    rows = max(16, 1 << (group - 1).bit_length())
    out: list[tuple[str, Any, dict[str, Any], int, int]] = []
    for bits, heads, window in ((0, False, 0), (8, True, 0), (4, True, 0), (4, True, 16)):
        name = "fp16" if bits == 0 else f"q{bits}"
        out.append((f"old-{name}-w{window}-n64x4", paged_attention_kernel, {
            "G": group, "G_PAD": 1 << (group - 1).bit_length(), "BLOCK_Q": 1, "BLOCK_M": rows,
            "BLOCK_N": 64, "HEAD_DIM": head_dim, "HEAD_PAD": head_dim, "PAGE_SIZE": 256,
            "K_BITS": bits, "V_BITS": bits, "NUM_SPLITS": 4, "DECODE": True,
            "REMAINDER": False, "WRITE_PARTIALS": True, "HEADS": heads, "WINDOW": window,
            "DOT_PRECISION": "tf32"}, 4, bits))
    for bits, window in ((8, 0), (4, 0), (4, 16)):
        for block_n, warps in ((32, 4), (64, 4), (64, 8), (128, 8)):
            for programs, role in (("both", 0), ("pages", 1), ("tail", 2)):
                pad = max(head_dim, 16 * 32 // bits)
                out.append((f"new-q{bits}-w{window}-n{block_n}x{warps}-{programs}",
                            quant_decode_kernel, {
                                "G": group, "BLOCK_M": rows, "BLOCK_N": block_n,
                                "HEAD_DIM": head_dim, "DIM_PAD": pad, "PAGE_SIZE": 256,
                                "K_BITS": bits, "V_BITS": bits, "NUM_SPLITS": 4,
                                "WINDOW": window, "DOT_PRECISION": "tf32",
                                "PROGRAMS": role}, warps, bits))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--arch", type=int, default=90, help="compute capability, e.g. 90")
    parser.add_argument("--dtype", default="bf16", choices=("bf16", "fp16"))
    parser.add_argument("--group", type=int, default=4, help="query heads per KV head")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--only", default="", help="substring the variant labels must hold")
    parser.add_argument("--dump", type=Path, default=None)
    args = parser.parse_args()
    columns = ("regs", "stack", "smem", "convert", "local_alloc", "sass", *SASS_KINDS)
    print(f"{'variant':34}" + "".join(f"{c:>7}" for c in columns))
    for label, fn, constexprs, warps, bits in variants(args.group, args.head_dim):
        if args.only not in label:
            continue
        figures = measure(fn, constexprs, warps, args.dtype, bits, args.arch, args.dump, label)
        print(f"{label:34}" + "".join(f"{figures[c]:>7}" for c in columns), flush=True)


if __name__ == "__main__":
    main()
