"""Chat templates rendered as transformers renders them, in jinja's sandbox, within limits.

    text, spans = render_chat(template, "tok/chat_template.jinja", "chats.jsonl, row 3, column 'messages'",
                              messages, add_generation_prompt=False, special_tokens={"eos_token": "</s>"})

The environment is the one transformers' `apply_chat_template` sets up (the same sandbox and options,
`tojson`, `raise_exception`, `strftime_now`, `{% generation %}`), so a template renders the same. A chat
template comes with a tokenizer, from anywhere: jinja's sandbox keeps it away from Python's internals,
and each rendering (one template, one conversation) is bounded:

- in time, by RENDER_SECONDS, checked at every call (macros included), filter and loop start, and at
  each step of a loop over more than _SHORT_LOOP items: between two checks a template runs at most
  _SHORT_LOOP times what its own text spells out;
- in size, by the larger of RENDER_MAX_CHARS and RENDER_CHARS_PER_INPUT_CHAR times the conversation's
  characters (the string fields of its messages): the text the template writes (counted where it is
  written, inside macros and `{% set %}` blocks too) and every string, list or mapping that `+`, `~`,
  `*`, `%`, a call or a filter makes (a chain `a + b + c + …` every _CHAIN_TERMS terms). An integer
  argument past that size (a width, a count), or such a number in a format string, is refused before
  the call or `%` runs, and `*` before it repeats;
- integers, by RENDER_MAX_INT_BITS: `*` and `**` are refused before they compute a larger one.

A real template writes each message once with a few tokens around it: far inside these limits. A
rendering past one, or one that raises any error (ZeroDivisionError, RecursionError, an integer too
long to print...), is an InputError naming the conversation and the template's file; a limit hit is
always an error, never a truncated text.
"""

from __future__ import annotations

import functools
import json
import re
import time
from collections.abc import Iterable, Iterator
from datetime import datetime
from functools import lru_cache

from prepack.errors import InputError, optional_imports

with optional_imports("tokenizing (--tokenizer)"):
    import jinja2
    import jinja2.ext
    from jinja2 import nodes
    from jinja2.sandbox import ImmutableSandboxedEnvironment
    from jinja2.visitor import NodeTransformer

__all__ = [
    "RENDER_CHARS_PER_INPUT_CHAR",
    "RENDER_MAX_CHARS",
    "RENDER_MAX_INT_BITS",
    "RENDER_SECONDS",
    "check_template",
    "compile_template",
    "render_chat",
]

RENDER_SECONDS = 10.0  # one rendering of one conversation
RENDER_MAX_CHARS = 64 << 20  # characters written, or made as one value (items of a list)...
RENDER_CHARS_PER_INPUT_CHAR = 8  # ...or this many times the conversation's own characters, when more
RENDER_MAX_INT_BITS = 1 << 16  # about 19,700 digits; Python prints at most 4,300 anyway

# Names of the filters that the bounding pass wraps around loops, `+`, `~` and kept output (`_Bounding`).
_STEPS, _SIZED, _WRITTEN = "prepack_render_steps", "prepack_render_sized", "prepack_render_written"
_SHORT_LOOP = 1000  # steps of a loop whose time is checked only as it starts
_NUMBER = re.compile(r"\d+")
_CHAIN_TERMS = 4  # terms of a `+` or `~` chain between two size checks: the most it makes unchecked is 4 values


class _LimitExceeded(Exception):
    """A rendering went past a limit; `render_chat` names the conversation and the template."""


