"""Parsed answers as trees of plain lists: size bounds, exact and float values, sympy objects.

A node is a JSON-able list (so it crosses the pipe to the sympy worker as data):
    ["num", p, q]            the rational p/q of a literal (3, 0.25, 1.5e3)
    ["sym", name]            a variable: a letter or Greek name, optional subscript (x, a_1, theta)
    ["const", "pi" | "oo"]
    ["add", a, b, ...]   ["mul", a, b, ...]   ["neg", a]   ["div", a, b]   ["pow", a, b]
    ["fn", name, a]          sqrt, sin, ..., log (natural), abs
    ["root", a, n]   ["log", a, base]   ["eq", lhs, rhs] (only as an answer's item)

Nothing here computes a number before knowing it is small: `check_bounds` rejects a tree whose powers
could build one past MAX_BITS (or a symbol past MAX_SYMBOLIC_POWER), and `exact` checks each power's
size before computing it. sympy objects are built by constructors, never from text.
"""

from __future__ import annotations

import math
import re
from fractions import Fraction

MAX_BITS = 16384  # largest exact rational (numerator + denominator bits) ever computed
MAX_SYMBOLIC_POWER = 1000  # x^1000 is fine for sympy; x^(10^6) is not an answer


class Unparsable(ValueError):
    """Text outside the answer language (or beyond its bounds)."""


class TooBig(Unparsable):
    """A number or power beyond the size bounds."""


def _bits(f: Fraction) -> int:
    return f.numerator.bit_length() + f.denominator.bit_length()


def _checked(f: Fraction) -> Fraction:
    if _bits(f) > MAX_BITS:
        raise TooBig("number too large")
    return f


def check_bounds(node: list, scale: int = 1) -> None:
    """Raise TooBig if building `node` could create huge numbers. `scale` is the product of the
    integer powers this node is raised to: ((x^1000)^1000) is x^(10^6) however it is written."""
    op = node[0]
    if op == "num":
        if max(node[1].bit_length(), node[2].bit_length()) * scale > MAX_BITS:
            raise TooBig("power of a large number")
    elif op in ("sym", "const"):
        if scale > MAX_SYMBOLIC_POWER:
            raise TooBig("power too large")
    elif op == "pow":
        base, exp = node[1], node[2]
        check_bounds(exp)
        try:
            e = exact(exp) if not free_symbols(exp) else None  # raises TooBig on 2^(2^99)
        except ZeroDivisionError:
            e = None
        if e is not None and exact_or_none(base) in (0, 1, -1):
            return  # 1^(2^99) is 1: cheap
        _check_exponent(exp)
        check_bounds(base, scale * max(abs(e.numerator), 1) if e is not None else scale)
    elif op == "root":
        check_bounds(node[2])
        _check_exponent(["div", ["num", 1, 1], node[2]])
        check_bounds(node[1], scale)
    else:
        for child in node[1:]:
            if isinstance(child, list):
                check_bounds(child, scale)


def _check_exponent(node: list) -> None:
    """Every rational part of an exponent is small: sympy may split 2^(10^9 + sqrt(2)) into
    2^(10^9) * 2^sqrt(2) while simplifying, so a large part is as bad as a large exponent."""
    if not free_symbols(node):
        try:
            v = exact(node)  # raises TooBig on 2^(2^99)
        except ZeroDivisionError:
            return
        if v is not None:
            if abs(v.numerator) > MAX_BITS or v.denominator > MAX_SYMBOLIC_POWER:
                raise TooBig("exponent too large")
            return
    for child in node[1:]:
        if isinstance(child, list):
            _check_exponent(child)


def exact_or_none(node: list, env: dict | None = None) -> Fraction | None:
    try:
        return exact(node, env)
    except (ZeroDivisionError, TooBig):
        return None


def exact(node: list, env: dict | None = None) -> Fraction | None:
    """The exact rational value of `node` with symbols taken from `env`, or None if it is not a
    rational (pi, sqrt(2), a free symbol). Raises TooBig past MAX_BITS, ZeroDivisionError on 1/0."""
    op = node[0]
    if op == "num":
        return Fraction(node[1], node[2])
    if op == "sym":
        return env.get(node[1]) if env else None
    if op in ("add", "mul"):
        vals = [exact(c, env) for c in node[1:]]
        if any(v is None for v in vals):
            return None
        acc = vals[0]
        for v in vals[1:]:
            acc = _checked(acc + v if op == "add" else acc * v)
        return acc
    if op == "neg":
        v = exact(node[1], env)
        return None if v is None else -v
    if op == "div":
        a, b = exact(node[1], env), exact(node[2], env)
        return None if a is None or b is None else _checked(a / b)
    if op == "pow":
        a, b = exact(node[1], env), exact(node[2], env)
        if a is None or b is None or b.denominator != 1:
            return None
        if a in (0, 1, -1):
            return a**b
        if abs(b.numerator) > MAX_BITS or _bits(a) * abs(b.numerator) > 2 * MAX_BITS:
            raise TooBig("power too large")  # checked before computing: 2^(2^99) never starts
        return _checked(a**b)
    if op == "fn" and node[1] == "abs":
        v = exact(node[2], env)
        return None if v is None else abs(v)
    return None  # const, sqrt, trig, log, root, eq


