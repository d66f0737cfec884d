"""Final answers as data: a parser for LaTeX / plain math text that cannot run code.

Model text is untrusted, so nothing here hands text to Python's eval (sympy's `parse_expr` and
`sympify` of a string do): a tokenizer of a fixed alphabet and a recursive-descent parser build a tree
of plain lists (math_tree.py says what a node is, bounds sizes, evaluates, and builds sympy objects by
their constructors). Everything is bounded so that no answer can hang or exhaust memory: answer
length, token count, nesting depth, and (math_tree.check_bounds) the numbers a power may create:
`2^2^2^2^99` is rejected while parsing, not computed.

An answer (`Answer`) is one expression or equation, a bracketed sequence ("(1,2)", "[0,1)"), a set
("\\{1,2\\}"), a bare list ("1, 2", "1 \\pm 2"), or a union of intervals.
"""

from __future__ import annotations

import re
import unicodedata
from dataclasses import dataclass
from fractions import Fraction

from realcore.data.math_tree import Unparsable, check_bounds

MAX_ANSWER_CHARS = 1000  # a longer "answer" is not one; also bounds every scan below
MAX_TOKENS = 500
MAX_DEPTH = 100  # nesting (parentheses, powers, signs); the tree walkers recurse this deep
MAX_ITEMS = 32  # elements of a tuple / set / list

FUNCS = {"sqrt", "sin", "cos", "tan", "cot", "sec", "csc", "arcsin", "arccos", "arctan", "asin", "acos",
         "atan", "sinh", "cosh", "tanh", "log", "ln", "exp", "abs"}  # fmt: skip
CONSTS = {"pi": "pi", "infty": "oo", "infinity": "oo", "inf": "oo", "oo": "oo"}
GREEK = {"alpha", "beta", "gamma", "delta", "epsilon", "varepsilon", "zeta", "eta", "theta", "vartheta",
         "iota", "kappa", "lambda", "mu", "nu", "xi", "rho", "sigma", "tau", "upsilon", "phi", "varphi",
         "chi", "psi", "omega", "Gamma", "Delta", "Theta", "Lambda", "Xi", "Sigma", "Phi", "Psi", "Omega"}  # fmt: skip
_FRACS = {"frac", "dfrac", "tfrac", "cfrac"}
_MUL_CMDS = {"cdot": "*", "times": "*", "div": "/", "ast": "*"}
# Commands that only format: dropped, the braces after them group as usual.
_IGNORED = {"text", "textbf", "textit", "textrm", "textnormal", "mathrm", "mathbf", "mathit", "mbox",
            "boxed", "left", "right", "displaystyle", "big", "Big", "bigl", "bigr", "Bigl", "Bigr",
            "bigg", "Bigg", "quad", "qquad", ",", ";", ":", "!", " "}  # fmt: skip

_NUM = re.compile(r"\d+(?:\.\d+)?(?:[eE][-+]?\d{1,3}(?![\w.]))?|\.\d+")
_WORD = re.compile(r"[A-Za-z]+")
_CMD = re.compile(r"\\([A-Za-z]+|.)", re.DOTALL)
_OPS = set("+-*/^_=,()[]{}|")
_OPEN, _CLOSE = {"(", "[", "{", "\\{"}, {")", "]", "}", "\\}"}


@dataclass
class Answer:
    kind: str  # "expr", "seq" (ordered, with brackets), "set" / "list" (unordered), "union"
    items: list  # trees (or ["eq", l, r]); Answers for "union"
    brackets: str = ""  # "seq": opening + closing bracket, e.g. "[)"


# ----------------------------------------------------------------------------------------------
# Text normalisation (string level; every step is a linear scan or a fixed replacement)

_UNICODE = {"\u2212": "-", "\u2013": "-", "\u00d7": "*", "\u22c5": "*", "\u00b7": "*", "\u00f7": "/",
            "\u221a": "\\sqrt", "\u03c0": "\\pi", "\u221e": "\\infty", "\u222a": "\\cup", "\u00b0": "",
            "\u20ac": "", "\u00a3": "", "\u00a5": ""}  # fmt: skip
