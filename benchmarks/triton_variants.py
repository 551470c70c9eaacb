"""The kernel variants `triton_resources.py` compiles: the modelled shape, one `Variant` per
compile (kernel, constexprs, launch options) and the lists of them, by kernel family (see that
script's docstring for the labels)."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dyngen_core.kv.attention.triton.cascade_kernels import (  # noqa: E402
    own_keys_kernel,
    prefix_tiles_kernel,
)
from dyngen_core.kv.attention.triton.kernels import paged_attention_kernel  # noqa: E402
from dyngen_core.kv.attention.triton.prefill import TiledPrefillOptions  # noqa: E402
from dyngen_core.kv.attention.triton.prefill_kernels import tiled_prefill_kernel  # noqa: E402
from dyngen_core.kv.attention.triton.quant import WordKernelFlags  # noqa: E402
from dyngen_core.kv.attention.triton.quant_kernels import quant_decode_kernel  # noqa: E402
from dyngen_core.ops import skinny_matmul_kernel  # noqa: E402
from dyngen_core.ops.skinny_matmul import DEFAULT_CONFIGS  # noqa: E402

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
    maxnreg: int | None = None


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
              "head_programs": shape.kv_heads,
              # the word kernel's step write (`StepQuantWrite`): k/v views of the fused rows
              "stride_wkt": qkv, "stride_wkh": shape.head_dim, "stride_wvt": qkv,
              "stride_wvh": shape.head_dim, "w_num_slots": shape.pages * shape.page_size,
              "w_num_pages": shape.pages, "w_slots_held": 1, "w_tokens": 1}
    for kind in ("k", "v"):
        values |= {f"stride_{kind}p": shape.page_size * shape.kv_heads * words,
                   f"stride_{kind}s": shape.kv_heads * words, f"stride_{kind}h": words,
                   f"stride_{kind}sp": shape.page_size * shape.kv_heads * groups,
                   f"stride_{kind}ss": shape.kv_heads * groups, f"stride_{kind}sh": groups}
    return values


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


def word_merge_variants(shape: Shape) -> list[Variant]:
    """The word kernel as the backend launches it at batch 1 (32 splits, 64 x 4, its default
    options and page window; the tail without the window) per launch kind, with the splits
    merged by `combine_splits_kernel` or in the kernel (``-merge``: MERGE, 16 partials a
    round over the group's 4 rows, as `attend_word_decode`'s merge_rows 64)."""
    rows = max(16, 1 << (shape.group - 1).bit_length())
    group_pad = 1 << (shape.group - 1).bit_length()
    out = []
    for bits, window in ((8, 0), (4, 16)):
        tag, flags = list(word_flag_sets(bits).items())[-1]
        for programs, role in (("both", 0), ("pages", 1), ("tail", 2)):
            for merge in (False, True):
                out.append(Variant(
                    f"new-q{bits}-w{window}-n64x4-{programs}-{tag}-s32"
                    + ("-merge" if merge else ""), quant_decode_kernel, {
                        "G": shape.group, "BLOCK_M": rows, "BLOCK_N": 64,
                        "HEAD_DIM": shape.head_dim, "DIM_PAD": max(shape.head_dim, 512 // bits),
                        "PAGE_SIZE": shape.page_size, "K_BITS": bits, "V_BITS": bits,
                        "NUM_SPLITS": 32, "WINDOW": window, "DOT_PRECISION": "tf32",
                        "PROGRAMS": role, **flags, "PAGE_WINDOW": 0 if role == 2 else 4,
                        "MERGE": merge, "G_PAD": group_pad,
                        "SPLIT_BLOCK": min(64, 64 // group_pad)},
                    4, bits, ints=runtime_ints(shape, bits)))
    return out


def word_tail_variants(shape: Shape) -> list[Variant]:
    """The q4 word kernel as the backend launches it at batch 1 (16-position window, 64 x 4,
    its default options, page window 4, in-kernel merge) with its tail in ``-tT`` parts
    (`attend_word_decode`'s tail_parts; t1 the single serial tail), over 32 and 64 page splits
    (``-sN``), in one launch (``both``) and the tail launch of two (``tail``); ``-nR``: at
    most R registers a thread (max_registers, the one launch's default with parts);
    ``-write``: the storage's step write in the tail (WRITE_STEP, `StepQuantWrite`)."""
    rows = max(16, 1 << (shape.group - 1).bit_length())
    group_pad = 1 << (shape.group - 1).bit_length()
    tag, flags = list(word_flag_sets(4).items())[-1]
    write = {"WRITE_STEP": True, "W_HEADS": shape.kv_heads, "W_HAS_OFFSETS": True,
             "W_ROWS": max(1, shape.head_dim // 32), "W_INV_SQRT": 32 ** -0.5}
    out = []
    for programs, role, splits, parts, cap, writes in (
            ("both", 0, 32, 1, None, False), ("both", 0, 32, 2, 168, False),
            ("both", 0, 32, 3, None, False), ("both", 0, 32, 3, 168, False),
            ("both", 0, 32, 4, 168, False), ("both", 0, 64, 1, None, False),
            ("both", 0, 64, 3, 168, False), ("tail", 2, 32, 1, None, False),
            ("tail", 2, 32, 3, None, False), ("both", 0, 32, 1, None, True),
            ("tail", 2, 32, 3, None, True)):
        out.append(Variant(
            f"new-q4-w16-n64x4-{programs}-{tag}-s{splits}-merge-t{parts}"
            + (f"-n{cap}" if cap else "") + ("-write" if writes else ""),
            quant_decode_kernel, {
                "G": shape.group, "BLOCK_M": rows, "BLOCK_N": 64, "HEAD_DIM": shape.head_dim,
                "DIM_PAD": max(shape.head_dim, 128), "PAGE_SIZE": shape.page_size,
                "K_BITS": 4, "V_BITS": 4, "NUM_SPLITS": splits, "WINDOW": 16,
                "DOT_PRECISION": "tf32", "PROGRAMS": role, **flags,
                "PAGE_WINDOW": 0 if role == 2 else 4, "MERGE": True, "G_PAD": group_pad,
                "SPLIT_BLOCK": min(64, 64 // group_pad), "TAIL_PARTS": parts,
                **(write if writes else {})},
            4, 4, ints=runtime_ints(shape, 4), maxnreg=cap))
    return out


def other_kernel_variants(shape: Shape) -> list[Variant]:
    """The cascade's prefix kernel (backend: 64 rows x 64 keys x 4 warps, 3 stages) and its
    own-keys pass (one split and several, page ids loaded per key or 4 ahead), the tiled
    prefill (`TiledPrefillOptions` defaults, whole group per tile) and the skinny
    matmul kernels of `skinny_matmul.DEFAULT_CONFIGS` (at the class's Llama-3-8B shape)."""
    group_pad = 1 << (shape.group - 1).bit_length()
    ints = runtime_ints(shape, 0)
    out = [Variant("prefix-tiles-m64-n64x4", prefix_tiles_kernel, {
        "G": shape.group, "G_PAD": group_pad, "BLOCK_M": 64, "BLOCK_N": 64,
        "HEAD_DIM": shape.head_dim, "HEAD_PAD": shape.head_dim, "PAGE_SIZE": shape.page_size,
        "DOT_PRECISION": "tf32"}, 4, stages=3, ints=ints)]
    # The own-keys pass (`cascade_path` defaults; -w4: 4 page ids loaded ahead).
    for split, window in ((False, 0), (True, 0), (False, 4), (True, 4)):
        out.append(Variant(
            f"cascade-own-m16-n64x4{'-split' if split else ''}"
            f"{f'-w{window}' if window else ''}", own_keys_kernel, {
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
            + word_window_variants(shape) + word_merge_variants(shape)
            + word_tail_variants(shape) + other_kernel_variants(shape))
