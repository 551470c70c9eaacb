"""Constrained decoding: `Constraint` (what the user asked, pure) and the llguidance-backed
`ConstraintCompiler` / `ConstraintMatcher` (token masks). No torch here; llguidance is imported
only when a constraint is compiled."""

from dyngen_core.text.constraints.compiler import (
    ConstraintCompiler,
    ConstraintMatcher,
    bitmask_to_bool,
    build_matcher,
    mask_words,
)
from dyngen_core.text.constraints.spec import Constraint, as_constraint

__all__ = [
    "Constraint",
    "ConstraintCompiler",
    "ConstraintMatcher",
    "as_constraint",
    "bitmask_to_bool",
    "build_matcher",
    "mask_words",
]
