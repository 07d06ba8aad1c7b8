"""Chat templates come inside model files, from strangers: they render in jinja2's immutable sandbox, with
bounds on the work they may do.

The sandbox already refuses attribute walks (`__class__`, `__subclasses__`, `mro`) and mutation of the
values we pass in. It does not bound work: `range` loops nest, `'x' * 10**10` or `'x'|center(10**10)`
allocates gigabytes in one C call, `9 ** 10**6` computes for minutes, a recursive macro recurses, and
doubling a string a few dozen times exhausts memory. So here:
  - whatever builds a string or list in one step (`*`, `+`, `~`, `%`, `**`, join, replace, format) is
    refused when its result would pass MAX_STRING, before it allocates;
  - every call (methods, globals, filters) is refused a number above MAX_NUMBER;
  - `range` draws from one budget of iterations per render;
  - a trace function watches the template's own code: past TIME_LIMIT_S of rendering, or MEMORY_LIMIT
    bytes of growth in the process's resident memory (read at most every millisecond), it stops the render;
  - the output is bounded (MAX_STRING characters).
Every refusal is a TokenizerError naming the template's source; nothing outside this module is patched.
"""
from __future__ import annotations

import functools
import json
import operator
import os
import re
import resource
import sys
import time
from datetime import datetime
from typing import Any

from .errors import TokenizerError

TIME_LIMIT_S = 2.0  # real templates render in milliseconds, even for long chats
MEMORY_LIMIT = 256 << 20  # growth of the process's peak RSS while rendering
MAX_STRING = 16 << 20  # characters in any one value and in the output: ~4M tokens, far past any context
MAX_NUMBER = 1 << 20  # the largest number a call may take (widths, counts, ranges)
RANGE_BUDGET = 1 << 20  # `range` items per render, all calls together
TEMPLATE_FILE = "<template>"  # the filename jinja gives compiled template code
_PRINTF_HUGE = re.compile(r"%[-#0 +]*(\*|\d{7,})|%[-#0 +]*\d*\.(\*|\d{7,})")  # '%9999999s', '%*s'
_FORMAT_HUGE = re.compile(r"\{[^{}]*:[^{}]*(\d{7,}|\{)")  # '{:9999999}', '{:{}}'


class TemplateLimit(Exception):
    """A bound was hit (raised inside the render, reported as TokenizerError)."""


def _raise(message: str) -> None:
    raise TokenizerError(f"chat template: {message}")


def _check_numbers(what: str, values: Any) -> None:
    for v in values:
        if isinstance(v, int) and not isinstance(v, bool) and abs(v) > MAX_NUMBER:
            raise TemplateLimit(f"{what} with the number {v} (the limit is {MAX_NUMBER})")


def _bounded(name: str, fn: Any) -> Any:
    """A filter that refuses huge numeric arguments (the value it filters is not counted)."""
    skip = 1 + (getattr(fn, "jinja_pass_arg", None) is not None)  # context/environment comes first

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        _check_numbers(f"filter {name}", list(args[skip:]) + list(kwargs.values()))
        if name == "format" and isinstance(args[skip - 1], str) and _PRINTF_HUGE.search(args[skip - 1]):
            raise TemplateLimit("a %-format with a huge or computed width")
        if name == "join":
            return _join(*args[skip - 1:], **kwargs)
        if name == "replace":
            return _replace(*args[skip - 1:], **kwargs)
        return fn(*args, **kwargs)
    return call


def _size(x: Any) -> int:
    return len(x) if isinstance(x, (str, list, tuple)) else 0


def _check_size(what: str, n: int) -> None:
    if n > MAX_STRING:
        raise TemplateLimit(f"{what} would build a value {n} long (the limit is {MAX_STRING})")


def _join(value: Any, d: str = "", attribute: Any = None) -> str:
    items = [str(v[attribute] if attribute is not None else v) for v in value]
    _check_size("join", sum(map(len, items)) + len(str(d)) * len(items))
    return str(d).join(items)


def _replace(s: Any, old: Any, new: Any, count: int | None = None) -> str:
    s, old, new = str(s), str(old), str(new)
    hits = (s.count(old) if old else len(s) + 1) if count is None or count < 0 else count
    _check_size("replace", len(s) + hits * len(new))
    return s.replace(old, new, -1 if count is None else count)


def _tojson(x: Any, indent: int | None = None, **_: Any) -> str:
    return json.dumps(x, ensure_ascii=False, indent=indent)


