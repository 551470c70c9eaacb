"""Constrained decoding: the shapes a job's output can be held to, and the token masks that
hold it there.

A job takes ``Job(constraint=...)``: anything `as_constraint` accepts, which is

- a `Constraint` (build one explicitly with `Constraint.json_schema(schema,
  flexible_whitespace=False)`, `Constraint.regex(pattern)`, `Constraint.grammar(text,
  syntax="lark" | "gbnf")` or `Constraint.choice(options)`);
- a dict or a pydantic model class: a JSON schema;
- a list or tuple of strings: a choice of exactly one of them;
- a compiled ``re.Pattern``: a regex (Rust ``regex`` syntax: no look-around or
  back-references);
- a string: a Lark grammar when a line starts with ``start:``, a GBNF grammar when it holds
  ``::=``, a JSON schema when it parses as a JSON object, else a regex.

The whole completion must match. JSON output is compact (``", "`` and ``": "`` separators)
unless ``flexible_whitespace`` is set. A malformed constraint raises
`dyngen_core.errors.JobError` when it is built; one the grammar engine rejects raises it when
the job is enqueued (through a `BackgroundGenerator`, from the job's handle).

`ConstraintCompiler` (one per tokenizer: ``ConstraintCompiler.from_tokenizer(tokenizer,
vocab_size)``) compiles a constraint into a `ConstraintMatcher`, one job's parser state: its
``allowed_mask()`` (bool ``[vocab_size]``), ``accept(token_id)``, ``rollback(n)``,
``is_accepting()`` and ``is_terminated()``. The engine does this itself; these two are public
for tools that check or explore a constraint outside generation. llguidance is imported only
when a constraint is compiled; nothing here imports torch.
"""

from __future__ import annotations

from dyngen_core.text.constraints import (
    Constraint,
    ConstraintCompiler,
    ConstraintMatcher,
    as_constraint,
)

__all__ = ["Constraint", "ConstraintCompiler", "ConstraintMatcher", "as_constraint"]
