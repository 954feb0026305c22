"""A Jinja sandbox with bounds: a model folder's chat template is untrusted code, so its compile
and its render are bounded in output size, integer size, items, call depth, work and wall time.

How, without signals or threads (so it holds on Windows and in any thread): every operation a
template can make costly goes through a hook that counts and checks before it runs.
- `*`, `**`, `+`, `%`, `//` are intercepted (so Jinja cannot fold them at compile time either):
  a repeated string or list, a sum of two, an integer power or product, a %-format width are
  sized from their operands before Python builds them.
- Every `{% for %}` iterates through bounded_iter, every `~` joins through bounded_concat (the
  template's tree is rewritten before code generation), so loops and growing strings count.
- Calls (macros, methods, globals such as `range`, which is replaced by a counting one), filters,
  attribute and item lookups count one unit of work each and check the deadline; an integer
  argument beyond the output bound is refused before the call (str.center(10**9), batch(10**9)).
- The output is produced with Template.generate and counted as it streams.
Whatever else a template raises (a TypeError, a RecursionError) becomes one line, too.
"""
from __future__ import annotations

import math
import re
import threading
import time
from dataclasses import dataclass
from typing import Callable

from jinja2 import nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.visitor import NodeTransformer


@dataclass(frozen=True)
class TemplateLimits:
    output_chars: int = 8_000_000  # the rendered prompt, and any one string or list built on the way
    int_bits: int = 1024           # any integer a template computes (10**300 fits; 10**10**9 does not)
    work: int = 2_000_000          # loop steps, calls, lookups and operators, all counted alike
    depth: int = 64                # nested macro calls (a recursive macro)
    argument: int = 1_000_000      # any integer passed to a call or filter (a width, a count)
    seconds: float = 5.0           # wall time of one compile or one render


class TemplateLimit(Exception):
    """A template went past one of its bounds; the message names it."""


class StopRequested(Exception):
    """The caller asked the render to stop (Ctrl-C in the REPL)."""


class Budget:
    def __init__(self, limits: TemplateLimits, should_stop: Callable[[], bool] | None = None):
        self.limits, self.should_stop = limits, should_stop
        self.deadline = time.monotonic() + limits.seconds
        self.work = self.depth = self.next_look = 0

    def tick(self, n: int = 1) -> None:
        self.work += n
        if self.work >= self.next_look:  # the clock is read every 64 steps: a VM's clock can cost 1 us
            self.look()

    def look(self) -> None:
        self.next_look = self.work + 64
        if self.work > self.limits.work:
            raise TemplateLimit(f"more than {self.limits.work:,} steps of work (loops, calls, lookups)")
        if time.monotonic() > self.deadline:
            raise TemplateLimit(f"more than {self.limits.seconds:g} s")
        if self.should_stop is not None and self.should_stop():
            raise StopRequested()

    def size(self, n: int, what: str) -> None:
        if n > self.limits.output_chars:
            raise TemplateLimit(f"{what} of {n:,} items or characters, over the bound of {self.limits.output_chars:,}")

    def integer(self, x) -> None:
        if isinstance(x, int) and not isinstance(x, bool) and x.bit_length() > self.limits.int_bits:
            raise TemplateLimit(f"an integer of {x.bit_length():,} bits, over the bound of {self.limits.int_bits:,}")


_FORMAT_WIDTH = re.compile(r"\d+")
_STAR_WIDTH = re.compile(r"%[-#0 +]*(?:\*|\d*\.\*)")


def _sized(x) -> int | None:
    return len(x) if isinstance(x, (str, list, tuple)) else None


def _int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


class _Rewrite(NodeTransformer):
    """Route every loop's iterable and every `~` through the environment's counting helpers."""

    def visit_For(self, node):
        self.generic_visit(node)
        node.iter = nodes.Call(nodes.EnvironmentAttribute("bounded_iter"), [node.iter], [], None, None,
                               lineno=node.lineno)
        return node

    def visit_Concat(self, node):
        self.generic_visit(node)
        return nodes.Call(nodes.EnvironmentAttribute("bounded_concat"), [nodes.List(node.nodes, lineno=node.lineno)],
                          [], None, None, lineno=node.lineno)


