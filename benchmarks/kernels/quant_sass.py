"""The q8/q4 decode kernel's machine code for the H100/H200 (sm_90), compiled on any machine
(no GPU needed, only the `triton` package): registers, shared memory, spills, and the
instruction mix of its key loop, the count that bounds it (BENCHMARKS.md, section 4).

A Triton kernel is compiled ahead of time for a target (`triton.compile` over the kernel's
source with a signature and its constexprs), and the cubin's SASS is read with the
`cuobjdump` that the triton package carries. Loops are the backward branches of the SASS; the
innermost one of the page programs is the key loop, one block of ``BLOCK_N`` keys a pass, and
its count is per thread (and per warp: every warp runs the same instructions). Its count times
the program's warps over ``BLOCK_N`` is the kernel's warp instructions per key and KV head,
which Nsight Compute measured at 41 (twentieth session: 171 M warp instructions over 4.19 M keys
and heads at batch 32) where this counts 678 × 4 / 64 = 42.

    python benchmarks/kernels/quant_sass.py [--bits 4] [--programs 1] [--splits 3]
        [--set quant_decode.BLOCK_N=32] [--sass out.sass]

``--programs``: 1 the page programs' launch (batches above `ONE_LAUNCH_MAX_SEQS`),
0 page and tail programs in one launch (batch 1), 2 the tail's launch. Pointer dtypes are the
runner's for a bfloat16 model (queries and exact rows bfloat16, code words int32, scales
float16); the constants other than ``--set`` are the module's. Triton is imported here only:
it is not a dependency of dyngen (``pip install triton`` on a CPU machine gives the compiler).
"""

from __future__ import annotations

import argparse
import collections
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.kernels import constants  # noqa: E402


def signature(names: list[str], constexprs: dict[str, Any]) -> dict[str, str]:
    """Triton's type of every argument of `quant_decode_kernel` (constexprs by name)."""
    words = {"k_ptr", "v_ptr"}
    halves = {"ks_ptr", "vs_ptr"}
    floats = {"rot_ptr", "part_out_ptr", "part_lse_ptr"}
    ints = {"page_table_ptr", "context_lens_ptr", "ring_pos_ptr", "seq_slots_ptr"}
    types = {}
    for name in names:
        if name in constexprs:
            types[name] = "constexpr"
        elif name in words or name in ints:
            types[name] = "*i32"
        elif name in halves:
            types[name] = "*fp16"
        elif name in floats:
            types[name] = "*fp32"
        elif name.endswith("_ptr"):
            types[name] = "*bf16"  # queries, exact rows; the write's unused operands
        elif name == "scale_log2":
            types[name] = "fp32"
        else:
            types[name] = "i32"
    return types


def compile_kernel(bits: int, programs: int, splits: int) -> tuple[Any, str]:
    """The kernel compiled for sm_90 with the module's constants now: (kernel, SASS text)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from dyngen_core.kv.attention.triton import quant_decode as qd

    window = 16 if bits == 4 else 0  # the runner's: q4 keeps a recent window, q8 does not
    launches = 1 if programs == 0 else 2
    constexprs: dict[str, Any] = {
        "G": 4, "BLOCK_M": qd.query_rows(4), "BLOCK_N": qd.BLOCK_N, "HEAD_DIM": 128,
        "DIM_PAD": qd.word_dim_pad(128, bits, bits), "PAGE_SIZE": 256, "K_BITS": bits,
        "V_BITS": bits, "NUM_SPLITS": splits, "WINDOW": window, "DOT_PRECISION": "tf32",
        "PROGRAMS": programs, "FAST_UNPACK": True,
        "PAGE_WINDOW": 0 if programs == 2 else qd.PAGE_WINDOW,
        "TAIL_PARTS": qd.tail_parts_for(window, launches), "WRITE_STEP": False, "W_HEADS": 1,
        "W_HAS_OFFSETS": False, "W_ROWS": 1, "W_INV_SQRT": 1.0}
    kernel = qd.quant_decode_kernel
    names = list(kernel.arg_names)
    attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(names)
             if name.endswith("_ptr")}
    source = ASTSource(kernel, signature(names, constexprs), constexprs, attrs)
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": qd.WARPS, "num_stages": qd.STAGES})
    tools = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    with tempfile.TemporaryDirectory() as folder:
        cubin = Path(folder) / "quant_decode.cubin"
        cubin.write_bytes(compiled.asm["cubin"])
        text = [subprocess.run([str(tools / "cuobjdump"), flag, str(cubin)], check=True,
                               capture_output=True, text=True).stdout
                for flag in ("-sass", "-res-usage")]
    return compiled, "\n".join(text)


def instructions(sass: str) -> list[tuple[int, str]]:
    """(address, instruction) of every SASS line."""
    found = []
    for line in sass.splitlines():
        match = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?);", line)
        if match:
            found.append((int(match.group(1), 16), match.group(2).strip()))
    return found


def loops(code: list[tuple[int, str]]) -> list[tuple[int, int]]:
    """(first, last) indexes of each loop: a branch back to an earlier address."""
    index = {address: i for i, (address, _) in enumerate(code)}
    found = []
    for i, (address, text) in enumerate(code):
        match = re.search(r"\bBRA\b.*?(0x[0-9a-f]+)", text)
        if match:
            target = int(match.group(1), 16)
            if target < address and target in index:
                found.append((index[target], i))
    return found


def mix(body: list[str]) -> collections.Counter[str]:
    """Instructions by opcode (predicates and modifiers dropped)."""
    ops: collections.Counter[str] = collections.Counter()
    for text in body:
        text = re.sub(r"^@!?U?P\w+\s+", "", text)
        ops[text.split()[0].split(".")[0]] += 1
    return ops


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bits", type=int, default=4, choices=(4, 8))
    parser.add_argument("--programs", type=int, default=1, choices=(0, 1, 2))
    parser.add_argument("--splits", type=int, default=3, help="NUM_SPLITS (batch 32: 3)")
    parser.add_argument("--sass", help="write the whole SASS here")
    constants.add_argument(parser)
    args = parser.parse_args()
    constants.apply(args.set)
    from dyngen_core.kv.attention.triton import quant_decode as qd

    compiled, sass = compile_kernel(args.bits, args.programs, args.splits)
    if args.sass:
        Path(args.sass).write_text(sass)
    usage = re.search(r"REG:(\d+) STACK:(\d+) SHARED:\d+ LOCAL:(\d+)", sass)
    print(f"q{args.bits}, programs {args.programs}: registers {usage and usage.group(1)}, "
          f"stack {usage and usage.group(2)}, local {usage and usage.group(3)}, "
          f"shared memory {compiled.metadata.shared} bytes a program")
    code = instructions(sass)
    found = sorted(loops(code), key=lambda span: span[1] - span[0])
    innermost = [span for span in found
                 if not any(o != span and span[0] <= o[0] and o[1] <= span[1] for o in found)]
    for first, last in innermost:
        body = [text for _, text in code[first:last + 1]]
        per_key = len(body) * qd.WARPS / qd.BLOCK_N
        print(f"loop {code[first][0]:#x}-{code[last][0]:#x}: {len(body)} instructions a "
              f"thread a pass ({per_key:.1f} warp instructions a key and KV head if a pass "
              f"is one block)")
        print("   " + ", ".join(f"{op} {n}" for op, n in mix(body).most_common()))


if __name__ == "__main__":
    main()
