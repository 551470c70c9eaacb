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

Variants: ``old-*`` the general decode kernel (`paged_attention_kernel`; ``-mw``: with the
in-kernel split merge and step write of small batches; ``-pwN``: its key loop with N page ids
loaded ahead of the tiles, `DecodeOptions.page_window`; ``-sN``: N pipeline stages);
``new-*`` the q8/q4 word decode kernel
(`quant_decode_kernel`) over tiles and launch kinds, without its options and with the
backend's defaults (`triton_quant.WordKernelFlags`, tag ``-vhfw``: letters of the options on);
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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from dyngen_core.attention.triton_cascade_fused import remainder_merge_kernel  # noqa: E402
from dyngen_core.attention.triton_cascade_kernels import prefix_tiles_kernel  # noqa: E402
from dyngen_core.attention.triton_cascade_prefetch import prefix_window_kernel  # noqa: E402
from dyngen_core.attention.triton_kernels import paged_attention_kernel  # noqa: E402
from dyngen_core.attention.triton_prefill import TiledPrefillOptions  # noqa: E402
from dyngen_core.attention.triton_prefill_kernels import tiled_prefill_kernel  # noqa: E402
from dyngen_core.attention.triton_quant import WordKernelFlags  # noqa: E402
from dyngen_core.attention.triton_quant_kernels import quant_decode_kernel  # noqa: E402
from dyngen_core.models import skinny_matmul_kernel  # noqa: E402
from dyngen_core.models.skinny_matmul import DEFAULT_CONFIGS  # noqa: E402

SASS_KINDS = ("LDS", "STS", "LDSM", "BAR", "I2F", "I2FP", "F2FP", "HMMA", "HGMMA", "LDL",
              "STL", "LDG", "LDGSTS", "LD128", "PRMT", "LOP3")
# Pointer arguments by role (others: the float dtype of the run); "codes" is the page dtype.
POINTER_TYPES = {"k_ptr": "codes", "v_ptr": "codes", "ks_ptr": "*fp16", "vs_ptr": "*fp16",
                 "rot_ptr": "*fp32", "part_out_ptr": "*fp32", "part_lse_ptr": "*fp32",
                 "counter_ptr": "*i32", "slot_ptr": "*i64", "pre_out_ptr": "*fp32",
                 "pre_lse_ptr": "*fp32", "rem_out_ptr": "*fp32", "rem_lse_ptr": "*fp32"}
INT32_POINTERS = ("page_table_ptr", "context_lens_ptr", "query_start_ptr", "block_seq_ptr",
                  "block_first_ptr", "kv_start_ptr", "ring_pos_ptr", "seq_slots_ptr",
                  "member_seq_ptr", "group_end_ptr", "group_prefix_ptr", "block_group_ptr",
                  "num_blocks_ptr", "seq_member_ptr")
FLOAT_SCALARS = ("scale_log2", "qk_scale")
# The `WordKernelFlags` fields as `quant_decode_kernel` constexprs, with their label letters.
WORD_FLAGS = {"join_keys": ("K_JOIN", "k"), "join_values": ("V_JOIN", "v"),
              "half_dot": ("HALF_DOT", "h"), "fast_unpack": ("FAST_UNPACK", "f"),
              "wide_scales": ("WIDE_SCALES", "w"), "scale_rows": ("SCALE_ROWS", "r")}


@dataclass(frozen=True)
class Shape:
    """The modelled model and batch (the int arguments' runtime values follow from it)."""

    heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    page_size: int = 256
    pages: int = 4096
    hidden: int = 4096
    ffn: int = 14336

    @property
    def group(self) -> int:
        return self.heads // self.kv_heads


@dataclass(frozen=True)
class Variant:
    """One compile: kernel, the constexprs it is given, launch options, page code bits."""

    label: str
    fn: Any
    constexprs: dict[str, Any]
    warps: int
    bits: int = 0
    stages: int = 3
    ints: dict[str, int] = field(default_factory=dict)