_DROP = re.compile(r"\^\s*\{\s*\\circ\s*\}|\^\s*\\circ|\\circ|\\degree|\\%|%|\\\$|\$|\{,\}|\\[,!;:]")
_THOUSANDS = re.compile(r"(?<=\d)[, ](?=\d{3}(?!\d))")  # "1,234" / "1 234"; "(1,2)" keeps its comma
_UNIT_WRAP = re.compile(r"\\(?:text\w*|mbox|mathrm)$")
_UNIT_POWER = re.compile(r"(?<=\})\^\{?[23]\}?$")
_UNIT_BODY = re.compile(r"[A-Za-z ./]+")  # "cm", " square feet", "km/h"


def normalize(s: str) -> str:
    """Unicode folded (NFKC, minus signs, ...), formatting and units dropped, whitespace collapsed."""
    s = unicodedata.normalize("NFKC", s)
    s = "".join(_UNICODE.get(c, c) for c in s)
    s = _DROP.sub("", s)
    s = " ".join(s.split())
    s = _THOUSANDS.sub("", s)
    s = _strip_units(s).strip().rstrip(".").strip()
    return s


def _strip_units(s: str) -> str:
    """Drop trailing units after a number: "5 \\text{cm}", "12 apples", "6\\text{ m}^2"."""
    for _ in range(3):  # "5 square feet" has two words
        s = s.rstrip().rstrip(".")
        squared = _UNIT_POWER.search(s)  # "\\text{ m}^2": the power goes with the unit
        head = _unit_head(s) if squared is None else _unit_head(s[: squared.start()])
        if head is None or not any(c.isdigit() for c in head):
            return s
        s = head
    return s


def _unit_head(s: str) -> str | None:
    """What comes before a trailing unit (a \\text{...} group, or a word after a space), or None."""
    if s.endswith("}"):
        i = s.rfind("{")  # the unit's body has no braces, so the last "{" opens it
        m = _UNIT_WRAP.search(s, 0, max(i, 0))
        body = s[i + 1 : -1]
        if i > 0 and m is not None and m.end() == i and _UNIT_BODY.fullmatch(body) and not body.isspace():
            return s[: m.start()]
        return None
    h, _, word = s.rpartition(" ")
    if len(word) >= 2 and word.isascii() and word.isalpha() and h and (h[-1].isdigit() or h[-1] in ")}"):
        return h
    return None


def has_percent(s: str) -> bool:
    """"50%" may mean 50 or 0.5: the comparison tries both."""
    return "%" in s or "percent" in s.lower()


def text_key(s: str) -> str:
    """A text answer's comparable form: no formatting commands, braces or spaces, lower case, "(c)" -> "c"."""
    s = re.sub(r"\\(?:text\w*|mathrm|mathbf|mbox|boxed)|[{}\s]", "", s).lower()
    return s[1] if len(s) == 3 and s[0] == "(" and s[2] == ")" else s


def is_text(s: str) -> bool:
    """Words (a name, "yes", "\\text{Monday}"), not algebra: only letters and spaces, some run of 2+ letters."""
    s = re.sub(r"\\(?:text\w*|mathrm|mathbf|mbox)|[{}]", "", s)
    return bool(re.fullmatch(r"[A-Za-z ]+", s)) and any(len(w) > 1 for w in s.split())


# ----------------------------------------------------------------------------------------------
# Tokens and parser