class _Budget:
    """What one rendering may spend: a deadline, a size for any value and for the text written."""

    def __init__(self, messages: list[dict]):
        self.deadline = time.monotonic() + RENDER_SECONDS
        self.max_size = RENDER_MAX_CHARS
        self.written_chars = 0
        self._messages = messages  # their characters may raise max_size: counted once a size comes near

    def _past(self, size: int) -> bool:
        """Whether `size` is past the limit (the conversation's share of it counted the first time it matters)."""
        if size > self.max_size and self._messages:
            self.max_size = max(self.max_size, RENDER_CHARS_PER_INPUT_CHAR * _input_chars(self._messages))
            self._messages = []
        return size > self.max_size

    def check_time(self) -> None:
        if time.monotonic() > self.deadline:
            raise _LimitExceeded(f"ran past {RENDER_SECONDS:g} s (prepack's limit for one rendering)")

    def sized(self, value):
        """`value`, when within the limits."""
        if type(value) is str:  # the usual case, first
            if len(value) > self.max_size and self._past(len(value)):
                raise self._too_long(value, len(value))
        elif isinstance(value, int):
            if value.bit_length() > RENDER_MAX_INT_BITS:
                raise _too_many_bits()
        elif isinstance(value, (str, list, tuple, dict)) and len(value) > self.max_size and self._past(len(value)):
            raise self._too_long(value, len(value))
        return value

    def check_arguments(self, args: Iterable, kwargs: dict) -> None:
        for value in (*args, *kwargs.values()):
            if isinstance(value, int) and abs(value) > self.max_size and self._past(abs(value)):
                raise _LimitExceeded(
                    f"passed {value:,} to a call or filter, more than prepack's size limit of {self.max_size:,} for "
                    "one rendering"
                )

    def check_binop(self, operator: str, left, right) -> None:
        """Refuses `*`, `**` and `%` that would make a value past the limits, before they compute it."""
        ints = isinstance(left, int) and isinstance(right, int)
        if operator == "**" and ints and right > 0 and abs(left) > 1:
            if (abs(left).bit_length() - 1) * right > RENDER_MAX_INT_BITS:  # the power has more bits than that
                raise _too_many_bits()
        elif operator == "*" and ints:
            if left.bit_length() + right.bit_length() - 1 > RENDER_MAX_INT_BITS:
                raise _too_many_bits()
        elif operator == "*" and (isinstance(left, int) or isinstance(right, int)):
            count, repeated = (left, right) if isinstance(left, int) else (right, left)
            if isinstance(repeated, (str, list, tuple)) and self._past(len(repeated) * count):
                raise self._too_long(repeated, len(repeated) * count)
        elif operator == "%" and isinstance(left, str):
            self.check_format(left)
            self.check_arguments(right if isinstance(right, tuple) else (right,), {})

    def check_format(self, text: str) -> None:
        """Refuses a format string with a number past the size limit in it (a width: `%9999999999s`)."""
        for digits in _NUMBER.findall(text):
            if int(digits) > self.max_size and self._past(int(digits)):
                raise _LimitExceeded(
                    f"formats with the number {int(digits):,}, more than prepack's size limit of {self.max_size:,} for "
                    "one rendering"
                )

    def written(self, text: str) -> None:
        self.written_chars += len(text)
        self.check_written()

    def check_written(self) -> None:
        if self.written_chars > self.max_size and self._past(self.written_chars):
            raise _LimitExceeded(f"wrote more than {self.max_size:,} characters, prepack's size limit for one rendering")

    def _too_long(self, value, length: int) -> _LimitExceeded:
        what = f"a string of {length:,} characters" if isinstance(value, str) else f"a {type(value).__name__} of {length:,} items"
        return _LimitExceeded(f"made {what}, more than prepack's size limit of {self.max_size:,} for one rendering")


def _too_many_bits() -> _LimitExceeded:
    return _LimitExceeded(f"made an integer of more than {RENDER_MAX_INT_BITS:,} bits, prepack's limit for one rendering")


