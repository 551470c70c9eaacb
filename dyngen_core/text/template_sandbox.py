"""The sandbox chat templates run in: transformers' jinja2 environment, bounded in time and size.

Chat templates come from model folders, so they are untrusted code. `LimitedTemplate` compiles
one in jinja2's immutable sandbox with transformers' environment (trim_blocks, lstrip_blocks,
loopcontrols, the ``{% generation %}`` tag, ``raise_exception``, ``strftime_now``, a ``tojson``
that keeps non-ASCII text and does not escape HTML) and renders it within `TemplateLimits`.

The limits are checked inside the sandbox, per render: the deadline at every loop iteration
(a code-generator hook wraps each for-loop's iterable), call and filter; the size of every
value built, of everything printed (macro and ``{% set %}`` bodies included) and of the output.
Repetition, powers, %- and str.format widths, padding, replace and join are sized before they
run, since their result can dwarf their operands. Pure Python: no torch.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import re
import time
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from datetime import datetime
from typing import Any, cast

import jinja2
import jinja2.compiler
import jinja2.ext
import jinja2.nodes
import jinja2.runtime
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment

from dyngen_core.errors import TokenizerError


class _GenerationTag(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` marks assistant text for training masks in
    transformers; for rendering it only outputs its body."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        call = self.call_method("_render_body")
        return jinja2.nodes.CallBlock(call, [], [], body).set_lineno(lineno)

    def _render_body(self, caller: Any) -> str:
        return str(caller())


class _TemplateNamespace(jinja2.utils.Namespace):
    """jinja2's ``namespace`` without underscore-prefixed attributes (no reach into internals)."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805  (jinja2's signature trick)
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _check_namespace_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _check_namespace_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)


def _check_namespace_name(name: Any) -> None:
    if isinstance(name, str) and name.startswith("_"):
        raise jinja2.exceptions.SecurityError(
            f"chat templates cannot store underscore-prefixed attributes, got {name!r}"
        )


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | str | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _dict_factory(*args: Any, **kwargs: Any) -> dict[Any, Any]:
    return dict(*args, **kwargs)


@dataclasses.dataclass(frozen=True)
class TemplateLimits:
    """How long one chat-template render may run and how much text it may produce.

    max_seconds: wall-clock budget of one render (normal templates take milliseconds).
    max_chars: the most characters the output, any value the template builds, or all it prints
        together (inside macros and ``{% set %}`` blocks too) may hold.

    Raise them for a trusted template that needs more: ``tokenizer.template_limits =
    TemplateLimits(max_seconds=30.0)``.
    """

    max_seconds: float = 5.0
    max_chars: int = 1 << 24

    def __post_init__(self) -> None:
        if not self.max_seconds > 0 or not self.max_chars > 0:
            raise ValueError("TemplateLimits needs max_seconds > 0 and max_chars > 0, got "
                             f"{self.max_seconds} and {self.max_chars}")


class _LimitReached(Exception):
    """A render ran out of its `TemplateLimits` (not a ValueError: nothing inside jinja2 or a
    filter may swallow it)."""


_RAISE_HINT = ("; if the template is trusted, raise it with tokenizer.template_limits = "
               "TemplateLimits({}=...) (dyngen_core.text.template_sandbox)")


class _Budget:
    """What one render has left of its limits."""

    def __init__(self, limits: TemplateLimits) -> None:
        self.limits = limits
        self.deadline = time.monotonic() + limits.max_seconds
        self.printed = 0

    def tick(self) -> None:
        if time.monotonic() > self.deadline:
            raise _LimitReached(
                f"the chat template ran longer than its {self.limits.max_seconds:g} s limit "
                "(a loop or recursion that does not end soon)" + _RAISE_HINT.format("max_seconds"))

    def check_size(self, size: int, what: str) -> None:
        if size > self.limits.max_chars:
            raise _LimitReached(
                f"the chat template {what} {size:,} characters, above its limit of "
                f"{self.limits.max_chars:,}" + _RAISE_HINT.format("max_chars"))

    def checked(self, value: Any) -> Any:
        """``value`` after a deadline check and a size check."""
        self.tick()
        self.check_size(_size(value), "built a value of")
        return value