class BoundedEnvironment(ImmutableSandboxedEnvironment):
    intercepted_binops = frozenset(["*", "**", "+", "%"])

    def __init__(self, limits: TemplateLimits, **kw):
        super().__init__(finalize=self._finalize, **kw)
        self.limits = limits
        self._local = threading.local()
        self.globals["range"] = self.bounded_range

    # ------------------------------------------------------------ the budget of this thread
    def budget(self) -> Budget:
        b = getattr(self._local, "budget", None)
        if b is None:  # outside compile/render (a filter folded by hand): a fresh default budget
            b = self._local.budget = Budget(self.limits)
        return b

    def run(self, fn, should_stop=None):
        """fn() under a fresh budget for this thread."""
        previous = getattr(self._local, "budget", None)
        self._local.budget = Budget(self.limits, should_stop)
        try:
            return fn()
        finally:
            self._local.budget = previous

    # ------------------------------------------------------------ compile: rewrite the tree
    def _parse(self, source, name, filename):
        return _Rewrite().visit(super()._parse(source, name, filename))

    # ------------------------------------------------------------ hooks
    def bounded_iter(self, iterable):
        b = self.budget()
        for item in iterable:
            b.tick()
            yield item

    def _finalize(self, value):
        """Every {{ value }} before it becomes text: a list holding one big string a million times
        is sized, not printed."""
        if not isinstance(value, str):
            text_size(value, self.budget())
        return value

    def bounded_concat(self, parts):
        b = self.budget()
        for p in parts:
            if not isinstance(p, str):
                text_size(p, b)
        texts = [str(p) for p in parts]
        b.size(sum(map(len, texts)), "a joined string")
        return "".join(texts)

    def bounded_range(self, *args):
        b = self.budget()
        for a in args:
            b.integer(a)
        r = range(*args)
        if len(r) > self.limits.work:
            raise TemplateLimit(f"range of {len(r):,} items, over the work bound of {self.limits.work:,}")
        return _BoundedRange(r, b)

    def call_binop(self, context, op, left, right):
        b = self.budget()
        b.tick()
        if op == "+" and type(left) is str and type(right) is str:  # the common case, kept cheap
            b.size(len(left) + len(right), "a joined string")
            return left + right
        if op == "**" and _int(left) and _int(right) and right > 0 and abs(left) > 1:
            if math.log2(abs(left)) * right > self.limits.int_bits:
                raise TemplateLimit(f"{left} ** {right} would exceed the integer bound of {self.limits.int_bits:,} bits")
        elif op == "*":
            if _int(left) and _int(right):
                if left.bit_length() + right.bit_length() > self.limits.int_bits + 1:
                    raise TemplateLimit(f"a product over the integer bound of {self.limits.int_bits:,} bits")
            elif _sized(left) is not None and _int(right) or _sized(right) is not None and _int(left):
                seq, n = (left, right) if _int(right) else (right, left)
                b.size(len(seq) * max(n, 0), "a repeated string or list")
        elif op == "+" and _sized(left) is not None and _sized(right) is not None:
            b.size(len(left) + len(right), "a joined string or list")
        elif op == "%" and isinstance(left, str):
            _check_format(left, b)
            b.size(len(left) + text_size(right, b), "a formatted string")
        result = self.binop_table[op](left, right)
        b.integer(result)
        return result

    def call(__self, __context, __obj, *args, **kwargs):
        b = __self.budget()
        b.tick()
        _check_args(b, args, kwargs)
        owner = getattr(__obj, "__self__", None)
        if isinstance(owner, str) and getattr(__obj, "__name__", "") in ("replace", "expandtabs", "join"):
            _estimate(b, __obj.__name__, owner, args)
        b.depth += 1
        try:
            if b.depth > __self.limits.depth:
                raise TemplateLimit(f"calls nested more than {__self.limits.depth} deep (a recursive macro?)")
            result = super().call(__context, __obj, *args, **kwargs)
        finally:
            b.depth -= 1
        _check_result(b, result)
        return result

    def getattr(self, obj, attribute):
        self.budget().tick()
        return super().getattr(obj, attribute)

    def getitem(self, obj, argument):
        self.budget().tick()
        return super().getitem(obj, argument)

    def wrap_str_format(self, value):
        wrapped = super().wrap_str_format(value)
        if wrapped is None:
            return None
        template_text = value.__self__

        def checked(*args, **kwargs):
            b = self.budget()
            _check_format(template_text, b)
            b.size(len(template_text) + text_size([args, kwargs], b), "a formatted string")
            return wrapped(*args, **kwargs)
        return checked

    def bound_filters(self) -> None:
        """Every filter counts, checks its integer arguments and the size of what it returns."""
        for name, fn in list(self.filters.items()):
            self.filters[name] = _bounded_filter(self, fn)


class _BoundedRange:
    """range() as templates use it (iterate, len, index, reverse), every step counted."""

    def __init__(self, r: range, budget: Budget):
        self.r, self.b = r, budget

    def __iter__(self):
        for i in self.r:
            self.b.tick()
            yield i

    def __reversed__(self):
        return iter(_BoundedRange(self.r[::-1], self.b))

    def __len__(self):
        return len(self.r)

    def __getitem__(self, i):
        return self.r[i] if isinstance(i, int) else _BoundedRange(self.r[i], self.b)

    def __contains__(self, x):
        return x in self.r


