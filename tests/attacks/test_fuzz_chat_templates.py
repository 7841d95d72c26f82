"""Fuzz: random chat templates from a small grammar (text, `{{ expr }}`, `{% for %}` over `range`, `{% if %}`,
macros that call themselves with a base case, without one, or twice a level, `{% set %}` growing a string,
filters, arithmetic with division by zero and huge powers) rendered under tight render limits. The
contract: a rendered text within the size limit, or an InputError naming the conversation and the
template's file; never another exception, never a rendering that outlives the time limit by more than
the slack a loaded machine needs."""

from __future__ import annotations

import time

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from prepack.errors import InputError
from prepack.sources import chat_templates

SECONDS = 0.05
MAX_CHARS = 4096
SLACK = 2.0  # CPU seconds beyond the limit: the check comes between two steps
MESSAGES = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]

LEAVES = st.sampled_from([
    "0", "1", "2", "7", "99999", "10 ** 4", "10 ** 9", "2 ** 70000", "7 ** (10 ** 9)", "10 ** 5000", "'ab'", "''", "'ab' * 1000", "[1, 2]",
    "messages|length", "messages[0].content", "n", "i", "ns.s", "missing",
])
OPERATORS = st.sampled_from(["+", "-", "*", "/", "//", "%", "**", "~"])
FILTERS = st.sampled_from([
    "upper", "length", "string", "list", "join", "first", "reverse", "int", "center(40)", "center(10 ** 9)",
    "default('x')", "replace('a', 'aaaa')", "indent(99999)", "batch(3)|list", "tojson",
])
EXPRESSIONS = st.recursive(
    LEAVES,
    lambda inner: st.one_of(
        st.tuples(inner, OPERATORS, inner).map(lambda t: f"({t[0]} {t[1]} {t[2]})"),
        st.tuples(inner, FILTERS).map(lambda t: f"({t[0]})|{t[1]}"),
        inner.map(lambda e: f"f({e})"),
        inner.map(lambda e: f"(range({e})|list)"),
    ),
    max_leaves=6,
)
BOUNDS = st.one_of(st.sampled_from(["3", "1000", "4000"]), EXPRESSIONS)  # of loops: mostly ones that run
STATEMENTS = st.recursive(
    st.one_of(st.text(alphabet="ab \n", max_size=4), EXPRESSIONS.map(lambda e: "{{ " + e + " }}")),
    lambda inner: st.one_of(
        st.tuples(BOUNDS, st.lists(inner, min_size=1, max_size=3)).map(
            lambda t: "{% for i in range(" + t[0] + ") %}" + "".join(t[1]) + "{% endfor %}"
        ),
        st.tuples(EXPRESSIONS, st.lists(inner, max_size=2), st.lists(inner, max_size=2)).map(
            lambda t: "{% if " + t[0] + " %}" + "".join(t[1]) + "{% else %}" + "".join(t[2]) + "{% endif %}"
        ),
        EXPRESSIONS.map(lambda e: "{% set ns.s = ns.s ~ " + e + " %}"),
        st.lists(inner, max_size=4).map("".join),
    ),
    max_leaves=10,
)
RECURSION = st.sampled_from([
    "{% if n > 0 %}{{ f(n - 1) }}{% endif %}",  # a base case
    "{{ f(n) }}",  # none
    "{% if n > 0 %}{{ f(n - 1) }}{{ f(n - 1) }}{% endif %}",  # twice a level: 2 ** n calls
    "",
])


def template(recursion: str, macro_body: str, body: str) -> str:
    return "{% set ns = namespace(s='') %}{% macro f(n) %}" + macro_body + recursion + "{% endmacro %}" + body


TEMPLATES = st.builds(template, RECURSION, STATEMENTS, STATEMENTS)


@pytest.mark.slow  # 300 templates
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(template=TEMPLATES)
# Each limit, whatever the draws: time, text written, a string grown, an integer, recursion, fan-out.
@example(template("", "", "{% for i in range(4000) %}{% for j in range(4000) %}{% endfor %}{% endfor %}"))
@example(template("", "", "{% for i in range(4000) %}{{ 'ab' * 1000 }}{% endfor %}"))
@example(template("", "", "{% for i in range(4000) %}{% set ns.s = ns.s ~ 'ab' * 1000 %}{% endfor %}"))
@example(template("", "", "{{ 2 ** 70000 }}"))
@example(template("{{ f(n) }}", "", "{{ f(1) }}"))
@example(template("{% if n > 0 %}{{ f(n - 1) }}{{ f(n - 1) }}{% endif %}", "", "{{ f(99) }}"))
def test_a_random_template_renders_within_the_limits_or_is_an_input_error(template):
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(chat_templates, "RENDER_SECONDS", SECONDS)
        patch.setattr(chat_templates, "RENDER_MAX_CHARS", MAX_CHARS)
        # CPU time, not wall time: a render's cost is what the limit bounds, and a loaded machine (other
        # test workers, other work) stretches the wall clock, not the CPU a render takes.
        start = time.process_time()
        try:
            chat_templates.check_template(template, "fuzz.jinja")
            text, _ = chat_templates.render_chat(
                template, "fuzz.jinja", "chats.jsonl, row 0", MESSAGES, add_generation_prompt=False,
                special_tokens={"eos_token": "</s>"},
            )
        except InputError as error:
            assert "fuzz.jinja" in str(error), str(error)
            if "cannot be compiled" not in str(error) and ", line " not in str(error):  # compiling names no row
                assert "chats.jsonl, row 0" in str(error), str(error)
        else:
            assert len(text) <= MAX_CHARS
        assert time.process_time() - start < SECONDS + SLACK, template
