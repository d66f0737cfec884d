"""Math answer checking: extract the final answer of a response and compare it with the reference.

Model text is untrusted. Extraction is linear in the response's length (one pass for braces, no
regex that can backtrack badly); answers are parsed by math_parse.py, which cannot run code and
bounds every size, never by sympy's `parse_expr` (Python eval). Comparison, cheapest first:
normalised text; exact rationals (1/2 = 0.5 = \\frac{1}{2}, relative tolerance 1e-6 for decimals);
for expressions with variables or irrationals, values at a few fixed points (different there =
different); only what is still undecided goes to sympy's `simplify(a - b) == 0`, which can still be
slow, so it runs in one spawned worker process that receives parsed trees (data, not text), reused
across calls and killed and recreated past its time limit. The reward runner's child process around
the whole reward (realcore/workflows/reward_runner.py) is the second barrier. docs/math-verifier.md has
the rules and how this compares with `math-verify`.
"""

from __future__ import annotations

import atexit
import ctypes
import json
import math
import multiprocessing as mp
import os
import re
import signal
import threading
import time
from fractions import Fraction

from realcore.api.registry import register_reward
from realcore.data.math_parse import (
    MAX_ANSWER_CHARS,
    MAX_ITEMS,
    Answer,
    has_percent,
    is_text,
    normalize,
    parse_answer,
    text_key,
)
from realcore.data.math_tree import Unparsable, approx, exact, free_symbols, to_sympy

__all__ = ["extract_answer", "math_equal", "math_reward", "normalize", "symbolic_equal"]

# ----------------------------------------------------------------------------------------------
# Extraction (linear time: `"\\boxed{" * 8000` must not rescan the text per occurrence)

_BOXED = re.compile(r"\\boxed")
_BOXED_TOKEN = re.compile(r"\s+([^\s$]+)")  # "\boxed 7": \s+ cannot backtrack into [^\s$]
# A leading minus only when it is not a binary operator ("5-3" -> "3", not "-3").
_NUMBER = re.compile(r"(?:(?<![\w)])-)?(?:(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:/\d+)?|\.\d+)")


def _matching_braces(text: str) -> dict[int, int]:
    """Index of each "{" that has a matching "}" -> index of that "}" (one pass with a stack)."""
    stack, match = [], {}
    for i, c in enumerate(text):
        if c == "{":
            stack.append(i)
        elif c == "}" and stack:
            match[stack.pop()] = i
    return match


def _boxed(text: str) -> str | None:
    """Content of the last well-formed `\\boxed{...}` (nested braces ok) or `\\boxed N`."""
    starts = [m.end() for m in _BOXED.finditer(text)]
    match = _matching_braces(text) if starts else {}
    for i in reversed(starts):
        if i < len(text) and text[i] == "{":
            j = match.get(i)
            if j is not None:
                return text[i + 1 : j].strip()
        else:
            tok = _BOXED_TOKEN.match(text, i)
            if tok:
                return tok.group(1).rstrip(".")
    return None


def _hashes(text: str) -> str | None:
    """GSM8K's final answer: the rest of the line after the last `####` that has one."""
    i = text.rfind("####")
    while i != -1:
        j = i + 4
        while j < len(text) and text[j].isspace():
            j += 1
        end = text.find("\n", j)
        line = text[j : end if end != -1 else len(text)].strip()
        if line:
            return line
        i = text.rfind("####", 0, i)
    return None


def _answer_is(text: str) -> str | None:
    """What follows the last "answer is": an inline `$...$`, else a number ("The final answer is
    $\\frac14$. I hope it is correct." is how many models end, without a box)."""
    i = text.lower().rfind("answer is")
    if i == -1:
        return None
    j = i + len("answer is")
    while j < len(text) and (text[j].isspace() or text[j] == ":"):
        j += 1
    if text.startswith("$", j):
        k = text.find("$", j + 1, j + 1 + MAX_ANSWER_CHARS)
        if k != -1 and text[j + 1 : k].strip():
            return text[j + 1 : k].strip()
        j += 1  # a currency sign: "the answer is $5."
    m = _NUMBER.match(text, j)
    if m is None or (m.end() < len(text) and text[m.end()].isalnum()):  # "is 1e5", "is 5x": not just a number
        return None
    return m.group()