def approx(node: list, env: dict) -> float:
    """A float value of `node` with symbols from `env`; raises ArithmeticError or ValueError where
    floats cannot say (overflow, a domain error, an unknown node)."""
    op = node[0]
    if op == "num":
        return node[1] / node[2]  # int / int: OverflowError for a number beyond float range
    if op == "sym":
        return env[node[1]]
    if op == "const":
        return math.pi if node[1] == "pi" else math.inf
    if op == "add":
        return math.fsum(approx(c, env) for c in node[1:])
    if op == "mul":
        return math.prod(approx(c, env) for c in node[1:])
    if op == "neg":
        return -approx(node[1], env)
    if op == "div":
        return approx(node[1], env) / approx(node[2], env)
    if op == "pow":
        return math.pow(approx(node[1], env), approx(node[2], env))
    if op == "root":
        return math.pow(approx(node[1], env), 1.0 / approx(node[2], env))
    if op == "log":
        return math.log(approx(node[1], env), approx(node[2], env))
    if op == "fn":
        return _FLOAT_FUNCS[node[1]](approx(node[2], env))
    raise ValueError(f"no float value for {op!r}")


_FLOAT_FUNCS = {"sqrt": math.sqrt, "sin": math.sin, "cos": math.cos, "tan": math.tan,
                "cot": lambda x: 1 / math.tan(x), "sec": lambda x: 1 / math.cos(x), "csc": lambda x: 1 / math.sin(x),
                "asin": math.asin, "acos": math.acos, "atan": math.atan, "sinh": math.sinh, "cosh": math.cosh,
                "tanh": math.tanh, "log": math.log, "exp": math.exp, "abs": abs}  # fmt: skip


def free_symbols(node: list) -> set[str]:
    if node[0] == "sym":
        return {node[1]}
    out: set[str] = set()
    for child in node[1:]:
        if isinstance(child, list):
            out |= free_symbols(child)
    return out


# ----------------------------------------------------------------------------------------------
# sympy objects, built by constructors (never from text)

_SYMBOL_NAME = re.compile(r"[A-Za-z]+(?:_[A-Za-z0-9]+)?")


def to_sympy(node: list):
    """The sympy expression of a tree, checked against the size bounds first."""
    if not isinstance(node, list) or not node:
        raise Unparsable(f"not a tree: {str(node)[:50]!r}")
    check_bounds(node)
    return _build(node)


def _build(node: list):
    import sympy  # ~0.5 s: only in the verifier's worker process, which builds sympy objects

    if not isinstance(node, list) or not node:
        raise Unparsable(f"not a tree: {str(node)[:50]!r}")
    op = node[0]
    if op == "num":
        return sympy.Rational(int(node[1]), int(node[2]))
    if op == "sym":
        if not isinstance(node[1], str) or not _SYMBOL_NAME.fullmatch(node[1]):
            raise Unparsable(f"symbol name {node[1]!r}")
        return sympy.Symbol(node[1])
    if op == "const":
        return {"pi": sympy.pi, "oo": sympy.oo}[node[1]]
    if op == "add":
        return sympy.Add(*[_build(c) for c in node[1:]])
    if op == "mul":
        return sympy.Mul(*[_build(c) for c in node[1:]])
    if op == "neg":
        return -_build(node[1])
    if op == "div":
        return _build(node[1]) / _build(node[2])
    if op == "pow":
        return sympy.Pow(_build(node[1]), _build(node[2]))
    if op == "root":
        return sympy.root(_build(node[1]), _build(node[2]))
    if op == "log":
        return sympy.log(_build(node[1]), _build(node[2]))
    if op == "fn":
        fn = {"sqrt": sympy.sqrt, "sin": sympy.sin, "cos": sympy.cos, "tan": sympy.tan, "cot": sympy.cot,
              "sec": sympy.sec, "csc": sympy.csc, "asin": sympy.asin, "acos": sympy.acos, "atan": sympy.atan,
              "sinh": sympy.sinh, "cosh": sympy.cosh, "tanh": sympy.tanh, "log": sympy.log, "exp": sympy.exp,
              "abs": sympy.Abs}[node[1]]  # fmt: skip
        return fn(_build(node[2]))
    raise Unparsable(f"node {op!r}")