def tokenize(s: str) -> list[tuple[str, str]]:
    """("num" | "name" | "cmd" | "op", text) tokens; anything outside the alphabet is Unparsable."""
    if len(s) > MAX_ANSWER_CHARS:
        raise Unparsable("too long")
    toks, i, n = [], 0, len(s)
    while i < n:
        c = s[i]
        if c.isspace():
            i += 1
            continue
        if c in "0123456789" or (c == "." and i + 1 < n and s[i + 1] in "0123456789"):
            m = _NUM.match(s, i)
            toks.append(("num", m.group()))
        elif c.isascii() and c.isalpha():
            m = _WORD.match(s, i)
            toks.append(("name", m.group()))
        elif c == "\\":
            m = _CMD.match(s, i)
            if m is None:
                raise Unparsable("trailing backslash")
            name = m.group(1)
            if name in ("{", "}"):
                toks.append(("op", "\\" + name))
            elif name not in _IGNORED:
                toks.append(("cmd", name))
        elif c == "*" and s.startswith("**", i):
            toks.append(("op", "^"))
            i += 2
            continue
        elif c in _OPS:
            toks.append(("op", c))
            i += 1
            continue
        else:
            raise Unparsable(f"character {c!r}")
        i = m.end()
        if len(toks) > MAX_TOKENS:
            raise Unparsable("too many tokens")
    return toks


def _literal(text: str) -> list:
    f = Fraction(text)  # digits, a decimal point, an exponent of at most 3 digits: small
    return ["num", f.numerator, f.denominator]


