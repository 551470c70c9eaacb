"""The kernel benchmarks' own tools, which decide A/Bs: ``--set``
(`benchmarks/kernels/constants.py`: the kernel constant a run patches, and its errors), the
SASS reading of `benchmarks/kernels/quant_sass.py` (instructions, loops, the key loop's
instruction mix) on a hand-written listing, and the skinny sweep's choice of a setting per
shape class (`benchmarks/kernels/skinny_sweep.best_per_class`) on made-up timings, the
step A/B's variants (`benchmarks/step_ab.variant_settings`), and the start-up's compile clock
(`benchmarks/_common.CompileClock`) on hook calls made by hand. No GPU and no triton: the SASS is
a string, the timings are numbers."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from benchmarks import step_ab
from benchmarks._common import CompileClock
from benchmarks.kernels import constants, quant_sass, skinny_sweep
from dyngen_core.kv.attention.triton import decode
from dyngen_core.ops.skinny_matmul import SkinnyConfig

# Two loops: an outer one (0x0040-0x00c0) around an inner one with a key dot (0x0060-0x00a0),
# and a separate loop without one (0x00e0-0x0100). Predicated instructions count by opcode.
SASS = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
        /*0040*/                   LDGSTS.E.BYPASS.128 [R2], desc[UR4][R4.64] ;
        /*0060*/                   IMMA.16832.S8.S8 R8, R12, R16, R8 ;
        /*0070*/               @P0 LOP3.LUT R3, R3, 0xf, RZ, 0xc0, !PT ;
        /*0080*/              @!P1 LOP3.LUT R5, R5, 0xf0, RZ, 0xc0, !PT ;
        /*0090*/                   HADD2 R6, R6, R7 ;
        /*00a0*/               @P2 BRA 0x60 ;
        /*00b0*/                   BAR.SYNC.DEFER_BLOCKING 0x0 ;
        /*00c0*/                   BRA 0x40 ;
        /*00e0*/                   FADD R9, R9, R10 ;
        /*0100*/                   BRA 0xe0 ;
        /*0110*/                   EXIT ;
"""


def test_instructions_and_loops_are_read_from_the_listing() -> None:
    code = quant_sass.instructions(SASS)
    assert code[0] == (0x0, "MOV R1, c[0x0][0x28]")
    assert len(code) == 12
    spans = {(code[first][0], code[last][0]) for first, last in quant_sass.loops(code)}
    assert spans == {(0x60, 0xa0), (0x40, 0xc0), (0xe0, 0x100)}


def test_the_mix_counts_opcodes_without_predicates_or_modifiers() -> None:
    code = quant_sass.instructions(SASS)
    ops = quant_sass.mix([text for _, text in code])
    assert ops["LOP3"] == 2 and ops["BRA"] == 3 and ops["IMMA"] == 1 and ops["BAR"] == 1


def test_only_the_innermost_loop_with_key_dots_is_reported(capsys) -> None:
    quant_sass.print_key_loops(SASS, warps_per_key=4 / 64)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("key loop 0x60-0xa0: 5 instructions a thread a pass")
    assert "(0.3 warp instructions a key and KV head)" in lines[0]
    assert lines[1].split(", ")[0] == "   LOP3 2"
    assert len(lines) == 2  # neither the outer loop nor the loop without IMMA


def test_a_patched_constant_holds_inside_the_block_only() -> None:
    before = decode.MAX_SPLITS
    with constants.patched(["decode.MAX_SPLITS=7", "decode.PROGRAMS_PER_SM=2"]):
        assert decode.MAX_SPLITS == 7 and decode.PROGRAMS_PER_SM == 2
    assert decode.MAX_SPLITS == before


@pytest.mark.parametrize(("setting", "message"), [
    ("nowhere.X=1", "MODULE one of"),
    ("decode=1", "MODULE one of"),
    ("decode.NO_SUCH_CONSTANT=1", "has no constant NO_SUCH_CONSTANT"),
    ("decode.MAX_SPLITS=sixteen", "is not a Python literal"),
])
def test_a_bad_setting_names_what_is_wrong(setting: str, message: str) -> None:
    with pytest.raises(SystemExit, match=message):
        constants.apply([setting])


def test_the_sweep_picks_each_class_by_its_shapes_launches_in_a_step() -> None:
    """A class's setting is the least time over a step's launches of its swept shapes: gate/up
    32 times a step outweighs lm_head once, q/k/v and o count alike, a setting timed for one
    shape of a class only is never picked, and a class nobody swept gets no entry."""
    a = SkinnyConfig("reduce", block_n=4, block_k=256)
    b = SkinnyConfig("reduce", block_n=8, block_k=512)
    c = SkinnyConfig("reduce", block_n=16, block_k=512)
    best = skinny_sweep.best_per_class({
        # wide: a is 1 us faster on gate/up (x32), b 20 us faster on lm_head (x1): a wins.
        "gate_up": [(58e-6, a), (59e-6, b)],
        "lm_head": [(260e-6, a), (240e-6, b)],
        # narrow: b loses on qkv by 0.2 us but wins on o by 0.5 us; c is timed on qkv alone.
        "qkv": [(10e-6, c), (15.0e-6, a), (15.2e-6, b)],
        "o": [(11.5e-6, a), (11.0e-6, b)],
    })
    assert best == {("1", "wide"): a, ("1", "narrow"): b}
    assert skinny_sweep.best_per_class({"down": [(31e-6, b), (30e-6, a)]}) == {("1", "long_k"): a}


def test_step_ab_variants_are_settings_lists() -> None:
    assert step_ab.variant_settings("") == []
    assert step_ab.variant_settings(" skinny_matmul.GATED=False , decode.BLOCK_N=32") == [
        "skinny_matmul.GATED=False", "decode.BLOCK_N=32"]
    with constants.patched(step_ab.variant_settings("decode.BLOCK_N=8")):
        assert decode.BLOCK_N == 8


def test_compile_clock_counts_by_kernel_and_restores_the_hooks() -> None:
    knobs = pytest.importorskip("triton").knobs
    before = (knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook)
    with CompileClock() as clock:
        assert knobs.runtime.jit_cache_hook == clock._before
        for key, name in ((1, "norm"), (2, "norm"), (3, "attention")):
            assert clock._before(key=key) is False  # a true answer would skip the compile
            clock._after(key=key, fn=SimpleNamespace(name=name))
    assert (knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook) == before
    summary = clock.summary()
    assert summary["triton_compiles"] == 3
    assert {name: figures[0] for name, figures in summary["triton_by_kernel"].items()} == {
        "norm": 2, "attention": 1}