def extract_answer(text: str) -> str | None:
    """The final answer in `text`: last `\\boxed{}`, else GSM8K `#### N`, else what follows the last
    "answer is" (`$...$` or a number), else the last number."""
    boxed = _boxed(text)
    if boxed:
        return boxed
    hashes = _hashes(text)
    if hashes:
        return hashes
    stated = _answer_is(text)
    if stated:
        return stated
    last = None
    for last in _NUMBER.finditer(text):
        pass
    return last.group() if last else None


# ----------------------------------------------------------------------------------------------
# Comparison

_REL_TOL = 1e-6  # for two rational constants: "0.3333333" is 1/3
_FLOAT_REL_TOL = 1e-4  # values at a point: only a clear difference decides (floats lose digits)
_POINTS = (Fraction(7, 11), Fraction(13, 8), Fraction(19, 7), Fraction(5, 13), Fraction(23, 17))


def _numbers_equal(a: Fraction, b: Fraction) -> bool:
    if a == b:
        return True
    try:
        return math.isclose(float(a), float(b), rel_tol=_REL_TOL)
    except OverflowError:  # beyond float range and not exactly equal
        return False


def _env(names: list[str], k: int) -> dict[str, Fraction]:
    """Point k: distinct, positive (sqrt and log stay real), not simple values."""
    return {name: _POINTS[(k + j) % len(_POINTS)] + j for j, name in enumerate(names)}


def _differ_somewhere(a: list, b: list, names: list[str]) -> bool:
    """True if `a` and `b` certainly differ: exactly at a rational point, or clearly in floats."""
    for k in range(3):
        env = _env(names, k)
        try:
            ea, eb = exact(a, env), exact(b, env)
        except (ArithmeticError, Unparsable):  # 1/0 at this point, or a number too large
            ea = eb = None
        if ea is not None and eb is not None:
            if ea != eb:
                return True
            continue
        try:
            fenv = {n: float(v) for n, v in env.items()}
            fa, fb = approx(a, fenv), approx(b, fenv)
        except (ArithmeticError, ValueError, KeyError):
            continue
        if math.isfinite(fa) and math.isfinite(fb) and not math.isclose(fa, fb, rel_tol=_FLOAT_REL_TOL, abs_tol=1e-9):
            return True
    return False


def _values_equal(a: list, b: list, deadline: float) -> bool:
    if a == b:
        return True
    names = sorted(free_symbols(a) | free_symbols(b))
    if not names:
        try:
            ea, eb = exact(a), exact(b)
        except (ArithmeticError, Unparsable):  # 1/0, or a constant too large to decide
            return False
        if ea is not None and eb is not None:
            return _numbers_equal(ea, eb)
        try:
            fa, fb = approx(a, {}), approx(b, {})
            if math.isinf(fa) and fa == fb:  # oo - oo is not 0 to sympy
                return True
        except (ArithmeticError, ValueError):
            pass
    if _differ_somewhere(a, b, names):
        return False
    remaining = deadline - time.monotonic()
    return remaining > 0 and symbolic_equal(a, b, remaining)


def _items_equal(a: list, b: list, deadline: float) -> bool:
    """Two items: expressions, or equations ("x=3" and "2+1=3" also equal "3"; "x=3" and "y=3" differ)."""
    if a[0] == "eq" and b[0] == "eq":
        if _values_equal(a[1], b[1], deadline) and _values_equal(a[2], b[2], deadline):
            return True
        return _same_equation(a, b, deadline)
    if a[0] == "eq" or b[0] == "eq":
        eq, other = (a, b) if a[0] == "eq" else (b, a)
        named = eq[1][0] == "sym" or not free_symbols(eq[1])  # "x = 3" or a computation "2 + 1 = 3"
        return named and _values_equal(eq[2], other, deadline)
    return _values_equal(a, b, deadline)


def _same_equation(a: list, b: list, deadline: float) -> bool:
    """`l1 = r1` and `l2 = r2` are one equation if l1 - r1 = c (l2 - r2) for a constant c != 0
    ("2x + 3y = 6" and "4x + 6y = 12", "x = 3" and "3 = x"); c is read off at one point."""
    d1, d2 = ["add", a[1], ["neg", a[2]]], ["add", b[1], ["neg", b[2]]]
    names = sorted(free_symbols(d1) | free_symbols(d2))
    if not names:
        return False
    try:
        v1, v2 = exact(d1, _env(names, 0)), exact(d2, _env(names, 0))
    except (ArithmeticError, Unparsable):
        return False
    if v1 is None or v2 is None or v1 == 0 or v2 == 0:
        return False
    c = v1 / v2
    return _values_equal(d1, ["mul", ["num", c.numerator, c.denominator], d2], deadline)