def runtime_ints(shape: Shape, bits: int) -> dict[str, int]:
    """Int arguments of the attention kernels as a launch at ``shape`` passes them (q a view
    of the fused qkv rows; pages [pages, page_size, kv_heads, words]; q8/q4 scales
    [pages, page_size, kv_heads, head_dim / 32] float16, strides 0 for float pages)."""
    # 6-bit rows are bytes, 4- and 8-bit rows int32 words.
    words = shape.head_dim * bits // (8 if bits == 6 else 32) if bits else shape.head_dim
    groups = shape.head_dim // 32 if bits else 0
    qkv = (shape.heads + 2 * shape.kv_heads) * shape.head_dim
    values = {"stride_qt": qkv, "stride_qh": shape.head_dim,
              "stride_er": shape.kv_heads * shape.head_dim, "stride_eh": shape.head_dim,
              "stride_ot": shape.heads * shape.head_dim, "stride_oh": shape.head_dim,
              "stride_skt": qkv, "stride_skh": shape.head_dim, "stride_svt": qkv,
              "stride_svh": shape.head_dim, "num_slots": shape.pages * shape.page_size,
              "head_programs": shape.kv_heads}
    for kind in ("k", "v"):
        values |= {f"stride_{kind}p": shape.page_size * shape.kv_heads * words,
                   f"stride_{kind}s": shape.kv_heads * words, f"stride_{kind}h": words,
                   f"stride_{kind}sp": shape.page_size * shape.kv_heads * groups,
                   f"stride_{kind}ss": shape.kv_heads * groups, f"stride_{kind}sh": groups}
    return values


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
    kernel = triton.compile(source, target=GPUTarget("cuda", arch, 32),
                            options={"num_warps": variant.warps, "num_stages": variant.stages})
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


# (page bits, head rows, exact window, in-kernel merge and write, page ids loaded ahead,
# stages) of the general decode kernel's variants.
GENERAL_DECODES = ((0, False, 0, False, 0, 3), (0, False, 0, True, 0, 3),
                   (8, True, 0, False, 0, 3), (4, True, 0, False, 0, 3),
                   (4, True, 16, False, 0, 3),
                   (0, False, 0, False, 2, 3), (0, False, 0, False, 4, 3),
                   (0, False, 0, False, 16, 3), (0, False, 0, True, 4, 3),
                   (0, False, 0, False, 4, 4), (0, False, 0, True, 4, 4),
                   (6, True, 0, False, 0, 3), (6, True, 0, False, 4, 3),
                   (6, True, 16, False, 0, 3), (6, True, 16, False, 4, 3))