class _BoundedSandbox(ImmutableSandboxedEnvironment):
    """The sandbox, checking the current rendering's `budget` wherever a template does work."""

    intercepted_binops = frozenset({"*", "**", "%"})  # operators that make values larger than their operands

    def __init__(self, **options):
        super().__init__(**options)
        self.budget = _Budget([])

    def call(self, context, obj, /, *args, **kwargs):
        self.budget.check_time()
        self.budget.check_arguments(args, kwargs)
        return self.budget.sized(super().call(context, obj, *args, **kwargs))

    def call_binop(self, context, operator, left, right):
        self.budget.check_binop(operator, left, right)
        return self.budget.sized(self.binop_table[operator](left, right))

    def wrap_str_format(self, value):
        """`str.format` as the sandbox wraps it, once its format string is checked."""
        wrapped = super().wrap_str_format(value)
        if wrapped is not None:
            self.budget.check_format(value.__self__)
        return wrapped

    def bounded_filter(self, name: str, function):
        """`function` as a filter that checks the time, its arguments (not the value it filters; that of
        `format`, a format string, too) and its result."""
        skipped = 2 if hasattr(function, "jinja_pass_arg") else 1  # the context or environment, and the value

        @functools.wraps(function)  # keeps jinja_pass_arg
        def bounded(*args, **kwargs):
            self.budget.check_time()
            self.budget.check_arguments(args[skipped:], kwargs)
            if name == "format" and isinstance(args[skipped - 1], str):
                self.budget.check_format(args[skipped - 1])
            return self.budget.sized(function(*args, **kwargs))

        return bounded


@jinja2.pass_context
def _steps(context, iterable) -> Iterable:
    """A loop's iterable: the time is checked as the loop starts, and at each step of a long or unsized one."""
    budget = context.environment.budget
    budget.check_time()
    try:
        if len(iterable) <= _SHORT_LOOP:
            return iterable
    except TypeError:  # a generator: unsized
        pass
    return _timed_steps(budget, iterable)


def _timed_steps(budget: _Budget, iterable) -> Iterator:
    for item in iterable:
        budget.check_time()
        yield item


@jinja2.pass_context
def _sized(context, value):
    budget = context.environment.budget
    if type(value) is str and len(value) <= budget.max_size:  # `sized`'s usual case, without its call
        return value
    return budget.sized(value)


@jinja2.pass_context
def _written(context, value) -> str:
    text = value if type(value) is str else str(value)  # what the output would turn it into
    context.environment.budget.written(text)
    return text


class _Bounding(NodeTransformer):
    """Routes loops, `+`, `~`, and the output of macros and blocks through the checks of `_BoundedSandbox`:
    the places a template spends time or size without a call, a filter or an intercepted operator. (The
    output of the template itself is counted as `render_chat` receives it.) The filters take the context,
    so jinja never evaluates them while it compiles."""

    def __init__(self):
        self.keeping = 0  # inside bodies whose output is kept as a string (macros, `{% set %}` blocks...)

    def visit_For(self, node: nodes.For) -> nodes.For:
        self.generic_visit(node)
        node.iter = _filtered(node.iter, _STEPS)
        return node

    def visit_Add(self, node: nodes.Add) -> nodes.Filter:
        # `a + b + c` is ((a + b) + c): the chain down the left is checked at its top and every
        # _CHAIN_TERMS links below, so ChatML's `'<|im_start|>' + role + '\n' + content + …` pays one check.
        chain = [node]
        while isinstance(chain[-1].left, nodes.Add):
            chain.append(chain[-1].left)
        for link in chain:
            link.right = self.visit(link.right)
        chain[-1].left = self.visit(chain[-1].left)
        for depth in range(_CHAIN_TERMS, len(chain), _CHAIN_TERMS):
            chain[depth - 1].left = _filtered(chain[depth], _SIZED)
        return _filtered(node, _SIZED)

    def visit_Concat(self, node: nodes.Concat) -> nodes.Filter:
        self.generic_visit(node)
        while len(node.nodes) > _CHAIN_TERMS:  # `a ~ b ~ c ~ …` is one node: checked every _CHAIN_TERMS terms
            node.nodes[:_CHAIN_TERMS] = [_filtered(nodes.Concat(node.nodes[:_CHAIN_TERMS], lineno=node.lineno), _SIZED)]
        return _filtered(node, _SIZED)

    def visit_Output(self, node: nodes.Output) -> nodes.Output:
        self.generic_visit(node)
        if self.keeping:
            node.nodes = [_filtered(child, _WRITTEN) for child in node.nodes]
        return node

    def _kept(self, node: nodes.Node) -> nodes.Node:
        self.keeping += 1
        try:
            return self.generic_visit(node)
        finally:
            self.keeping -= 1

    visit_Macro = visit_CallBlock = visit_AssignBlock = visit_FilterBlock = _kept