def text_size(value, b: Budget) -> int:
    """About how many characters str(value) or tojson(value) would write, counted item by item (each
    a unit of work) and refused as soon as it passes the output bound: a container is walked, not
    printed, before it is printed."""
    limit, total, stack, seen = b.limits.output_chars, 0, [value], 0
    while stack:
        x = stack.pop()
        seen += 1
        if isinstance(x, str):
            total += len(x) + 2
        elif isinstance(x, dict):
            stack.extend(x.keys())
            stack.extend(x.values())
            total += 2
        elif isinstance(x, (list, tuple, set, frozenset)):
            stack.extend(x)
            total += 2
        else:
            total += 24
        if total > limit:
            raise TemplateLimit(f"a value that prints to over {limit:,} characters")
        if len(stack) > limit:
            raise TemplateLimit(f"a value of over {limit:,} items")
    b.tick(seen)
    return total


def _check_format(text: str, b: Budget) -> None:
    """A format string's widths and precisions are output sizes: `%1000000000s`, `{:>999999999}`."""
    if _STAR_WIDTH.search(text):
        raise TemplateLimit("a %-format with a '*' width (the width would come from the data)")
    for digits in _FORMAT_WIDTH.findall(text):
        if len(digits) > 12 or int(digits) > b.limits.output_chars:
            raise TemplateLimit(f"a format width of {digits}, over the output bound of {b.limits.output_chars:,}")


def _check_args(b: Budget, args, kwargs) -> None:
    for a in (*args, *kwargs.values()):
        if _int(a) and abs(a) > b.limits.argument:
            raise TemplateLimit(f"an argument of {a:,}, over the bound of {b.limits.argument:,}")


def _estimate(b: Budget, name: str, value: str, args) -> None:
    """Size what a string method or filter that multiplies its input would build, before it runs:
    replace (every match becomes `new`), expandtabs and indent (every tab or line grows by a width),
    join (every item plus a separator each), %-format (the widths in the format)."""
    if name == "replace" and len(args) >= 2 and isinstance(args[0], str) and isinstance(args[1], str):
        old, new = args[0], args[1]
        b.size(len(value) + (value.count(old) if old else len(value) + 1) * len(new), "a replaced string")
    elif name == "expandtabs":
        width = args[0] if args and _int(args[0]) else 8
        b.size(len(value) + value.count("\t") * max(width, 0), "a string with its tabs expanded")
    elif name == "indent":
        width = args[0] if args else 4
        width = len(width) if isinstance(width, str) else max(width, 0) if _int(width) else 4
        b.size(len(value) + (value.count("\n") + 1) * width, "an indented string")
    elif name == "join" and args:
        items = list(args[0]) if not isinstance(args[0], (str, list, tuple)) else args[0]
        b.size(text_size(items, b) + len(value) * len(items), "a joined string")
    elif name == "format":
        _check_format(value, b)
        b.size(len(value) + text_size(list(args), b), "a formatted string")


def _check_result(b: Budget, result) -> None:
    n = _sized(result)
    if n is not None:
        b.size(n, "a value")
    b.integer(result)


_PRINTING_FILTERS = {"do_join", "do_string", "soft_str", "_tojson", "do_pprint", "do_format", "do_xmlattr", "do_urlencode",
                     "do_indent", "do_wordwrap", "do_center", "do_mark_safe", "escape", "do_forceescape",
                     "do_urlize", "do_title", "do_upper", "do_lower", "do_capitalize", "do_trim", "do_truncate"}


def _is_jinja_context(x) -> bool:
    return type(x).__name__ in ("EvalContext", "Context", "Environment", "BoundedEnvironment")


def _bounded_filter(env: BoundedEnvironment, fn):
    import functools

    name = getattr(fn, "__name__", "")

    @functools.wraps(fn)
    def filter_(*args, **kwargs):
        b = env.budget()
        b.tick()
        _check_args(b, args, kwargs)
        plain = [a for a in args if not _is_jinja_context(a)]
        if plain and isinstance(plain[0], str) and name.removeprefix("do_") in ("replace", "indent", "format"):
            _estimate(b, name.removeprefix("do_"), plain[0], plain[1:] + list(kwargs.values()))
        if name in _PRINTING_FILTERS:
            text_size(plain, b)
        result = fn(*args, **kwargs)
        if isinstance(result, (str, list, tuple)):
            b.size(len(result), f"the result of filter {fn.__name__.removeprefix('do_')}")
        return result
    return filter_

