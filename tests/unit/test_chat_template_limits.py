"""Chat templates are untrusted code: every render is bounded in time and size (pure, no torch).

Each hostile template must end, fast and without a memory spike, in a TokenizerError that names
the limit and how to raise it; errors of the template's own making (1 / 0) are TokenizerErrors
too. Raised limits let a trusted template through.
"""

from __future__ import annotations

import time
import tracemalloc

import pytest

from dyngen_core.errors import TokenizerError
from dyngen_core.text.chat_template import ChatTemplate
from dyngen_core.text.template_sandbox import TemplateLimits

MESSAGES = [{"role": "user", "content": "hi"}]
SMALL = TemplateLimits(max_seconds=0.5, max_chars=100_000)
LOOPS = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"

SLOW = {
    "nested loops": LOOPS,
    "a scoped block inside a loop":
        "{% for i in range(100000) %}{% block b scoped %}{% for j in range(100000) %}"
        "{% endfor %}{% endblock %}{% endfor %}",
    "a recursive loop":
        "{% for x in [[[1]] * 1000] * 1000 recursive %}{{ loop(x) if x is iterable }}"
        "{% endfor %}",
    "loops inside a macro": "{% macro m() %}" + LOOPS + "{% endmacro %}{{ m() }}",
}
LARGE = {
    "output": "{% for i in range(100000) %}{{ 'x' * 1000 }}{% endfor %}",
    "literal output": "{% for i in range(100000) %}" + "x" * 1000 + "{% endfor %}",
    "text printed inside a macro":
        "{% macro m() %}{% for i in range(100000) %}{{ 'x' * 1000 }}{% endfor %}{% endmacro %}"
        "{{ m()|length }}",
    "text printed inside set": "{% set s %}{% for i in range(100000) %}{{ 'x' * 1000 }}"
                               "{% endfor %}{% endset %}{{ s|length }}",
    "repetition": "{{ 'x' * 1000000000 }}",
    "list repetition": "{{ ([1] * 1000000000)|length }}",
    "a power": "{{ 2 ** 100000000 }}",
    "a namespace string doubled": "{% set ns = namespace(s='x') %}{% for i in range(40) %}"
                                  "{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
    "a string doubled with +": "{% set ns = namespace(s='x') %}{% for i in range(40) %}"
                               "{% set ns.s = ns.s + ns.s %}{% endfor %}",
    "a long concatenation": "{% set x = 'x' * 90000 %}{{ (x ~ x ~ x ~ x ~ x)|length }}",
    "the center filter": "{{ 'x'|center(1000000000) }}",
    "the indent filter": "{{ ('x\n' * 10000)|indent(100000) }}",
    "str.ljust": "{{ 'x'.ljust(1000000000) }}",
    "a %-format width": "{{ '%1000000000d' % 1 }}",
    "a format width": "{{ '{:>1000000000}'.format(1) }}",
    "the format filter": "{{ '%1000000000s'|format('x') }}",
    "the replace filter": "{% set x = 'a' * 10000 %}{{ x|replace('a', 'b' * 100000) }}",
    "the join filter": "{{ range(100000)|join('x' * 1000000) }}",
    "str.join of a generator": "{{ ('x' * 1000000).join(range(100000)|map('string')) }}",
}
BROKEN = {
    "1 / 0": ("{{ 1 / 0 }}", "ZeroDivisionError"),
    "'a' + 1": ("{{ 'a' + 1 }}", "TypeError"),
    "endless recursion": ("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}",
                          "recursed too deeply"),
    "lipsum": ("{{ lipsum(1000000) }}", "'lipsum' is undefined"),
}


@pytest.mark.parametrize("source", SLOW.values(), ids=SLOW.keys())
def test_slow_templates_stop_at_the_deadline(source: str) -> None:
    start = time.perf_counter()
    with pytest.raises(TokenizerError, match=r"ran longer than its 0.5 s limit.*"
                                             r"TemplateLimits\(max_seconds=\.\.\.\)"):
        ChatTemplate(source, limits=SMALL).render(MESSAGES)
    assert time.perf_counter() - start < 3.0


@pytest.mark.parametrize("source", LARGE.values(), ids=LARGE.keys())
def test_large_values_and_output_stop_at_the_size_limit(source: str) -> None:
    tracemalloc.start()
    try:
        with pytest.raises(TokenizerError, match=r"above its limit of 100,000.*"
                                                 r"TemplateLimits\(max_chars=\.\.\.\)|"
                                                 r"output passed its limit of 100,000"):
            ChatTemplate(source, limits=SMALL).render(MESSAGES)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 32 * 2**20


@pytest.mark.parametrize(("source", "message"), BROKEN.values(), ids=BROKEN.keys())
def test_template_faults_are_tokenizer_errors(source: str, message: str) -> None:
    with pytest.raises(TokenizerError, match=f"failed to render: .*{message}"):
        ChatTemplate(source).render(MESSAGES)


def test_deep_nesting_does_not_compile() -> None:
    with pytest.raises(TokenizerError, match="does not compile"):
        ChatTemplate("{{ " + "(" * 5000 + "1" + ")" * 5000 + " }}")


def test_raised_limits_let_a_trusted_template_through() -> None:
    source = "{% for i in range(200) %}{{ 'x' * 1000 }}{% endfor %}"
    with pytest.raises(TokenizerError, match="printed 101,000 characters"):
        ChatTemplate(source, limits=SMALL).render(MESSAGES)
    roomy = TemplateLimits(max_seconds=0.5, max_chars=300_000)
    assert len(ChatTemplate(source, limits=roomy).render(MESSAGES)) == 200_000
    with pytest.raises(ValueError, match="max_seconds > 0"):
        TemplateLimits(max_seconds=0)


def test_ordinary_templates_are_untouched() -> None:
    source = ("{% for m in messages %}{{ '%s: %s' % (m.role, m.content) }}{{ '-' * 3 }}"
              "{{ m.content|center(10) }}|{{ ' '.join(['a', 'b']) }}|{{ 2 ** 10 }}"
              "{{ [1, 2] + [3] }}{% endfor %}")
    assert ChatTemplate(source, limits=SMALL).render(MESSAGES) == (
        "user: hi---    hi    |a b|1024[1, 2, 3]")
