"""Registers, spills and layout conversions of the Triton kernels, compiled for a GPU that
need not be present (no device: Triton compiles for the target and runs its bundled ptxas,
cuobjdump and nvdisasm).

One line per kernel variant (Llama-3-8B shape by default: 32 query heads, GQA group 4,
head_dim 128, 256-token pages): registers per thread, spilled bytes (stack), shared memory,
the TTGIR's ``convert_layout`` and ``local_alloc`` counts and its ``async_wait`` nums
(``waits``: copy groups left in flight at each wait; all 0: a loop that waits for every copy
each step), and SASS counts of the instructions that tell where a loop's time goes
(shared-memory traffic, int-to-float conversions, tensor-core ops, global loads, cp.async
(LDGSTS), 16-byte global loads and cp.async (LD128: LDG* with .128), local-memory spills).

Variants (built in `triton_variants.py`): ``old-*`` the general decode kernel
(`paged_attention_kernel`; ``-mw``: with the
in-kernel split merge and step write of small batches; ``-pwN``: its key loop with N page ids
loaded ahead of the tiles, `DecodeOptions.page_window`; ``-sN``: N pipeline stages);
``new-*`` the q8/q4 word decode kernel
(`quant_decode_kernel`) over tiles and launch kinds, without its options and with the
backend's defaults (`triton_quant.WordKernelFlags`, tag ``-vhfw``: letters of the options on;
``-merge``: with the in-kernel split merge; ``-sN``: N page splits; ``-tT``: the tail's
work in T programs, `attend_word_decode`'s tail_parts);
``prefix-*`` the cascade's shared-prefix kernel, ``prefill-*`` the tiled prefill kernel and
``skinny-*`` the backend's default configurations of the skinny matmul kernels.

Every constexpr is passed explicitly (Triton's raw compile does not apply the defaults of a
kernel's signature): the variant's values, else the signature's defaults. Like a real launch,
pointers and the int arguments that are multiples of 16 at the modelled shape get Triton's
``tt.divisibility`` 16 hint (except ``do_not_specialize`` arguments); without it the loads are
narrow and synchronous, so the counts would not be those of the launched kernel.

    python benchmarks/triton_resources.py [--arch 90] [--dtype bf16] [--only TEXT]
                                          [--no-hints] [--dump DIR]

``--no-hints`` compiles without the divisibility hints (the tool's old behaviour).
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
from triton_variants import Shape, Variant, variants  # noqa: E402

SASS_KINDS = ("LDS", "STS", "LDSM", "BAR", "I2F", "I2FP", "F2FP", "HMMA", "HGMMA", "LDL",
              "STL", "LDG", "LDGSTS", "LD128", "PRMT", "LOP3")
# Pointer arguments by role (others: the float dtype of the run); "codes" is the page dtype.
POINTER_TYPES = {"k_ptr": "codes", "v_ptr": "codes", "ks_ptr": "*fp16", "vs_ptr": "*fp16",
                 "rot_ptr": "*fp32", "part_out_ptr": "*fp32", "part_lse_ptr": "*fp32",
                 "counter_ptr": "*i32", "slot_ptr": "*i64", "pre_out_ptr": "*fp32",
                 "pre_lse_ptr": "*fp32", "rem_out_ptr": "*fp32", "rem_lse_ptr": "*fp32",
                 "w_slots_ptr": "*i64", "w_offsets_ptr": "*fp32", "w_signs_ptr": "*fp32",
                 "w_key_codes_ptr": "*u8", "w_value_codes_ptr": "*u8",
                 "w_key_scales_ptr": "*fp16", "w_value_scales_ptr": "*fp16",
                 "w_positions_ptr": "*i64"}
INT32_POINTERS = ("page_table_ptr", "context_lens_ptr", "query_start_ptr", "block_seq_ptr",
                  "block_first_ptr", "kv_start_ptr", "ring_pos_ptr", "seq_slots_ptr",
                  "member_seq_ptr", "group_end_ptr", "group_prefix_ptr", "block_group_ptr",
                  "num_blocks_ptr", "seq_member_ptr", "w_seq_slots_ptr",
                  "w_ring_positions_ptr")
FLOAT_SCALARS = ("scale_log2", "qk_scale")
def complete_constexprs(fn: Any, given: dict[str, Any], label: str) -> dict[str, Any]:
    """Every constexpr of ``fn``: the given value, else the signature's default."""
    names = {p.name for p in fn.params if p.is_constexpr}
    unknown = set(given) - names
    if unknown:
        raise ValueError(f"{label}: {fn.__name__} has no constexprs {sorted(unknown)}; "
                         "update the variant to the kernel's signature")
    out = {}
    for param in fn.params:
        if not param.is_constexpr:
            continue
        if param.name in given:
            out[param.name] = given[param.name]
        elif param.has_default:
            out[param.name] = param.default
        else:
            raise ValueError(f"{label}: constexpr {param.name} of {fn.__name__} has no value "
                             "and no default; add it to the variant")
    return out