def _filtered(node: nodes.Expr, name: str) -> nodes.Filter:
    return nodes.Filter(node, name, [], [], None, None, lineno=node.lineno)


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}…{% endgeneration %}` marks assistant output; its character span is recorded.

    `render_chat` consumes the template as a generator, so when a block runs, `blocks` holds
    everything rendered before it (the mechanism of transformers' `return_assistant_tokens_mask`).
    """

    tags = {"generation"}

    def __init__(self, environment: jinja2.Environment):
        super().__init__(environment)
        self.blocks: list[str] = []
        self.spans: list[tuple[int, int]] = []

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_record"), [], [], body).set_lineno(lineno)

    def _record(self, caller) -> str:
        text = caller()
        start = sum(map(len, self.blocks))
        self.spans.append((start, start + len(text)))
        return text


def _raise_exception(message: str):
    raise jinja2.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


@lru_cache(maxsize=4)
def compile_template(source: str) -> jinja2.Template:
    """A sandbox set up as transformers' `apply_chat_template` sets it up, so templates render the same,
    with every filter and the template's loops, `~` and output bounded. Raises jinja2's
    TemplateSyntaxError, or whatever else compiling a hostile template raises (RecursionError, ...)."""
    env = _BoundedSandbox(trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.filters = {name: env.bounded_filter(name, function) for name, function in env.filters.items()}
    env.filters |= {_STEPS: _steps, _SIZED: _sized, _WRITTEN: _written}
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda format: datetime.now().strftime(format)
    tree = _Bounding().visit(env.parse(source))
    tree.set_environment(env)
    env.budget = _Budget([])  # jinja evaluates constant expressions as it compiles: within limits too
    return env.from_string(tree)


def check_template(template: str, template_file: str) -> None:
    """Compiles `template` (cached for `render_chat`); an InputError naming `template_file` when it cannot."""
    try:
        compile_template(template)
    except jinja2.TemplateSyntaxError as exc:
        raise InputError(f"chat template {template_file}, line {exc.lineno}: {exc.message}") from None
    except Exception as exc:  # noqa: BLE001 (a hostile template can break the compiler: RecursionError, SyntaxError, ...)
        raise InputError(f"chat template {template_file}: cannot be compiled ({type(exc).__name__}: {exc}).") from None


def _input_chars(messages: list[dict]) -> int:
    return sum(len(value) for message in messages for value in message.values() if isinstance(value, str))


def render_chat(
    template: str,
    template_file: str,
    where: str,
    messages: list[dict],
    *,
    add_generation_prompt: bool,
    special_tokens: dict[str, str],
) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the character spans of its `{% generation %}` blocks (none when
    the template has no such tag), with the variables transformers passes. An InputError naming `where`
    (the conversation) and `template_file` when the template fails on it or goes past a limit. A compiled
    template holds the state of its current rendering: one rendering at a time per template (a worker
    process, or the one helper thread, renders them in turn)."""
    compiled = compile_template(template)
    environment = compiled.environment
    tracker = environment.extensions[_GenerationTag.identifier]
    tracker.blocks, tracker.spans = [], []
    environment.budget = budget = _Budget(messages)
    variables = dict(special_tokens, tools=None, documents=None)
    try:
        for block in compiled.generate(messages=messages, add_generation_prompt=add_generation_prompt, **variables):
            budget.written_chars += len(block)  # `budget.written`, without a call for each block
            if budget.written_chars > budget.max_size:
                budget.check_written()
            tracker.blocks.append(block)
    except _LimitExceeded as exc:
        raise InputError(f"{where}: the chat template {template_file} {exc}.") from None
    except jinja2.TemplateError as exc:  # raise_exception, undefined values, the sandbox's refusals
        raise InputError(f"{where}: the chat template failed on this conversation ({template_file}): {exc}") from None
    except Exception as exc:  # noqa: BLE001 (whatever Python raises for the template's code is the template's failure)
        raise InputError(
            f"{where}: the chat template failed on this conversation ({template_file}): {type(exc).__name__}: {exc}"
        ) from None
    return "".join(tracker.blocks), tracker.spans