def _size(value: Any) -> int:
    """Characters (items, or decimal digits) a value holds, for the size limit."""
    if isinstance(value, (str, list, tuple, dict, set, frozenset)):
        return len(value)
    if isinstance(value, int):
        return _digits(value)
    return 0


def _digits(value: int) -> int:
    return int(abs(value).bit_length() * math.log10(2)) + 1


class _LimitedContext(jinja2.runtime.Context):
    """A render's context, carrying its `_Budget` (shared with every context derived from it)."""

    budget: _Budget

    def __init__(self, environment: jinja2.Environment, *args: Any, **kwargs: Any) -> None:
        super().__init__(environment, *args, **kwargs)
        self.budget = _Budget(cast(_SandboxEnvironment, environment).limits)

    def derived(self, locals: dict[str, Any] | None = None) -> jinja2.runtime.Context:  # noqa: A002
        context = super().derived(locals)
        cast(_LimitedContext, context).budget = self.budget
        return context


class _LimitedCodeGenerator(jinja2.compiler.CodeGenerator):
    """jinja2's code generator, with a budget check on every loop iteration, concatenation and
    filter result (calls and operators are checked by the sandbox environment itself)."""

    def visit_For(self, node: jinja2.nodes.For, frame: jinja2.compiler.Frame) -> None:
        if not _is_guarded(node.iter):  # iterate environment.guard_loop(context, iterable)
            node.iter = jinja2.nodes.Call(
                jinja2.nodes.EnvironmentAttribute("guard_loop"),
                [jinja2.nodes.ContextReference(), node.iter], [], None, None,
                lineno=node.iter.lineno)
        super().visit_For(node, frame)

    def visit_Concat(self, node: jinja2.nodes.Concat, frame: jinja2.compiler.Frame) -> None:
        if frame.eval_ctx.volatile or frame.eval_ctx.autoescape:  # Markup joins: check after
            self.write("environment.checked(context, ")
            super().visit_Concat(node, frame)
            self.write(")")
            return
        self.write("environment.joined(context, (")  # a ~ b ~ c, sized before it is joined
        for part in node.nodes:
            self.visit(part, frame)
            self.write(", ")
        self.write("))")

    def visit_Filter(self, node: jinja2.nodes.Filter, frame: jinja2.compiler.Frame) -> None:
        self.write("environment.checked(context, ")
        super().visit_Filter(node, frame)
        self.write(")")


# jinja2 filters whose output can be far larger than their input: sized before they run.
_GROWING_FILTERS = ("center", "indent", "replace", "join", "format")
_NUMBER = re.compile(r"\d+")


def _text_op_size(name: str, text: str, args: Sequence[Any], kwargs: Mapping[str, Any]) -> int:
    """An upper bound on the length of ``text.<name>(*args)`` (a str method, or the filter of
    that name applied to ``text``), computed without running it; 0 for operations that cannot
    grow text much beyond their operands, which are checked after they run."""
    given = [*args, *kwargs.values()]
    if name in ("center", "ljust", "rjust", "zfill"):
        return given[0] if given and isinstance(given[0], int) else len(text)
    if name == "expandtabs":
        tab = given[0] if given and isinstance(given[0], int) else 8
        return len(text) + max(tab, 0) * text.count("\t")
    if name == "indent":
        width = given[0] if given else 4
        pad = width if isinstance(width, int) else len(str(width))
        return len(text) + max(pad, 0) * (text.count("\n") + 1)
    if name == "replace" and len(given) >= 2 and isinstance(given[0], str):
        count = text.count(given[0]) if given[0] else len(text) + 1
        return len(text) + count * len(str(given[1]))
    if name == "join" and given and isinstance(given[0], (list, tuple, str, dict)):
        return _joined_size(text, given[0])
    if name in ("format", "format_map"):
        fields = text.count("%") + text.count("{")
        largest = max((len(str(a)) for a in given if isinstance(a, (str, int, float))),
                      default=0)
        widths = [int(n) if len(n) <= 18 else 10**18 for n in _NUMBER.findall(text)]
        if "*" in text or "{" in text:  # widths may come from the arguments
            widths += [a for a in given if isinstance(a, int)]
        return len(text) + fields * largest + max(widths, default=0)
    return 0