def signature_and_hints(variant: Variant, constexprs: dict[str, Any], dtype: str,
                        hints: bool) -> tuple[dict[str, str], dict[tuple[int], list[Any]]]:
    """Argument types, and the divisibility hints a launch would give (if ``hints``)."""
    bits = variant.bits
    codes = "*i32" if bits in (4, 8) else ("*u8" if bits == 6 else f"*{dtype}")
    signature: dict[str, str] = {}
    attrs: dict[tuple[int], list[Any]] = {}
    for index, param in enumerate(variant.fn.params):
        name = param.name
        if name in constexprs:
            signature[name] = "constexpr"
            continue
        if name.endswith("_ptr"):
            role = POINTER_TYPES.get(name, "*i32" if name in INT32_POINTERS else f"*{dtype}")
            signature[name] = codes if role == "codes" else role
            divisible = True  # torch allocations are 16-byte aligned
        elif name in FLOAT_SCALARS:
            signature[name] = "fp32"
            divisible = False
        elif param.do_not_specialize:
            signature[name] = "i32"
            divisible = False
        else:
            if name not in variant.ints:
                raise ValueError(f"{variant.label}: no runtime value for int argument {name}; "
                                 "add it to runtime_ints or the variant's ints")
            signature[name] = "i32"
            divisible = variant.ints[name] % 16 == 0
        if hints and divisible:
            attrs[(index,)] = [["tt.divisibility", 16]]
    return signature, attrs


def _tool(name: str) -> str:
    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)


def measure(variant: Variant, dtype: str, arch: int, hints: bool,
            dump: Path | None) -> dict[str, Any]:
    """Compile one variant; its resource figures."""
    constexprs = complete_constexprs(variant.fn, variant.constexprs, variant.label)
    signature, attrs = signature_and_hints(variant, constexprs, dtype, hints)
    source = ASTSource(fn=variant.fn, signature=signature, constexprs=constexprs, attrs=attrs)
    options: dict[str, Any] = {"num_warps": variant.warps, "num_stages": variant.stages}
    if variant.maxnreg is not None:
        options["maxnreg"] = variant.maxnreg
    kernel = triton.compile(source, target=GPUTarget("cuda", arch, 32), options=options)
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(kernel.asm["cubin"])
        cubin.flush()
        usage = subprocess.run([_tool("cuobjdump"), "-res-usage", cubin.name],
                               capture_output=True, text=True, check=True).stdout
        sass = subprocess.run([_tool("nvdisasm"), "-c", cubin.name], capture_output=True,
                              text=True, check=True).stdout
    ttgir = kernel.asm["ttgir"]
    full = [m.group(1) for m in
            re.finditer(r"^\s*/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9._]*)", sass,
                        re.MULTILINE)]
    opcodes = Counter(op.split(".")[0] for op in full)
    opcodes["LD128"] = sum(1 for op in full if op.startswith("LDG") and ".128" in op)
    if dump is not None:
        dump.mkdir(parents=True, exist_ok=True)
        for suffix, text in (("ttgir", ttgir), ("ptx", kernel.asm["ptx"]), ("sass", sass)):
            (dump / f"{variant.label}.{suffix}").write_text(text)
    return {
        "regs": int(re.search(r"REG:(\d+)", usage).group(1)),  # type: ignore[union-attr]
        "stack": int(re.search(r"STACK:(\d+)", usage).group(1)),  # type: ignore[union-attr]
        "smem": kernel.metadata.shared,
        "convert": ttgir.count("ttg.convert_layout"),
        "local_alloc": ttgir.count("ttg.local_alloc"),
        "sass": len(full),
        "waits": "/".join(re.findall(r"async_wait[^{]*\{num = (\d+)", ttgir)) or "-",
        **{kind: opcodes.get(kind, 0) for kind in SASS_KINDS},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", type=int, default=90, help="compute capability, e.g. 90")
    parser.add_argument("--dtype", default="bf16", choices=("bf16", "fp16"))
    parser.add_argument("--heads", type=int, default=32, help="query heads")
    parser.add_argument("--group", type=int, default=4, help="query heads per KV head")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--only", default="", help="substring the variant labels must hold")
    parser.add_argument("--no-hints", action="store_true",
                        help="compile without the divisibility-by-16 hints of real launches")
    parser.add_argument("--dump", type=Path, default=None)
    args = parser.parse_args()
    shape = Shape(heads=args.heads, kv_heads=args.heads // args.group, head_dim=args.head_dim)
    columns = ("regs", "stack", "smem", "convert", "local_alloc", "waits", "sass", *SASS_KINDS)
    widths = [max(7, len(c) + 1) for c in columns]
    print(f"{'variant':48}" + "".join(f"{c:>{w}}" for c, w in zip(columns, widths)))
    for variant in variants(shape):
        if args.only not in variant.label:
            continue
        figures = measure(variant, args.dtype, args.arch, not args.no_hints, args.dump)
        cells = "".join(f"{figures[c]:>{w}}" for c, w in zip(columns, widths))
        print(f"{variant.label:48}{cells}", flush=True)


if __name__ == "__main__":
    main()
