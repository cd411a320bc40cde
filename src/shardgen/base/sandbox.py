"""Jinja2's sandbox with bounds on work: a prompt template can neither reach Python internals nor
exhaust the memory or time of the machine that renders it.

Jinja2's ``ImmutableSandboxedEnvironment`` refuses access to Python internals
but bounds nothing: ``{{ 3**(2*10**7) }}`` was computed at compile time
(13.6 s during config validation), ``{{ 'a'*10**8 }}`` allocated 436 MiB,
``|center(10**7)`` and nested ranges blew up at render time. Here:

- arithmetic that grows (``*``, ``**``, ``%``, ``+``) goes through
  ``call_binop`` (Jinja folds no constant of an intercepted operator at
  compile time), and a result over ``MAX_ITEMS`` items or ``MAX_INT_BITS``
  bits is refused before it is built;
- calls (methods such as ``str.ljust``, macros), filters with a width or a
  count (``center``, ``indent``, ``wordwrap``, ``format``, ``replace``,
  ``batch``, ``slice``...), string concatenation (``~``) and namespace
  assignments check their arguments before, and their results after;
- what a result's size depends on is checked before it is built: a format's
  fields and widths, written in it or passed as arguments (``str.format``,
  ``%``, the ``format`` filter), ``expandtabs``, ``indent`` and ``join`` (the
  filter and the method) of the values given;
- ``range`` counts its iterations over the whole render (``MAX_ITERATIONS``);
- recursive macros are refused when the template is compiled;
- a render has a deadline (``RENDER_SECONDS``): checked at every call,
  attribute access and loop step of a ``range``, and enforced by ``SIGALRM``
  when rendering on the main thread (``RenderBudget``).

A bound that is hit raises ``TemplateBoundError`` (a ``SecurityError``), which
the renderer turns into a row error.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import re
import signal
import string
import threading
import time
from collections.abc import Iterator
from typing import Any

from jinja2 import nodes
from jinja2.compiler import CodeGenerator, Frame
from jinja2.exceptions import SecurityError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.utils import Namespace

# Items (characters of a string, elements of a list) of any one value a template builds.
MAX_ITEMS = 16 * 2**20
# Bits of any integer a template computes.
MAX_INT_BITS = 4096
# Iterations of every range() of one render together.
MAX_ITERATIONS = 1_000_000
# Seconds one render may take.
RENDER_SECONDS = 5.0

# Filters whose arguments say how large the result is, and which arguments.
_WIDTH_FILTERS = {"center": 1, "indent": 1, "wordwrap": 1, "truncate": 1, "batch": 1, "slice": 1, "filesizeformat": 0}
# str methods that take a width, and where.
_WIDTH_METHODS = {"center", "ljust", "rjust", "zfill", "expandtabs"}


class TemplateBoundError(SecurityError):
    """The template would build something too large, or run too long."""


class _Budget:
    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.deadline = time.monotonic() + seconds
        self.iterations = MAX_ITERATIONS

    def tick(self) -> None:
        if time.monotonic() > self.deadline:
            raise TemplateBoundError(f"rendering took more than {self.seconds:g} s")


_budget: contextvars.ContextVar[_Budget | None] = contextvars.ContextVar("shardgen_template_budget", default=None)


def _tick() -> None:
    budget = _budget.get()
    if budget is not None:
        budget.tick()


def _size(value: Any) -> int:
    if isinstance(value, str | bytes | list | tuple | dict | set | frozenset):
        return len(value)
    return 0


def _check_result(value: Any) -> Any:
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > MAX_INT_BITS:
        raise TemplateBoundError(f"an integer of more than {MAX_INT_BITS} bits")
    if _size(value) > MAX_ITEMS:
        raise TemplateBoundError(f"a value of more than {MAX_ITEMS} items")
    return value


def _check_count(n: Any, what: str) -> None:
    if isinstance(n, int) and not isinstance(n, bool) and abs(n) > MAX_ITEMS:
        raise TemplateBoundError(f"{what} of {n}, more than {MAX_ITEMS}")


def _text_size(value: Any) -> int:
    """At most how many characters ``value`` gives when formatted or joined (its ``str``), counted
    without building it; a container stops counting once past the bound."""
    if isinstance(value, str | bytes):
        return len(value) + 3 * isinstance(value, bytes)
    if isinstance(value, bool) or value is None:
        return 5
    if isinstance(value, int):
        return value.bit_length() * 3 // 10 + 2
    if isinstance(value, list | tuple | set | frozenset | dict):
        total = 2
        for item in value.items() if isinstance(value, dict) else value:
            total += _text_size(item) + 2
            if total > MAX_ITEMS:
                break
        return total
    return 64  # a float, a date: short


def _format_size(fmt: str, values: list[Any], style: str) -> int:
    """At most how many characters ``fmt`` (``style`` "{" for ``str.format``, "%" for ``%``) gives
    with ``values``: each field at most the largest value, padded to the largest width, whether the
    width is written in the format or passed as an argument (``{0:>{1}}``, ``%*d``)."""
    if style == "{":
        try:
            specs = [spec or "" for _, name, spec, _ in string.Formatter().parse(fmt) if name is not None]
        except ValueError:
            return len(fmt)  # not a format string: str.format fails on it
    else:
        specs = re.findall(r"%(?:\([^)]*\))?[-#0 +]*(?:\*|\d+)?(?:\.(?:\*|\d+))?", fmt)
    widths = [int(n) for spec in specs for n in re.findall(r"\d+", spec)]
    if any("{" in spec or "*" in spec for spec in specs):  # widths passed as arguments
        widths += [abs(v) for v in values if isinstance(v, int) and not isinstance(v, bool)]
    largest = max(map(_text_size, values), default=0)
    return len(fmt) + len(specs) * (largest + max(widths, default=0))


def _check_format(fmt: Any, values: Any, style: str) -> None:
    """Refuse a format whose result would be too large, before it is built."""
    if isinstance(fmt, str):
        if style == "%":
            values = list(values.values()) if isinstance(values, dict) else list(values)
        _check_count(_format_size(fmt, values, style), "a formatted string of")


def _sized(items: Any) -> list[Any]:
    """The items of an iterable, as a list (a generator is read once, within the range budget)."""
    return items if isinstance(items, list) else list(items)


def _check_join(items: list[Any], separator: Any) -> None:
    total = len(str(separator)) * max(len(items) - 1, 0)
    for item in items:
        total += _text_size(item)
        if total > MAX_ITEMS:
            _check_count(total, "a joined string of")


def _check_replace(text: Any, old: Any, new: Any, count: Any = -1) -> None:
    if isinstance(text, str) and isinstance(old, str) and isinstance(new, str):
        hits = text.count(old) if old else len(text) + 1
        if isinstance(count, int) and count >= 0:
            hits = min(hits, count)
        _check_count(len(text) + hits * (len(new) - len(old)), "a replacement result")


def _bounded_filter(name: str, func: Any) -> Any:
    width_at = _WIDTH_FILTERS.get(name)

    @functools.wraps(func)
    def bounded(*args: Any, **kwargs: Any) -> Any:
        _tick()
        values = [a for a in args if not hasattr(a, "environment")]  # skip a passed context/environment
        if width_at is not None and len(values) > width_at:
            _check_count(values[width_at], f"the {name} filter's argument")
        for value in kwargs.values():
            if width_at is not None:
                _check_count(value, f"the {name} filter's argument")
        if name == "format" and values:
            _check_format(values[0], tuple(kwargs.values()) or values[1:], "%")
        if name == "replace" and len(values) >= 3:
            _check_replace(*values[:4])
        if name == "indent" and values and isinstance(values[0], str):
            width = values[1] if len(values) > 1 else kwargs.get("width", 4)
            width = width if isinstance(width, int) else len(str(width))
            _check_count(len(values[0]) + (values[0].count("\n") + 1) * width, "an indented string of")
        if name == "join" and values:
            at = next((i for i, a in enumerate(args) if a is values[0]), None)
            items = _sized(values[0])
            _check_join(items, values[1] if len(values) > 1 else kwargs.get("d", ""))
            if at is not None:
                args = (*args[:at], items, *args[at + 1 :])
        return _check_result(func(*args, **kwargs))

    return bounded


class _BoundedNamespace(Namespace):
    """``namespace()``, whose attributes a template may set: bounded like any other value."""

    def __setitem__(self, name: str, value: Any) -> None:
        _tick()
        super().__setitem__(name, _check_result(value))


def _bounded_range(*args: int) -> Iterator[int]:
    r = range(*args)
    budget = _budget.get()
    if budget is not None:
        if len(r) > budget.iterations:
            raise TemplateBoundError(f"range() iterations beyond {MAX_ITERATIONS} in one render")
        budget.iterations -= len(r)
    for i, value in enumerate(r):
        if i % 1024 == 0:
            _tick()
        yield value


def _bounded_join(parts: Any) -> str:
    parts = tuple(parts)
    if sum(map(_size, parts)) > MAX_ITEMS:
        raise TemplateBoundError(f"a string of more than {MAX_ITEMS} characters")
    return "".join(map(str, parts))


class _BoundedCodeGenerator(CodeGenerator):
    """Compiles ``a ~ b`` to a bounded join instead of ``str_join``."""

    def visit_Concat(self, node: nodes.Concat, frame: Frame) -> None:
        self.write("environment.bounded_join((")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write("))")


class BoundedSandbox(ImmutableSandboxedEnvironment):
    """``ImmutableSandboxedEnvironment`` whose templates are bounded in size and time (module docstring)."""

    intercepted_binops = frozenset({"*", "**", "%", "+"})
    code_generator_class = _BoundedCodeGenerator

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.filters = {name: _bounded_filter(name, f) for name, f in self.filters.items()}
        self.globals = {"range": _bounded_range, "namespace": _BoundedNamespace, "dict": dict}
        self.bounded_join = _bounded_join

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        _tick()
        ints = all(isinstance(v, int) and not isinstance(v, bool) for v in (left, right))
        if operator == "**" and ints and abs(left) > 1 and right > 0:
            if right * max(left.bit_length(), 1) > MAX_INT_BITS:
                raise TemplateBoundError(f"an integer of more than {MAX_INT_BITS} bits")
        elif operator == "*" and ints:
            if left.bit_length() + right.bit_length() > MAX_INT_BITS:
                raise TemplateBoundError(f"an integer of more than {MAX_INT_BITS} bits")
        elif operator == "*":
            for seq, n in ((left, right), (right, left)):
                if _size(seq) and isinstance(n, int):
                    _check_count(_size(seq) * n, "a repetition")
        elif operator == "%" and isinstance(left, str):
            _check_format(left, right if isinstance(right, tuple | dict) else (right,), "%")
        return _check_result(super().call_binop(context, operator, left, right))

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:
        _tick()
        name = getattr(__obj, "__name__", "")
        text = getattr(__obj, "__self__", None)
        if isinstance(text, str):
            if name in _WIDTH_METHODS:
                for value in (*args, *kwargs.values()):
                    _check_count(value, f"str.{name}'s width")
                if name == "expandtabs":
                    size = (args or (kwargs.get("tabsize", 8),))[0]
                    if isinstance(size, int):
                        _check_count(len(text) + text.count("\t") * size, "a string of")
            elif name == "replace":
                _check_replace(text, *args)
            elif name == "join" and args:
                args = (_sized(args[0]), *args[1:])
                _check_join(args[0], text)
        return _check_result(super().call(__context, __obj, *args, **kwargs))

    def getattr(self, obj: Any, attribute: str) -> Any:
        _tick()
        return super().getattr(obj, attribute)

    def wrap_str_format(self, value: Any) -> Any:
        """The sandbox's ``str.format``/``format_map``, its result's size checked before it is built."""
        wrapper = super().wrap_str_format(value)
        if wrapper is None:
            return None
        fmt, is_map = value.__self__, value.__name__ == "format_map"

        @functools.wraps(wrapper)
        def bounded(*args: Any, **kwargs: Any) -> str:
            _tick()
            given = (
                list(args[0].values()) if is_map and args and isinstance(args[0], dict) else [*args, *kwargs.values()]
            )
            _check_format(fmt, given, "{")
            return _check_result(wrapper(*args, **kwargs))

        return bounded

    def getitem(self, obj: Any, argument: Any) -> Any:
        _tick()
        return super().getitem(obj, argument)


def recursive_macros(template: nodes.Template) -> list[str]:
    """Names of macros that call themselves (a template could double a string at every level)."""
    found = []
    for macro in template.find_all(nodes.Macro):
        if any(isinstance(c.node, nodes.Name) and c.node.name == macro.name for c in macro.find_all(nodes.Call)):
            found.append(macro.name)
    return found


class TemplateTimeout(BaseException):
    """Raised by the alarm when a render runs past its deadline; a BaseException, so that no
    ``except Exception`` inside Jinja swallows it."""


class RenderBudget:
    """Bounds renders on this thread: the cooperative checks always, and ``SIGALRM`` on the main
    thread (where no other alarm is set).

    As a context manager it covers one render, or a batch of them, each in ``render()`` (the alarm's
    handler is installed once per batch, not once per row; the alarm is armed only while a render
    runs, so what the batch does between renders, decoding the next row, say, is never cut short)::

        with RenderBudget() as budget:
            for row in rows:
                with budget.render():
                    render(row)
    """

    def __init__(self, seconds: float | None = None) -> None:
        self.seconds = RENDER_SECONDS if seconds is None else seconds
        self._budget = _Budget(self.seconds)
        self._alarm = False

    def __enter__(self) -> RenderBudget:
        self._token = _budget.set(self._budget)
        self._alarm = (
            threading.current_thread() is threading.main_thread() and signal.getitimer(signal.ITIMER_REAL)[0] == 0
        )
        if self._alarm:
            self._previous = signal.signal(signal.SIGALRM, _expire)
        return self

    @contextlib.contextmanager
    def render(self) -> Iterator[None]:
        """One render: a full deadline and range budget again, and the alarm armed until it ends."""
        self._budget.deadline = time.monotonic() + self.seconds
        self._budget.iterations = MAX_ITERATIONS
        if self._alarm:
            signal.setitimer(signal.ITIMER_REAL, self.seconds)
        try:
            yield
        finally:
            if self._alarm:
                signal.setitimer(signal.ITIMER_REAL, 0)

    def __exit__(self, *exc: object) -> None:
        if self._alarm:
            signal.setitimer(signal.ITIMER_REAL, 0)  # first: no alarm may fire past this block
            signal.signal(signal.SIGALRM, self._previous)
        _budget.reset(self._token)


def _expire(signum: int, frame: Any) -> None:
    raise TemplateTimeout
