"""`Job`: one user request, validated at construction, plus its user-visible progress.

A job carries what the user asked for (prompt ids, budget, stop conditions, sampling settings,
extras) and counters the generator fills in. It holds no reference to the generator, the
scheduler or the cache: those keep their own state keyed by ``job.job_id``.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any

from dyngen_core.errors import JobError


def as_token_list(input_ids: Any) -> list[int]:
    """Accept a list of ints or a 1-D / (1, n) tensor or array; return a list of ints."""
    if hasattr(input_ids, "tolist"):
        shape = tuple(getattr(input_ids, "shape", ()))
        if len(shape) == 2 and shape[0] == 1:
            input_ids = input_ids[0]
        elif len(shape) != 1:
            raise JobError(f"input_ids must be 1-D or shaped (1, n); got shape {shape}")
        input_ids = input_ids.tolist()
    if isinstance(input_ids, (str, bytes)) or not isinstance(input_ids, Sequence):
        raise JobError(
            "input_ids must be a list of token ids or a tensor; encode text first with "
            "tokenizer.encode(text)"
        )
    try:
        ids = [_token_id(t) for t in input_ids]
    except TypeError as exc:
        raise JobError(f"input_ids must hold integer token ids: {exc}") from None
    if not ids:
        raise JobError("input_ids is empty; a job needs at least one prompt token")
    return ids


def _token_id(value: Any) -> int:
    """``value`` as a token id: an integer (a Python or numpy int), never a float or a bool."""
    if isinstance(value, bool):
        raise TypeError(f"{value!r} is a bool, not a token id")
    return operator.index(value)


def _integer(name: str, value: Any, minimum: int | None = None) -> int:
    """An integer option (a Python or numpy int, not a bool or a float), at least ``minimum``
    when given, or a `JobError` naming it."""
    try:
        number = _token_id(value)
    except TypeError:
        number = None
    if number is None or minimum is not None and number < minimum:
        bound = f" >= {minimum}" if minimum is not None else ""
        raise JobError(f"{name} must be an int{bound}; got {value!r} ({type(value).__name__})")
    return number


def split_stop_conditions(stop_conditions: Any) -> tuple[frozenset[int], tuple[str, ...]]:
    """Split a list of token ids and strings into (ids, strings); a bare string is an error."""
    if stop_conditions is None:
        return frozenset(), ()
    if isinstance(stop_conditions, (str, bytes)):
        raise TypeError(
            f"stop_conditions must be a list of token ids and strings, not a bare string; "
            f"write stop_conditions=[{stop_conditions!r}]"
        )
    ids: set[int] = set()
    strings: list[str] = []
    for cond in stop_conditions:
        if isinstance(cond, str):
            if not cond:
                raise JobError("an empty string cannot be a stop condition")
            strings.append(cond)
        elif isinstance(cond, int) and not isinstance(cond, bool):
            ids.add(cond)
        else:
            raise TypeError(f"stop condition {cond!r} is neither a token id (int) nor a string")
    return frozenset(ids), tuple(strings)


class Job:
    """A generation request for `DynamicGenerator.enqueue`.

    Args:
        input_ids: prompt token ids: a list of ints or a 1-D / (1, n) tensor.
        max_new_tokens: most tokens to generate (at least 1).
        min_new_tokens: stop tokens and stop strings are ignored until this many were generated.
        stop_conditions: token ids and strings that end the job; a matched string is cut from
            the text, a stop token never appears as text. None (the default) means the model's
            end-of-sequence ids; [] means none (only max_new_tokens ends the job). With a
            ``constraint``, a stop string ends the job only where the reply before it is
            complete under the constraint: it never cuts a structure the constraint is writing
            (a JSON value, a forced tool call), and still ends free text the constraint allows.
        gen_settings: a `SamplerSettings`; None uses the model's generation_config.json defaults.
        identifier: any object, echoed in every result of this job.
        seed: makes sampling reproducible regardless of which other jobs share the batch.
        return_probs: add ``token_probs`` (probability of each sampled token) to results.
        return_top_tokens: add the k most likely tokens and their probabilities per step.
        return_logits: add the raw logits row of each step.
        decode_special_tokens: show special tokens in the text.
        banned_strings: strings that must never appear in the output (case-insensitive); on a
            match the job rewinds and samples again.
        constraint: a JSON schema (dict or pydantic model class), a regex, a grammar or a list
            of choices; see `dyngen_core.text.constraints`.
        speculative: let the generator draft tokens for this job when it was built with a
            drafter (n-gram or draft model); False opts out. Output is the same either way.
    """

    def __init__(
        self,
        input_ids: Any,
        max_new_tokens: int,
        *,
        min_new_tokens: int = 0,
        stop_conditions: Sequence[int | str] | None = None,
        gen_settings: Any = None,
        identifier: Any = None,
        seed: int | None = None,
        return_probs: bool = False,
        return_top_tokens: int = 0,
        return_logits: bool = False,
        decode_special_tokens: bool = False,
        banned_strings: Sequence[str] | None = None,
        constraint: Any = None,
        speculative: bool = True,
    ) -> None:
        self.input_ids = as_token_list(input_ids)
        max_new_tokens = _integer("max_new_tokens", max_new_tokens, 1)
        min_new_tokens = _integer("min_new_tokens", min_new_tokens, 0)
        if min_new_tokens > max_new_tokens:
            raise JobError(
                f"min_new_tokens must be between 0 and max_new_tokens ({max_new_tokens}); "
                f"got {min_new_tokens!r}"
            )
        return_top_tokens = _integer("return_top_tokens", return_top_tokens, 0)
        if seed is not None:
            seed = _integer("seed", seed)
        if isinstance(banned_strings, str):
            raise TypeError("banned_strings must be a list of strings, not a bare string")
        if any(not isinstance(b, str) or not b for b in banned_strings or ()):
            raise JobError(f"banned_strings must hold non-empty strings; got {banned_strings!r}")
        self.max_new_tokens = max_new_tokens
        self.min_new_tokens = min_new_tokens
        self.stop_token_ids, self.stop_strings = split_stop_conditions(stop_conditions)
        self.uses_default_stops = stop_conditions is None
        self.gen_settings = gen_settings
        self.identifier = identifier
        self.seed = seed
        self.return_probs = return_probs
        self.return_top_tokens = return_top_tokens
        self.return_logits = return_logits
        self.decode_special_tokens = decode_special_tokens
        self.banned_strings = tuple(banned_strings or ())
        self.constraint = constraint
        if not isinstance(speculative, bool):
            raise JobError(f"speculative must be True or False; got {speculative!r}")
        self.speculative = speculative
        self.job_id: int | None = None  # assigned by the generator at enqueue
        self.new_token_ids: list[int] = []
        self.finished = False

    def __repr__(self) -> str:
        return (
            f"Job(id={self.job_id}, identifier={self.identifier!r}, "
            f"prompt={len(self.input_ids)} tokens, max_new_tokens={self.max_new_tokens})"
        )