def _answers_equal(a: Answer, b: Answer, deadline: float) -> bool:
    unordered = {"set", "list"}
    if a.kind in unordered and b.kind in unordered:
        return _same_multiset(a.items, b.items, deadline)
    if a.kind != b.kind or len(a.items) != len(b.items) or a.brackets != b.brackets:
        return False
    if a.kind == "union":  # of intervals: order does not matter, brackets do
        left = list(b.items)
        for x in a.items:
            j = next((j for j, y in enumerate(left) if _answers_equal(x, y, deadline)), None)
            if j is None:
                return False
            left.pop(j)
        return True
    return all(_items_equal(x, y, deadline) for x, y in zip(a.items, b.items))


def _same_multiset(xs: list, ys: list, deadline: float) -> bool:
    if len(xs) != len(ys) or len(xs) > MAX_ITEMS:
        return False
    left = list(ys)
    for x in xs:  # greedy matching: equality is transitive, so a match never needs undoing
        j = next((j for j, y in enumerate(left) if _items_equal(x, y, deadline)), None)
        if j is None:
            return False
        left.pop(j)
    return True


def math_equal(pred: str, gold: str, *, timeout_s: float = 2.0) -> bool:
    """Whether `pred` and `gold` denote the same answer; `timeout_s` bounds the time spent in sympy."""
    if not pred or not gold or len(pred) > MAX_ANSWER_CHARS or len(gold) > MAX_ANSWER_CHARS:
        return False
    a, b = normalize(pred), normalize(gold)
    if not a or not b:
        return False
    if a == b:
        return True
    try:
        pa, pb = parse_answer(a), parse_answer(b)
    except Unparsable:  # not math we can read (or beyond the size bounds): compare as text
        return text_key(a) == text_key(b)
    deadline = time.monotonic() + timeout_s
    if _answers_equal(pa, pb, deadline):
        return True
    for text, answer, other in ((pred, pa, pb), (gold, pb, pa)):  # "50%" is 50 (above) or 0.5
        if has_percent(text) and answer.kind == "expr" and answer.items[0][0] != "eq":
            hundredth = Answer("expr", [["div", answer.items[0], ["num", 100, 1]]])
            if _answers_equal(hundredth, other, deadline):
                return True
    # "Yes" and "yes" parse as products of different symbols; as words they are one answer.
    return is_text(a) and is_text(b) and text_key(a) == text_key(b)


# ----------------------------------------------------------------------------------------------
# Symbolic comparison in a worker process


