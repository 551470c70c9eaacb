"""The q8/q4 decode kernel's machine code for the H100/H200 (sm_90), compiled on any machine
(no GPU needed, only the `triton` package): registers, shared memory, spills, and the
instruction mix of its key loop, the count that bounds it (BENCHMARKS.md, section 4).

The kernel is compiled as the runtime compiles it: the kernel benchmark's own operands
(`benchmarks/kernels/quant_decode.py`: one layer of Llama-3-8B shape, the backend's launch
rule, the step's write done by the kernel as a decode step on CUDA does it) are built on the
CPU, `attend_word_decode` runs with its launch captured, and Triton's
own binder specializes those arguments for sm_90 (which integers and pointers are multiples of
16: it changes the address code and the copies' widths) before `triton.compile`. The cubin's
SASS is read with the `cuobjdump` that the triton package carries. Its registers agree with
Nsight Compute's on the H200 (BENCHMARKS.md, section 4).

Loops are the backward branches of the SASS; the innermost one with the key dots (IMMA) is
the key loop of the page programs, one block of ``BLOCK_N`` keys a pass, and its count is per
thread (every warp runs the same instructions). Its count times the program's warps over
``BLOCK_N`` is the kernel's warp instructions per key and KV head.

    python benchmarks/kernels/quant_sass.py [--bits 4] [--batch 32] [--set quant_decode.BLOCK_N=32]
        [--sass out.sass] [--ttgir out.ttgir]

``--ttgir``: Triton's GPU dialect of every launch, where its layout choices show: the blocked
layout of each copy into shared memory (``async_copy_global_to_local``: ``sizePerThread`` is
what one thread copies), the shared layouts (``swizzled_shared``) and the operands' ``kWidth``
(BENCHMARKS.md, section 4, found the value words' copy width and the value dot's ``kWidth``
this way).

``--batch``: sequences of the decode (batch 1: 32 splits a (sequence, head), as the backend
gives 132 multiprocessors; above `quant_decode.ONE_LAUNCH_MAX_SEQS`: the page launch and the
tail's). Triton is imported here only: it is not a dependency of dyngen (``pip install triton``
on a CPU machine gives the compiler).
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
from unittest import mock

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks._common import llama3_8b_config  # noqa: E402
from benchmarks.kernels import constants  # noqa: E402

H200_MULTIPROCESSORS = 132


def captured_launches(bits: int, batch_size: int) -> list[tuple[tuple[Any, ...], dict[str, Any]]]:
    """(arguments, keywords) of each `quant_decode_kernel` launch that the kernel benchmark's
    call makes for ``batch_size`` sequences at 1,024 tokens (the context changes no argument
    the compiler sees), built on the CPU; FAST_UNPACK as on CUDA."""
    import torch

    from benchmarks.kernels import quant_decode as bench
    from dyngen_core.kv.attention.triton import decode
    from dyngen_core.kv.attention.triton import quant_decode as qd
    from dyngen_core.kv.quant import storage as quant_storage

    config = llama3_8b_config()
    cpu = torch.device("cpu")
    # The storage writes with Triton as on CUDA, so the launch does the step's write.
    with mock.patch.object(quant_storage, "resolve_triton_write", lambda option, device: True):
        storage = bench.one_layer_storage(config, f"q{bits}", batch_size * 1024, cpu)
    windowed = storage.reserve_sequences(batch_size) > 0
    batch, q, step_rows = bench.decode_inputs(config, batch_size, 1024, cpu, windowed)
    launches: list[tuple[tuple[Any, ...], dict[str, Any]]] = []

    class Capture:
        def __getitem__(self, grid: Any) -> Any:
            return lambda *args, **kwargs: launches.append((args, kwargs))

    # The launches as on an H200 (its multiprocessors set the split count), the split
    # combine after them left out (it needs a GPU and is not this kernel).
    with (mock.patch.object(qd, "quant_decode_kernel", Capture()),
          mock.patch.object(qd, "launch_combine", lambda *a: None),
          mock.patch.object(decode, "multiprocessors", lambda device: H200_MULTIPROCESSORS)):
        bench.word_calls(storage, [batch], q, step_rows)[0]()
    return [(args, {**kwargs, "FAST_UNPACK": True}) for args, kwargs in launches]


def compile_launch(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, str]:
    """One captured launch compiled for sm_90 as the runtime would: (kernel, SASS text)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    from dyngen_core.kv.attention.triton.quant_decode import quant_decode_kernel as kernel

    target = GPUTarget("cuda", 90, 32)
    backend = make_backend(target)
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(backend, kwargs, bound,
                                                              specialization, options)
    compiled = triton.compile(ASTSource(kernel, signature, constexprs, attrs), target=target,
                              options=options.__dict__)
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


def print_key_loops(sass: str, warps_per_key: float) -> None:
    """Each innermost loop of ``sass`` with key dots (IMMA: not the tail's exact rows or the
    write): its span, instructions a thread a pass, warp instructions a key and KV head
    (``warps_per_key``: the program's warps over its keys a pass), and its instruction mix."""
    code = instructions(sass)
    found = loops(code)
    for first, last in found:
        if any(o != (first, last) and first <= o[0] and o[1] <= last for o in found):
            continue  # not innermost
        body = [text for _, text in code[first:last + 1]]
        ops = mix(body)
        if "IMMA" not in ops:
            continue
        print(f"key loop {code[first][0]:#x}-{code[last][0]:#x}: {len(body)} instructions a "
              f"thread a pass ({len(body) * warps_per_key:.1f} warp instructions a key and KV "
              f"head)")
        print("   " + ", ".join(f"{op} {n}" for op, n in ops.most_common()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bits", type=int, default=4, choices=(4, 8))
    parser.add_argument("--batch", type=int, default=32, help="sequences of the decode")
    parser.add_argument("--sass", help="write the SASS of every launch here")
    parser.add_argument("--ttgir", help="write Triton's GPU dialect of every launch here")
    constants.add_argument(parser)
    args = parser.parse_args()
    constants.apply(args.set)
    from dyngen_core.kv.attention.triton import quant_decode as qd

    sass_out, ttgir_out = [], []
    for arguments, keywords in captured_launches(args.bits, args.batch):
        compiled, sass = compile_launch(arguments, keywords)
        sass_out.append(sass)
        ttgir_out.append(compiled.asm["ttgir"])
        usage = re.search(r"REG:(\d+) STACK:(\d+) SHARED:\d+ LOCAL:(\d+)", sass)
        print(f"q{args.bits}, batch {args.batch}, PROGRAMS {keywords['PROGRAMS']}: registers "
              f"{usage and usage.group(1)}, stack {usage and usage.group(2)}, local "
              f"{usage and usage.group(3)}, shared memory {compiled.metadata.shared} bytes a "
              f"program")
        print_key_loops(sass, qd.WARPS / qd.BLOCK_N)
    if args.sass:
        Path(args.sass).write_text("\n".join(sass_out))
    if args.ttgir:
        Path(args.ttgir).write_text("\n".join(ttgir_out))


if __name__ == "__main__":
    main()