class _Parser:
    """Recursive descent over tokens; `depth` bounds recursion (every nesting passes `unary`)."""

    def __init__(self, toks: list[tuple[str, str]]):
        self.toks, self.i, self.depth, self.bars = toks, 0, 0, 0

    def peek(self, k: int = 0) -> tuple[str, str] | None:
        j = self.i + k
        return self.toks[j] if j < len(self.toks) else None

    def take(self) -> tuple[str, str]:
        t = self.peek()
        if t is None:
            raise Unparsable("unexpected end")
        self.i += 1
        return t

    def expect(self, op: str) -> None:
        if self.take() != ("op", op):
            raise Unparsable(f"expected {op!r}")

    def at_op(self, *ops: str) -> bool:
        t = self.peek()
        return t is not None and t[0] == "op" and t[1] in ops

    # expr := term (("+" | "-") term)*
    def expr(self) -> list:
        terms = [self.term()]
        while self.at_op("+", "-"):
            sign = self.take()[1]
            t = self.term()
            terms.append(t if sign == "+" else ["neg", t])
        return terms[0] if len(terms) == 1 else ["add", *terms]

    # term := unary (("*" | "/" | \cdot | \times | \div) unary | unary)*   (juxtaposition multiplies)
    def term(self) -> list:
        node = self.unary()
        while True:
            t = self.peek()
            if t is not None and (self.at_op("*", "/") or (t[0] == "cmd" and t[1] in _MUL_CMDS)):
                op = t[1] if t[0] == "op" else _MUL_CMDS[t[1]]
                self.take()
                rhs = self.unary()
                node = _mul(node, rhs) if op == "*" else ["div", node, rhs]
            elif self.starts_atom(t):
                mixed = _is_int(node) and t[0] == "cmd" and t[1] in _FRACS
                rhs = self.unary()
                if mixed and _is_int_frac(rhs):  # "2\frac{1}{2}" is 2 + 1/2, as people write it
                    node = ["add", node, rhs] if node[0] == "num" else ["neg", ["add", node[1], rhs]]
                else:
                    node = _mul(node, rhs)
            else:
                return node

    def starts_atom(self, t) -> bool:
        if t is None:
            return False
        kind, v = t
        if kind in ("num", "name"):
            return True
        if kind == "cmd":
            return v not in _MUL_CMDS and v not in ("cup", "pm", "mp", "in", "le", "ge", "leq", "geq", "neq")
        return v in ("(", "[", "{") or (v == "|" and self.bars == 0)

    # unary := ("-" | "+") unary | power
    def unary(self) -> list:
        self.depth += 1
        if self.depth > MAX_DEPTH:
            raise Unparsable("nested too deep")
        try:
            if self.at_op("-", "+"):
                sign = self.take()[1]
                node = self.unary()
                return ["neg", node] if sign == "-" else node
            return self.power()
        finally:
            self.depth -= 1

    # power := atom ("^" exponent)?   (right-associative: 2^3^2 = 2^9)
    def power(self) -> list:
        base = self.atom()
        if self.at_op("^"):
            self.take()
            return ["pow", base, self.unary()]
        return base

    def atom(self) -> list:
        kind, v = self.take()
        if kind == "num":
            return _literal(v)
        if kind == "op":
            if v in ("(", "[", "{"):
                node = self.expr()
                self.expect({"(": ")", "[": "]", "{": "}"}[v])
                return node
            if v == "|" and self.bars == 0:
                self.bars += 1
                node = self.expr()
                self.bars -= 1
                self.expect("|")
                return ["fn", "abs", node]
            raise Unparsable(f"unexpected {v!r}")
        if kind == "name":
            return self.name(v)
        return self.command(v)

    def name(self, word: str) -> list:
        if word in FUNCS:
            return self.function(word)
        if word in CONSTS:
            return ["const", CONSTS[word]]
        if len(word) > 3:
            raise Unparsable(f"word {word!r}")
        # "xy" is x*y (as sympy's split_symbols reads it); a subscript binds to the last letter
        nodes = [["sym", c] for c in word]
        nodes[-1] = self.subscript(word[-1])
        return nodes[0] if len(nodes) == 1 else ["mul", *nodes]

    def subscript(self, name: str) -> list:
        if not self.at_op("_"):
            return ["sym", name]
        self.take()
        if self.at_op("{"):
            self.take()
            parts = []
            while not self.at_op("}"):
                k, v = self.take()
                if k not in ("num", "name") or not v.isalnum():
                    raise Unparsable("subscript")
                parts.append(v)
            self.take()
            sub = "".join(parts)
        else:
            k, sub = self.take()
            if k not in ("num", "name"):
                raise Unparsable("subscript")
            sub = self.split_first(k, sub)
        if not sub:
            raise Unparsable("empty subscript")
        return ["sym", f"{name}_{sub}"]

    def command(self, name: str) -> list:
        if name in _FRACS:
            num = self.argument()
            return ["div", num, self.argument()]
        if name == "sqrt":
            if self.at_op("["):  # \sqrt[n]{x}
                self.take()
                n = self.expr()
                self.expect("]")
                return ["root", self.argument(), n]
            return ["fn", "sqrt", self.argument()]
        if name in FUNCS:
            return self.function(name)
        if name in CONSTS:
            return ["const", CONSTS[name]]
        if name in GREEK:
            return self.subscript(name)
        raise Unparsable(f"command \\{name}")

    def function(self, name: str) -> list:
        name = {"ln": "log", "arcsin": "asin", "arccos": "acos", "arctan": "atan"}.get(name, name)
        base = None
        if name == "log" and self.at_op("_"):  # \log_2 8
            self.take()
            base = self.argument()
        power = None
        if self.at_op("^"):  # \sin^2 x
            self.take()
            power = self.argument()
        arg = self.argument() if self.at_op("(", "{", "[") else self.unary()
        node = ["log", arg, base] if base is not None else ["fn", name, arg]
        return ["pow", node, power] if power is not None else node

    def argument(self) -> list:
        """A LaTeX macro argument: a braced group, or one character (`\\frac12`, `\\sqrt2`)."""
        t = self.peek()
        if t is not None and t[0] in ("num", "name"):
            first = self.split_first(*self.take())
            return _literal(first) if t[0] == "num" else ["sym", first]
        if t is not None and t[0] == "op" and t[1] in ("-", "+"):  # \log_{-2}: odd, but a sign is one token
            return self.unary()
        return self.atom()

    def split_first(self, kind: str, text: str) -> str:
        """Take one character of the current multi-character token, leave the rest as the next token."""
        if kind == "num" and not text.isdigit():  # "\frac1.5", "\sqrt.5": not LaTeX anyone writes
            raise Unparsable("odd macro argument")
        if len(text) > 1:
            rest = text[1:]
            self.i -= 1
            self.toks[self.i] = (kind, rest)
            return text[0]
        return text


def _mul(a: list, b: list) -> list:
    return [*a, b] if a[0] == "mul" else ["mul", a, b]  # flat: "2*3*4*..." does not nest deep


def _is_int(node: list) -> bool:
    inner = node[1] if node[0] == "neg" else node
    return inner[0] == "num" and inner[2] == 1


