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
- ``range`` counts its iterations over the whole render (``MAX_ITERATIONS``);
- recursive macros are refused when the template is compiled;
- a render has a deadline (``RENDER_SECONDS``): checked at every call,
  attribute access and loop step of a ``range``, and enforced by ``SIGALRM``
  when rendering on the main thread (``RenderBudget``).

A bound that is hit raises ``TemplateBoundError`` (a ``SecurityError``), which
the renderer turns into a row error.
"""

from __future__ import annotations

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


def _check_format(fmt: Any) -> None:
    """Widths and precisions in a %-format or a str.format string."""
    if not isinstance(fmt, str):
        return
    specs = re.findall(r"%[-#0 +(\w)]*[\d.*]*", fmt)
    try:
        specs += [spec for _, _, spec, _ in string.Formatter().parse(fmt) if spec]
    except ValueError:
        pass  # not a str.format string; str.format would fail on it anyway
    for spec in specs:
        for number in re.findall(r"\d+", spec):
            _check_count(int(number), "a format width")


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
            _check_format(values[0])
        if name == "replace" and len(values) >= 3:
            _check_replace(*values[:4])
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
            _check_format(left)
        return _check_result(super().call_binop(context, operator, left, right))

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:
        _tick()
        name = getattr(__obj, "__name__", "")
        if isinstance(getattr(__obj, "__self__", None), str):
            if name in _WIDTH_METHODS:
                for value in (*args, *kwargs.values()):
                    _check_count(value, f"str.{name}'s width")
            elif name == "replace":
                _check_replace(__obj.__self__, *args)
        return _check_result(super().call(__context, __obj, *args, **kwargs))

    def getattr(self, obj: Any, attribute: str) -> Any:
        _tick()
        if isinstance(obj, str) and attribute in ("format", "format_map"):
            _check_format(obj)  # the sandbox hands out a wrapper of str.format, checked here
        return super().getattr(obj, attribute)

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

    As a context manager it covers one render, or a batch of them with ``restart()`` before each
    (the alarm's handler is installed once per batch, not once per row)::

        with RenderBudget() as budget:
            for row in rows:
                budget.restart()
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
            signal.setitimer(signal.ITIMER_REAL, self.seconds)
        return self

    def restart(self) -> None:
        """A new render: a full deadline and range budget again."""
        self._budget.deadline = time.monotonic() + self.seconds
        self._budget.iterations = MAX_ITERATIONS
        if self._alarm:
            signal.setitimer(signal.ITIMER_REAL, self.seconds)

    def __exit__(self, *exc: object) -> None:
        if self._alarm:
            signal.setitimer(signal.ITIMER_REAL, 0)  # first: no alarm may fire past this block
            signal.signal(signal.SIGALRM, self._previous)
        _budget.reset(self._token)


def _expire(signum: int, frame: Any) -> None:
    raise TemplateTimeout