def _environment():
    from jinja2.compiler import CodeGenerator
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class BoundedCode(CodeGenerator):
        def visit_Concat(self, node, frame) -> None:  # `a ~ b ~ c`: sized before it is joined
            self.write("environment.concat_bounded((")
            for arg in node.nodes:
                self.visit(arg, frame)
                self.write(", ")
            self.write("))")

    class BoundedSandbox(ImmutableSandboxedEnvironment):
        intercepted_binops = frozenset(["*", "**", "%", "+"])
        code_generator_class = BoundedCode

        @staticmethod
        def concat_bounded(parts: tuple) -> str:
            texts = [str(p) for p in parts]
            _check_size("~", sum(map(len, texts)))
            return "".join(texts)

        def call_binop(self, context, op: str, left: Any, right: Any) -> Any:
            if op == "+":
                _check_size("+", _size(left) + _size(right))
            elif op == "**":
                if isinstance(right, (int, float)) and abs(right) > 64 and isinstance(left, (int, float)) and abs(left) > 1:
                    raise TemplateLimit(f"{left!r} ** {right!r} is too large")
            elif op == "*":
                for seq, n in ((left, right), (right, left)):
                    if isinstance(seq, (str, list, tuple)) and isinstance(n, int) and len(seq) * n > MAX_STRING:
                        raise TemplateLimit(f"repeating a sequence of {len(seq)} {n} times")
            elif op == "%" and isinstance(left, str) and _PRINTF_HUGE.search(left):
                raise TemplateLimit("a %-format with a huge or computed width")
            return {"*": operator.mul, "**": operator.pow, "%": operator.mod, "+": operator.add}[op](left, right)

        def call(__self, __context, __obj, *args: Any, **kwargs: Any) -> Any:  # noqa: N805 - jinja's signature
            name = getattr(__obj, "__name__", type(__obj).__name__)
            _check_numbers(f"calling {name}", list(args) + list(kwargs.values()))
            if name == "replace" and isinstance(getattr(__obj, "__self__", None), str):
                return _replace(__obj.__self__, *args, **kwargs)
            if name == "join" and isinstance(getattr(__obj, "__self__", None), str) and len(args) == 1:
                return _join(args[0], __obj.__self__)
            return super().call(__context, __obj, *args, **kwargs)

        def wrap_str_format(self, value: Any) -> Any:
            text = getattr(value, "__self__", None)
            if (getattr(value, "__name__", "") in ("format", "format_map") and isinstance(text, str)
                    and _FORMAT_HUGE.search(text)):
                raise TemplateLimit("a str.format with a huge or computed width")
            return super().wrap_str_format(value)

    env = BoundedSandbox(trim_blocks=True, lstrip_blocks=True)
    env.globals.pop("lipsum", None)  # generates text of any size; no chat template uses it
    env.filters["tojson"] = _tojson
    env.filters = {name: _bounded(name, fn) for name, fn in env.filters.items()}
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


@functools.lru_cache(maxsize=16)
def _compile(template: str):
    return _environment().from_string(template)


_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def _rss() -> int:
    """The process's resident memory now (Linux: /proc/self/statm, a few µs); elsewhere its peak."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * _PAGE
    except OSError:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)


class _Watch:
    """sys.settrace over the template's own frames: time and peak-memory growth, checked on each line."""

    def __init__(self) -> None:
        self.deadline = time.monotonic() + TIME_LIMIT_S
        self.rss0 = _rss()
        self.next_memory_check = 0.0
        self.range_left = RANGE_BUDGET

    def range(self, *args: int) -> range:
        r = range(*args)
        self.range_left -= len(r)
        if self.range_left < 0:
            raise TemplateLimit(f"loops over more than {RANGE_BUDGET} range() items")
        return r

    def check(self) -> None:
        now = time.monotonic()
        if now > self.deadline:
            raise TemplateLimit(f"rendering took longer than {TIME_LIMIT_S} s")
        # Every value is bounded (MAX_STRING), so memory grows at most a value per millisecond unseen.
        if now >= self.next_memory_check:
            self.next_memory_check = now + 0.001
            if _rss() - self.rss0 > MEMORY_LIMIT:
                raise TemplateLimit(f"rendering used more than {MEMORY_LIMIT >> 20} MiB")

    def global_trace(self, frame, event: str, arg: Any):
        if frame.f_code.co_filename == TEMPLATE_FILE:
            self.check()
            return self.local_trace
        return None

    def local_trace(self, frame, event: str, arg: Any):
        if event == "line":
            self.check()
        return self.local_trace


def render_template(template: str, source: str = "", **context: Any) -> str:
    """Render an untrusted chat template under the bounds above; `source` (the model file) names it in errors."""
    from jinja2 import TemplateError

    where = f"{source}: chat template" if source else "chat template"
    try:
        compiled = _compile(template)
    except TemplateError as e:
        raise TokenizerError(f"{where} does not parse ({_line(e)})") from e
    except (RecursionError, MemoryError, ValueError, TypeError) as e:
        raise TokenizerError(f"{where} cannot be compiled ({type(e).__name__})") from e
    watch = _Watch()
    out: list[str] = []
    size = 0
    chunks = compiled.generate(**context, range=watch.range)
    old_trace = sys.gettrace()
    sys.settrace(watch.global_trace)
    try:
        for chunk in chunks:
            size += len(chunk)
            if size > MAX_STRING:
                raise TemplateLimit(f"output longer than {MAX_STRING} characters")
            out.append(chunk)
    except TokenizerError as e:  # raise_exception() from the template itself
        raise TokenizerError(f"{source}: {e}" if source else str(e)) from e
    except TemplateLimit as e:
        raise TokenizerError(f"{where} refused: {e}") from None
    except TemplateError as e:  # includes the sandbox's SecurityError
        raise TokenizerError(f"{where} failed: {_line(e)}") from e
    except RecursionError as e:
        raise TokenizerError(f"{where} refused: recursion too deep") from e
    except MemoryError as e:
        raise TokenizerError(f"{where} refused: out of memory") from e
    except (TypeError, ValueError, KeyError, IndexError, AttributeError, ArithmeticError) as e:
        raise TokenizerError(f"{where} failed: {type(e).__name__}: {_line(e)}") from e
    finally:
        sys.settrace(old_trace)
        chunks.close()  # now, not when collected under a later render's watch
    return "".join(out)


def _line(e: BaseException) -> str:
    text = str(e).strip() or type(e).__name__
    return text.splitlines()[0][:200]