def general_decode_variants(shape: Shape) -> list[Variant]:
    """`paged_attention_kernel` decodes (4 splits, the backend's 64 keys x 4 warps); tags:
    ``-mw`` the in-kernel split merge and step write, ``-pwN`` N page ids loaded ahead of the
    tiles (`DecodeOptions.page_window`), ``-sN`` N pipeline stages (else 3)."""
    group_pad = 1 << (shape.group - 1).bit_length()
    rows = max(16, group_pad)
    out = []
    for bits, heads, window, in_kernel, page_window, stages in GENERAL_DECODES:
        name = "fp16" if bits == 0 else f"q{bits}"
        out.append(Variant(
            f"old-{name}-w{window}-n64x4" + ("-mw" if in_kernel else "")
            + (f"-pw{page_window}" if page_window else "")
            + (f"-s{stages}" if stages != 3 else ""),
            paged_attention_kernel, {
                "G": shape.group, "G_PAD": group_pad, "BLOCK_Q": 1, "BLOCK_M": rows,
                "BLOCK_N": 64, "HEAD_DIM": shape.head_dim, "HEAD_PAD": shape.head_dim,
                "PAGE_SIZE": shape.page_size, "K_BITS": bits, "V_BITS": bits, "NUM_SPLITS": 4,
                "DECODE": True, "REMAINDER": False, "WRITE_PARTIALS": True, "HEADS": heads,
                "WINDOW": window, "DOT_PRECISION": "tf32", "MERGE": in_kernel,
                "SPLIT_BLOCK": min(4, max(1, 64 // group_pad)) if in_kernel else 1,
                "WRITE_STEP": in_kernel, "PAGE_WINDOW": page_window},
            4, bits, stages=stages, ints=runtime_ints(shape, bits)))
    return out


def word_flag_sets(bits: int) -> dict[str, dict[str, bool]]:
    """Tag -> `quant_decode_kernel` option constexprs: none, and the backend's defaults for
    ``bits``-bit pages."""
    defaults = {name: on for name, on in WordKernelFlags().keywords(bits).items()
                if name in WORD_FLAGS}
    chosen = {WORD_FLAGS[name][0]: bool(on) for name, on in defaults.items()}
    tag = "".join(WORD_FLAGS[name][1] for name, on in defaults.items() if on)
    return {"": {flag: False for flag, _ in WORD_FLAGS.values()}, tag: chosen}


def word_decode_variants(shape: Shape) -> list[Variant]:
    """`quant_decode_kernel` over tiles (keys x warps) and launch kinds, with and without
    the backend's default options (the backend: 64 x 4, pages and tail in two launches)."""
    rows = max(16, 1 << (shape.group - 1).bit_length())
    out = []
    for bits, window in ((8, 0), (4, 0), (4, 16)):
        for block_n, warps in ((32, 4), (64, 4), (64, 8), (128, 8)):
            for programs, role in (("both", 0), ("pages", 1), ("tail", 2)):
                for tag, flags in word_flag_sets(bits).items():
                    pad = max(shape.head_dim, 16 * 32 // bits)
                    out.append(Variant(
                        f"new-q{bits}-w{window}-n{block_n}x{warps}-{programs}"
                        + (f"-{tag}" if tag else ""), quant_decode_kernel, {
                            "G": shape.group, "BLOCK_M": rows, "BLOCK_N": block_n,
                            "HEAD_DIM": shape.head_dim, "DIM_PAD": pad,
                            "PAGE_SIZE": shape.page_size, "K_BITS": bits, "V_BITS": bits,
                            "NUM_SPLITS": 4, "WINDOW": window, "DOT_PRECISION": "tf32",
                            "PROGRAMS": role, **flags},
                        warps, bits, ints=runtime_ints(shape, bits)))
    return out


# (page ids loaded ahead, stages, scale rows) of `word_window_variants`.
WORD_WINDOWS = ((0, 2, False), (0, 3, False), (0, 4, False), (4, 2, False), (4, 3, False),
                (4, 4, False), (8, 3, False), (0, 3, True), (4, 2, True), (4, 3, True),
                (4, 4, True), (8, 3, True))


def word_window_variants(shape: Shape) -> list[Variant]:
    """The word kernel's page programs (64 x 4, the backend's default options) with page ids
    loaded ahead (``-pwW``: PAGE_WINDOW W, 0 the per-block load) at ``-sS`` pipelining stages,
    ``-r`` with scale rows (SCALE_ROWS): the ``waits`` column shows whether the key loop
    keeps copies in flight."""
    rows = max(16, 1 << (shape.group - 1).bit_length())
    out = []
    for bits, window in ((8, 0), (4, 16)):
        tag, flags = list(word_flag_sets(bits).items())[-1]
        for page_window, stages, scale_rows in WORD_WINDOWS:
            out.append(Variant(
                f"new-q{bits}-w{window}-n64x4-pages-{tag}-pw{page_window}-s{stages}"
                + ("-r" if scale_rows else ""), quant_decode_kernel, {
                    "G": shape.group, "BLOCK_M": rows, "BLOCK_N": 64,
                    "HEAD_DIM": shape.head_dim, "DIM_PAD": max(shape.head_dim, 512 // bits),
                    "PAGE_SIZE": shape.page_size, "K_BITS": bits, "V_BITS": bits,
                    "NUM_SPLITS": 4, "WINDOW": window, "DOT_PRECISION": "tf32",
                    "PROGRAMS": 1, **flags, "PAGE_WINDOW": page_window,
                    "SCALE_ROWS": scale_rows},
                4, bits, stages=stages, ints=runtime_ints(shape, bits)))
    return out


def other_kernel_variants(shape: Shape) -> list[Variant]:
    """The cascade's prefix kernel (backend: 64 rows x 64 keys x 4 warps, 3 stages), its
    page-prefetching form and its fused own-keys pass (one split and several), the
    tiled prefill (`TiledPrefillOptions` defaults, whole group per tile) and the skinny
    matmul kernels of `skinny_matmul.DEFAULT_CONFIGS` (at the class's Llama-3-8B shape)."""
    group_pad = 1 << (shape.group - 1).bit_length()
    ints = runtime_ints(shape, 0)
    out = [Variant("prefix-tiles-m64-n64x4", prefix_tiles_kernel, {
        "G": shape.group, "G_PAD": group_pad, "BLOCK_M": 64, "BLOCK_N": 64,
        "HEAD_DIM": shape.head_dim, "HEAD_PAD": shape.head_dim, "PAGE_SIZE": shape.page_size,
        "DOT_PRECISION": "tf32"}, 4, stages=3, ints=ints)]
    for rows, block_n, warps, stages in ((64, 32, 4, 4), (64, 64, 8, 3), (128, 32, 8, 4)):
        out.append(Variant(  # page ids loaded ahead (benchmarks/cascade_kernel.py's win*)
            f"prefix-window-m{rows}-n{block_n}x{warps}-s{stages}", prefix_window_kernel, {
                "G": shape.group, "G_PAD": group_pad, "BLOCK_M": rows, "BLOCK_N": block_n,
                "HEAD_DIM": shape.head_dim, "HEAD_PAD": shape.head_dim,
                "PAGE_SIZE": shape.page_size, "WINDOW": 16, "DOT_PRECISION": "tf32"},
            warps, stages=stages, ints=ints))
    # The fused own-keys pass (`CascadeOptions` defaults; -w4: 4 page ids loaded ahead).
    for split, window in ((False, 0), (True, 0), (False, 4), (True, 4)):
        out.append(Variant(
            f"cascade-rem-fused-m16-n64x4{'-split' if split else ''}"
            f"{f'-w{window}' if window else ''}", remainder_merge_kernel, {
                "G": shape.group, "G_PAD": group_pad, "BLOCK_M": max(16, group_pad),
                "BLOCK_N": 64, "HEAD_DIM": shape.head_dim, "HEAD_PAD": shape.head_dim,
                "PAGE_SIZE": shape.page_size, "SPLIT": split, "SPLIT_BLOCK": 4,
                "WINDOW": window, "DOT_PRECISION": "tf32"}, 4, stages=3, ints=ints))
    tiled = TiledPrefillOptions()
    out.append(Variant(
        f"prefill-m{tiled.rows}-n{tiled.block_n}x{tiled.warps}-s{tiled.stages}",
        tiled_prefill_kernel, {
            "G": shape.group, "SUBGROUPS": 1, "HEADS_PER_TILE": group_pad,
            "BLOCK_Q": tiled.rows // group_pad, "BLOCK_N": tiled.block_n,
            "HEAD_DIM": shape.head_dim, "HEAD_PAD": shape.head_dim,
            "PAGE_SIZE": shape.page_size, "DOT_PRECISION": "tf32"},
        tiled.warps, stages=tiled.stages, ints=ints))
    sizes = {"narrow": (shape.hidden, shape.hidden), "long_k": (shape.hidden, shape.ffn),
             "wide": (shape.ffn, shape.hidden)}
    for (row_count, weights), config in DEFAULT_CONFIGS.items():
        if config is None:
            continue
        n, k = sizes[weights]
        block_m = config.rows_per_program(1 if row_count == "1" else 16)
        constexprs = {"HAS_BIAS": False, "EVEN_K": k % config.block_k == 0, "BLOCK_M": block_m,
                      "BLOCK_N": config.block_n, "BLOCK_K": config.block_k,
                      "NUM_STAGES": config.num_stages}
        if config.kernel == "reduce":
            constexprs["PREFETCH"] = config.prefetch
        out.append(Variant(
            f"skinny-{config.kernel}-{row_count}-{weights}-m{block_m}n{config.block_n}"
            f"k{config.block_k}s{config.num_stages}", getattr(
                skinny_matmul_kernel, f"skinny_{config.kernel}_kernel"), constexprs,
            config.num_warps, stages=config.num_stages,
            ints={"M": 1 if row_count == "1" else 16, "N": n, "K": k, "stride_xm": k,
                  "stride_wn": k, "stride_ym": n}))
    return out


def variants(shape: Shape) -> list[Variant]:
    """Every variant compared, in print order."""
    return (general_decode_variants(shape) + word_decode_variants(shape)
            + word_window_variants(shape) + other_kernel_variants(shape))


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
    print(f"{'variant':42}" + "".join(f"{c:>{w}}" for c, w in zip(columns, widths)))
    for variant in variants(shape):
        if args.only not in variant.label:
            continue
        figures = measure(variant, args.dtype, args.arch, not args.no_hints, args.dump)
        cells = "".join(f"{figures[c]:>{w}}" for c, w in zip(columns, widths))
        print(f"{variant.label:42}{cells}", flush=True)


if __name__ == "__main__":
    main()