def _die_with_parent(parent_pid: int) -> None:
    """Kernel SIGKILLs this process when its parent dies (Linux), even while sympy is stuck in C code."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
    except OSError:
        pass
    if os.getppid() != parent_pid:  # parent died before we asked
        os._exit(1)


def _worker_main(conn, parent_pid: int) -> None:
    """Worker loop: receive a JSON [tree, tree] pair, answer b"1" / b"0"; exit when the parent's end
    closes. Trees are built into sympy objects by constructors: no text is ever parsed here."""
    _die_with_parent(parent_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    from sympy import simplify  # ~0.5 s: only in the verifier's worker process

    conn.send_bytes(b"ready")
    while True:
        try:
            a, b = json.loads(conn.recv_bytes())
        except EOFError:
            return
        try:
            ok = bool(simplify(to_sympy(a) - to_sympy(b)) == 0)
        except Exception:  # a malformed tree, TypeError on non-expressions, MemoryError, RecursionError
            ok = False
        conn.send_bytes(b"1" if ok else b"0")


_STARTUP_TIMEOUT_S = 120.0  # first spawn imports sympy (and realcore.data's torch) in the child
_lock = threading.Lock()  # one request at a time on the shared pipe
_worker: dict | None = None  # {"proc", "conn", "owner_pid", "ready"}
_ready_once: int | None = None  # the pid of the process whose worker has answered "ready" once


def _stop_worker() -> None:
    global _worker
    w, _worker = _worker, None
    if w is None or w["owner_pid"] != os.getpid():  # a forked copy does not own the worker
        return
    w["proc"].kill()
    w["proc"].join(5)
    w["conn"].close()


def _start_worker() -> dict:
    """Start a worker; it reports "ready" once sympy is imported (`_wait_ready`)."""
    global _worker
    ctx = mp.get_context("spawn")  # never fork a process that may hold torch threads and locks
    conn, child_conn = ctx.Pipe()
    proc = ctx.Process(target=_worker_main, args=(child_conn, os.getpid()), name="realcore-sympy")
    proc.start()
    child_conn.close()
    # Not a daemon (a daemonic caller, e.g. a pool worker, could not start one), so the stop hook
    # is registered after start(): atexit is LIFO, and multiprocessing's own hook, registered on
    # its first start(), would otherwise wait forever for this child.
    atexit.unregister(_stop_worker)
    atexit.register(_stop_worker)
    _worker = {"proc": proc, "conn": conn, "owner_pid": os.getpid(), "ready": False}
    return _worker


def _wait_ready(w: dict, timeout_s: float) -> bool:
    global _ready_once
    if not w["ready"]:
        try:
            w["ready"] = w["conn"].poll(max(0.0, timeout_s)) and w["conn"].recv_bytes() == b"ready"
        except (EOFError, OSError):  # the child crashed while importing
            _stop_worker()
            return False
        if w["ready"]:
            _ready_once = os.getpid()
    return w["ready"]


def _get_worker(deadline: float) -> dict | None:
    """The worker, ready, or None when it is not ready by `deadline`. Only a process's first worker
    may take its whole start-up (_STARTUP_TIMEOUT_S, else RuntimeError): a replacement for one that
    was killed or died starts at once and is waited on within the call's deadline (until it is
    ready, a comparison that needs it is False, as on a timeout)."""
    if _worker is not None and (_worker["owner_pid"] != os.getpid() or not _worker["proc"].is_alive()):
        _stop_worker()  # forked copy, or the worker died (e.g. its creating thread exited: PDEATHSIG)
    w = _worker or _start_worker()
    if _ready_once != os.getpid():
        if not _wait_ready(w, _STARTUP_TIMEOUT_S):
            _stop_worker()
            raise RuntimeError(f"math_verify: the sympy worker failed to start within {_STARTUP_TIMEOUT_S:.0f} s")
        return w
    return w if _wait_ready(w, deadline - time.monotonic()) else None


def symbolic_equal(a: list, b: list, timeout_s: float = 2.0) -> bool:
    """sympy `simplify(a - b) == 0` of two parsed trees in the worker, within `timeout_s` (the
    worker's restart after a timeout included); False on timeout (the worker is killed and a
    replacement started at once) or any error."""
    with _lock:
        first = _ready_once != os.getpid()
        deadline = time.monotonic() + timeout_s
        w = _get_worker(deadline)
        if w is None:  # the replacement is still importing sympy
            return False
        if first:  # the process's first start-up is not the call's: it gets its whole timeout after it
            deadline = time.monotonic() + timeout_s
        try:
            w["conn"].send_bytes(json.dumps([a, b]).encode())
            if w["conn"].poll(max(0.0, deadline - time.monotonic())):
                return w["conn"].recv_bytes() == b"1"
        except (EOFError, OSError):  # worker died mid-request (e.g. out of memory)
            pass
        _stop_worker()
        _start_worker()  # imports sympy while the caller goes on
        return False


# ----------------------------------------------------------------------------------------------
# Reward


@register_reward("math")
def math_reward(prompt: str, completion: str, prompt_ids: list[int], completion_ids: list[int], *, answer: str,
                **data) -> float:
    """1.0 if the completion's final answer equals the dataset row's reference `answer`, else 0.0.

    The reference is a GSM8K solution ("... #### 72") or a MATH one (`\\boxed{}`), from which the final
    answer is extracted, or else the bare answer itself ("x+1" must not become "1")."""
    gold = extract_answer(answer) if ("####" in answer or "\\boxed" in answer) else answer.strip()
    pred = extract_answer(completion)
    if pred is None or not gold:
        return 0.0
    return 1.0 if math_equal(pred, gold) else 0.0