def _joined_size(separator: str, items: Collection[Any]) -> int:
    texts = sum(len(item) for item in items if isinstance(item, str))
    return len(separator) * len(items) + texts


def _sized_filter(name: str, func: Callable[..., Any],
                  limits: TemplateLimits) -> Callable[..., Any]:
    """``func`` (the jinja2 filter ``name``), refused before it runs when its result would pass
    ``limits.max_chars``. The wrapper keeps the filter's pass_context/eval_context marker."""

    @functools.wraps(func)
    def sized(*args: Any, **kwargs: Any) -> Any:
        head, (value, *rest) = (args[:1], args[1:]) if name in ("replace", "join") else ((), args)
        if name == "join":  # jinja2 lists the items first too
            value = value if isinstance(value, str) else list(value)
            size = _joined_size(str(rest[0]) if rest else "", value)
        else:
            size = _text_op_size(name, str(value), rest, kwargs)
        if size > limits.max_chars:
            raise _LimitReached(
                f"the chat template's {name} filter would build a value of {size:,} characters, "
                f"above its limit of {limits.max_chars:,}" + _RAISE_HINT.format("max_chars"))
        return func(*head, value, *rest, **kwargs)

    return sized


def _is_guarded(node: jinja2.nodes.Node) -> bool:
    return (isinstance(node, jinja2.nodes.Call)
            and isinstance(node.node, jinja2.nodes.EnvironmentAttribute)
            and node.node.name == "guard_loop")


@jinja2.pass_context
def _count_printed(context: jinja2.runtime.Context, value: Any) -> str:
    """The ``finalize`` hook: every ``{{ ... }}`` value, wherever it is printed, counts."""
    text = str(value)
    budget = cast(_LimitedContext, context).budget
    budget.printed += len(text)
    budget.check_size(budget.printed, "printed")
    return text


class _SandboxEnvironment(ImmutableSandboxedEnvironment):
    """transformers' chat-template environment, with every render bounded by ``limits``."""

    code_generator_class = _LimitedCodeGenerator
    context_class = _LimitedContext
    intercepted_binops = frozenset({"*", "**", "+", "%"})

    def __init__(self, limits: TemplateLimits) -> None:
        super().__init__(trim_blocks=True, lstrip_blocks=True, finalize=_count_printed,
                         extensions=[_GenerationTag, jinja2.ext.loopcontrols])
        self.limits = limits
        self.filters["tojson"] = _tojson
        self.globals["raise_exception"] = _raise_exception
        self.globals["strftime_now"] = _strftime_now
        self.globals["dict"] = _dict_factory
        self.globals["namespace"] = _TemplateNamespace
        del self.globals["lipsum"]  # builds text in loops the budget cannot see into

        for name in _GROWING_FILTERS:
            self.filters[name] = _sized_filter(name, self.filters[name], limits)

    def call(__self, __context: jinja2.runtime.Context, __obj: Any,  # noqa: N805
             *args: Any, **kwargs: Any) -> Any:
        budget = cast(_LimitedContext, __context).budget
        budget.tick()
        method = getattr(__obj, "__wrapped__", __obj)  # the sandbox wraps str.format
        subject = getattr(method, "__self__", None)
        if isinstance(subject, str):
            name = getattr(method, "__name__", "")
            if name == "join" and args and not isinstance(args[0], (str, list, tuple)):
                args = (list(args[0]), *args[1:])  # str.join lists the items first too
            size = _text_op_size(name, subject, args, kwargs)
            budget.check_size(size, "would build a value of")
        return budget.checked(super().call(__context, __obj, *args, **kwargs))

    def call_binop(self, context: jinja2.runtime.Context, operator: str, left: Any,
                   right: Any) -> Any:
        """An intercepted operator, sized before (repetition, powers, %-formats) or after it
        runs. No deadline check: an operator repeats only inside a loop or call, which check."""
        budget = cast(_LimitedContext, context).budget
        if operator == "+" and type(left) is str and type(right) is str:  # the common case
            budget.check_size(len(left) + len(right), "would build a value of")
            return left + right
        budget.check_size(_binop_size(operator, left, right), "would build a value of")
        result = self.binop_table[operator](left, right)
        budget.check_size(_size(result), "built a value of")
        return result

    def joined(self, context: jinja2.runtime.Context, parts: Iterable[Any]) -> str:
        """``a ~ b ~ ...``: the parts as text, joined once their total size is known."""
        budget = cast(_LimitedContext, context).budget
        budget.tick()
        texts = [str(part) for part in parts]
        budget.check_size(sum(map(len, texts)), "would build a value of")
        return "".join(texts)

    def guard_loop(self, context: jinja2.runtime.Context, iterable: Any) -> Iterator[Any]:
        """``iterable``, with the deadline checked before each item (every ``{% for %}``
        iterates through this)."""
        budget = cast(_LimitedContext, context).budget
        for item in iterable:
            budget.tick()
            yield item

    def checked(self, context: jinja2.runtime.Context, value: Any) -> Any:
        return cast(_LimitedContext, context).budget.checked(value)