def _is_int_frac(node: list) -> bool:
    return node[0] == "div" and all(c[0] == "num" and c[2] == 1 for c in node[1:])


# ----------------------------------------------------------------------------------------------
# Answers: expression, sequence, set, list, union


def _top_level_split(toks: list, sep: tuple[str, str]) -> list[list]:
    parts, depth, cur = [], 0, []
    for t in toks:
        if t[0] == "op" and t[1] in _OPEN:
            depth += 1
        elif t[0] == "op" and t[1] in _CLOSE:
            depth -= 1
        if t == sep and depth == 0:
            parts.append(cur)
            cur = []
        else:
            cur.append(t)
    parts.append(cur)
    return parts


def _closes_at_end(toks: list) -> bool:
    """The first token opens a bracket whose match (by depth, any kind: "[0,1)") is the last token."""
    if len(toks) < 2 or toks[0][0] != "op" or toks[0][1] not in _OPEN:
        return False
    depth = 0
    for j, t in enumerate(toks):
        if t[0] == "op":
            depth += t[1] in _OPEN
            depth -= t[1] in _CLOSE
        if depth == 0:
            return j == len(toks) - 1
    return False


def _expression(toks: list) -> list:
    p = _Parser(list(toks))
    node = p.expr()
    if p.peek() is not None:
        raise Unparsable(f"unexpected {p.peek()[1]!r}")
    check_bounds(node)
    return node


def _item(toks: list) -> list:
    """An expression, or an equation `lhs = rhs` (a chain "x = 2 + 3 = 5" keeps its ends: x = 5)."""
    sides = _top_level_split(toks, ("op", "="))
    if any(not s for s in sides):
        raise Unparsable("empty side")
    if len(sides) == 1:
        return _expression(sides[0])
    return ["eq", _expression(sides[0]), _expression(sides[-1])]


def _sequence(toks: list) -> Answer | None:
    """"(1,2)", "[0,1)", "\\{1,2\\}", "{1,2}": bracketed and with a top-level comma inside."""
    if not _closes_at_end(toks):
        return None
    items = _top_level_split(toks[1:-1], ("op", ","))
    if len(items) < 2:
        return None
    if len(items) > MAX_ITEMS:
        raise Unparsable("too many items")
    opening, closing = toks[0][1], toks[-1][1]
    parsed = [_item(t) for t in items]
    if opening == "\\{" or opening == "{":
        return Answer("set", parsed)
    return Answer("seq", parsed, opening + closing)


def parse_answer(s: str) -> Answer:
    """The answer `s` (already `normalize`d) as data; Unparsable if outside the language or its bounds."""
    toks = tokenize(s)
    if len(toks) > 2 and toks[0][0] == "name" and len(toks[0][1]) == 1 and toks[1] == ("cmd", "in"):
        toks = toks[2:]  # "x \in [1, 2]" is the interval
    if not toks:
        raise Unparsable("empty")
    pm = [j for j, t in enumerate(toks) if t in (("cmd", "pm"), ("cmd", "mp"))]
    if len(pm) == 1:  # "1 \pm \sqrt{2}" is the two values
        j = pm[0]
        plus, minus = ("+", "-") if toks[j][1] == "pm" else ("-", "+")
        return Answer("list", [_item(toks[:j] + [("op", sign)] + toks[j + 1 :]) for sign in (plus, minus)])
    unions = _top_level_split(toks, ("cmd", "cup"))
    if len(unions) > 1:
        parts = [_sequence(u) for u in unions]
        if any(p is None or p.kind != "seq" or len(p.items) != 2 for p in parts):
            raise Unparsable("a union of something other than intervals")
        return Answer("union", parts)
    seq = _sequence(toks)
    if seq is not None:
        return seq
    items = _top_level_split(toks, ("op", ","))
    if len(items) > MAX_ITEMS:
        raise Unparsable("too many items")
    if len(items) > 1:
        return Answer("list", [_item(t) for t in items])
    return Answer("expr", [_item(toks)])