def _binop_size(operator: str, left: Any, right: Any) -> int:
    """The size a repetition, power or %-format would have, before it is computed (0 for the
    rest: their results are checked after)."""
    if operator == "%" and isinstance(left, str):
        return _text_op_size("format", left, right if isinstance(right, tuple) else (right,), {})
    if operator == "*":
        if isinstance(right, int) and isinstance(left, (str, list, tuple)):
            return len(left) * right
        if isinstance(left, int) and isinstance(right, (str, list, tuple)):
            return left * len(right)
        if isinstance(left, int) and isinstance(right, int):
            return _digits(left) + _digits(right)
    if operator == "**" and isinstance(left, int) and isinstance(right, int) and right > 0:
        return int(right * math.log10(abs(left))) + 1 if abs(left) > 1 else 1
    return 0


class LimitedTemplate:
    """An untrusted template compiled in the limited sandbox.

    Raises what jinja2 raises for a template that does not compile (TemplateSyntaxError; a
    RecursionError for absurd nesting); the caller names the template's origin.
    """

    def __init__(self, source: str, limits: TemplateLimits) -> None:
        self.limits = limits
        self._template = _SandboxEnvironment(limits).from_string(source)

    def render(self, variables: Mapping[str, Any]) -> str:
        """The rendered text; a TokenizerError for a limit reached or any fault of the
        template's own (an undefined name, 1 / 0, endless recursion, ...)."""
        parts, size = [], 0
        try:
            for chunk in self._template.generate(**variables):
                size += len(chunk)
                if size > self.limits.max_chars:
                    raise _LimitReached(
                        f"the chat template's output passed its limit of "
                        f"{self.limits.max_chars:,} characters" + _RAISE_HINT.format("max_chars"))
                parts.append(chunk)
        except _LimitReached as exc:
            raise TokenizerError(str(exc)) from None
        except jinja2.TemplateError as exc:
            raise TokenizerError(f"the chat template failed to render: {exc}") from exc
        except RecursionError as exc:
            raise TokenizerError("the chat template failed to render: it recursed too deeply "
                                 "(a macro that calls itself without end?)") from exc
        except Exception as exc:  # the template's own error: 1 / 0, 'a' + 1, ...
            raise TokenizerError(f"the chat template failed to render: "
                                 f"{type(exc).__name__}: {exc}") from exc
        return "".join(parts)
