"""Math answer checking: extract the final answer of a response and compare it with the reference.

Comparison is numeric first (int / decimal / fraction, relative tolerance 1e-6) and symbolic (sympy)
only when the numeric path cannot decide. sympy can hang or eat memory on adversarial input
(`9**9**9**9`), so the symbolic check runs in one spawned worker process, reused across calls and
killed and recreated when an answer exceeds its time limit.
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
from fractions import Fraction

from realcore.api.registry import register_reward

# ----------------------------------------------------------------------------------------------
# Extraction


def _braced(s: str, i: int) -> tuple[str, int] | None:
    """`s[i] == "{"`: the content up to the matching brace and the index after it (None if unbalanced)."""
    depth = 0
    for j in range(i, len(s)):
        if s[j] == "{":
            depth += 1
        elif s[j] == "}":
            depth -= 1
            if depth == 0:
                return s[i + 1 : j], j + 1
    return None


def _boxed(text: str) -> str | None:
    """Content of the last well-formed `\\boxed{...}` (nested braces ok) or `\\boxed N`."""
    for m in reversed(list(re.finditer(r"\\boxed", text))):
        rest = m.end()
        if rest < len(text) and text[rest] == "{":
            got = _braced(text, rest)
            if got is not None:
                return got[0].strip()
        else:
            tok = re.match(r"\s+([^\s$]+)", text[rest:])
            if tok:
                return tok.group(1).rstrip(".")
    return None


# A leading minus only when it is not a binary operator ("5-3" -> "3", not "-3").
_NUMBER = re.compile(r"(?:(?<![\w)])-)?(?:(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:/\d+)?|\.\d+)")


def extract_answer(text: str) -> str | None:
    """The final answer in `text`: last `\\boxed{}`, else GSM8K `#### N`, else the last number."""
    boxed = _boxed(text)
    if boxed:
        return boxed
    hashes = re.findall(r"####\s*([^\n]+)", text)
    if hashes and hashes[-1].strip():
        return hashes[-1].strip()
    numbers = _NUMBER.findall(text)
    return numbers[-1] if numbers else None


# ----------------------------------------------------------------------------------------------
# Normalisation and numeric comparison


_FRAC = re.compile(r"\\[dt]?frac")


def _replace_frac(s: str) -> str:
    """`\\frac{a}{b}` (also `\\dfrac`, `\\tfrac`, `\\frac12`) -> `a/b` for plain tokens, else `(a)/(b)`."""
    out, i = [], 0
    while True:
        m = _FRAC.search(s, i)
        if m is None:
            return "".join(out) + s[i:]
        out.append(s[i : m.start()])
        j, parts = m.end(), []
        for _ in range(2):
            if j < len(s) and s[j] == "{":
                got = _braced(s, j)
                if got is None:
                    return "".join(out) + s[m.start() :]
                parts.append(got[0])
                j = got[1]
            elif j < len(s):  # \frac12: single-character arguments
                parts.append(s[j])
                j += 1
        if len(parts) != 2:
            return "".join(out) + s[m.start() :]
        parts = [_replace_frac(p) for p in parts]
        plain = all(re.fullmatch(r"-?[\w.]+", p) for p in parts)
        out.append(f"{parts[0]}/{parts[1]}" if plain else f"({parts[0]})/({parts[1]})")
        i = j


def _replace_text(s: str) -> str:
    """`\\text{abc}` (also `\\textbf`, `\\mbox`) -> `abc`."""
    while (m := re.search(r"\\(?:text\w*|mbox)\{", s)) is not None:
        got = _braced(s, m.end() - 1)
        if got is None:
            break
        s = s[: m.start()] + got[0] + s[got[1] :]
    return s


def normalize(s: str) -> str:
    s = _replace_text(s)
    s = re.sub(r"\s+", "", s)
    s = s.replace("\u2212", "-").replace("$", "").replace("\\%", "").replace("%", "")
    s = re.sub(r"\\left|\\right|\\[,!;:]", "", s)
    s = re.sub(r"(?<=\d),(?=\d{3}(?!\d))", "", s)  # thousands separators only: "(1,2)" keeps its comma
    s = _replace_frac(s)
    s = s.rstrip(".")
    return s


def _as_number(s: str) -> Fraction | None:
    s = re.sub(r"\(([-\d./]+)\)", r"\1", s)  # "(1/3)", "(-1)/(2)"; "2/(1/2)" -> "2/1/2" is rejected below
    # Fraction() also accepts "nan", "inf" and "1e999999999" (slow to build): none is an answer.
    if not re.fullmatch(r"[-+]?[\d./]+(?:e[-+]?\d{1,3})?", s):
        return None
    try:
        return Fraction(s)
    except (ValueError, ZeroDivisionError):
        return None


def _numbers_equal(a: Fraction, b: Fraction) -> bool:
    if a == b:
        return True
    try:
        return math.isclose(float(a), float(b), rel_tol=1e-6)
    except OverflowError:  # beyond float range and not exactly equal
        return False


# ----------------------------------------------------------------------------------------------
# Symbolic comparison in a worker process

# parse_expr evaluates its input as Python, so only arithmetic characters and known function names
# reach it; model output must never be able to call `open` or `exit`.
_SAFE_CHARS = re.compile(r"[0-9a-zA-Z+\-*/^().]*")
_SAFE_NAMES = {"sqrt", "sin", "cos", "tan", "cot", "sec", "csc", "asin", "acos", "atan", "sinh", "cosh",
               "tanh", "log", "ln", "exp", "pi", "oo", "Abs", "abs"}  # fmt: skip


def _latex_to_sympy(s: str) -> str | None:
    """Normalised LaTeX -> sympy syntax, or None if it contains anything outside the safe subset."""
    s = re.sub(r"\\sqrt\{", "sqrt{", s)
    s = s.replace("\\cdot", "*").replace("\\times", "*").replace("\\infty", "oo")
    s = re.sub(r"\\([a-zA-Z]+)", r"\1", s).replace("{", "(").replace("}", ")")
    if not _SAFE_CHARS.fullmatch(s) or re.search(r"\.(?!\d)", s):
        return None
    if any(len(n) > 1 and n not in _SAFE_NAMES for n in re.findall(r"[a-zA-Z]+", s)):
        return None
    return s


def _die_with_parent(parent_pid: int) -> None:
    """Kernel SIGKILLs this process when its parent dies (Linux), even while sympy is stuck in C code."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
    except OSError:
        pass
    if os.getppid() != parent_pid:  # parent died before we asked
        os._exit(1)


def _worker_main(conn, parent_pid: int) -> None:
    """Worker loop: receive a JSON [a, b] pair, answer b"1" / b"0"; exit when the parent's end closes."""
    _die_with_parent(parent_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    from sympy import simplify
    from sympy.parsing.sympy_parser import (
        convert_xor,
        implicit_multiplication_application,
        parse_expr,
        standard_transformations,
    )

    transformations = standard_transformations + (implicit_multiplication_application, convert_xor)
    conn.send_bytes(b"ready")
    while True:
        try:
            a, b = json.loads(conn.recv_bytes())
        except EOFError:
            return
        try:
            diff = parse_expr(a, transformations=transformations) - parse_expr(b, transformations=transformations)
            ok = bool(simplify(diff) == 0)
        except Exception:  # parse errors, TypeError on non-expressions, MemoryError, RecursionError
            ok = False
        conn.send_bytes(b"1" if ok else b"0")


_STARTUP_TIMEOUT_S = 120.0  # first spawn imports sympy (and realcore.data's torch) in the child
_lock = threading.Lock()  # one request at a time on the shared pipe
_worker: dict | None = None  # {"proc", "conn", "owner_pid"}


def _stop_worker() -> None:
    global _worker
    w, _worker = _worker, None
    if w is None or w["owner_pid"] != os.getpid():  # a forked copy does not own the worker
        return
    w["proc"].kill()
    w["proc"].join(5)
    w["conn"].close()


def _get_worker() -> dict:
    global _worker
    if _worker is not None and (_worker["owner_pid"] != os.getpid() or not _worker["proc"].is_alive()):
        _stop_worker()  # forked copy, or the worker died (e.g. its creating thread exited: PDEATHSIG)
    if _worker is None:
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
        _worker = {"proc": proc, "conn": conn, "owner_pid": os.getpid()}
        try:
            ready = conn.poll(_STARTUP_TIMEOUT_S) and conn.recv_bytes() == b"ready"
        except (EOFError, OSError):  # the child crashed while importing
            ready = False
        if not ready:
            _stop_worker()
            raise RuntimeError(f"math_verify: the sympy worker failed to start within {_STARTUP_TIMEOUT_S:.0f} s")
    return _worker


def symbolic_equal(a: str, b: str, timeout_s: float = 2.0) -> bool:
    """sympy `simplify(a - b) == 0` in the worker; False on timeout (worker recreated) or any error."""
    with _lock:
        w = _get_worker()
        try:
            w["conn"].send_bytes(json.dumps([a, b]).encode())
            if w["conn"].poll(timeout_s):
                return w["conn"].recv_bytes() == b"1"
        except (EOFError, OSError):  # worker died mid-request (e.g. out of memory)
            pass
        _stop_worker()
        return False


# ----------------------------------------------------------------------------------------------
# Public comparison and reward


def math_equal(pred: str, gold: str, *, timeout_s: float = 2.0) -> bool:
    """Whether `pred` and `gold` denote the same value (numeric first, then symbolic with a time limit)."""
    try:
        a, b = normalize(pred), normalize(gold)
    except RecursionError:  # \frac nested hundreds deep
        return False
    if not a or not b:
        return False
    if a == b:
        return True
    na, nb = _as_number(a), _as_number(b)
    if na is not None and nb is not None:
        return _numbers_equal(na, nb)
    sa, sb = _latex_to_sympy(a), _latex_to_sympy(b)
    if sa is None or sb is None:
        return False
    return symbolic_equal(sa, sb, timeout_s)


@register_reward("math")
def math_reward(response: str, answer: str) -> float:
    """1.0 if the response's final answer equals the reference answer, else 0.0.

    The reference is a GSM8K solution ("... #### 72") or a MATH one (`\\boxed{}`), from which the final
    answer is extracted, or else the bare answer itself ("x+1" must not become "1")."""
    gold = extract_answer(answer) if ("####" in answer or "\\boxed" in answer) else answer.strip()
    pred = extract_answer(response)
    if pred is None or not gold:
        return 0.0
    return 1.0 if math_equal(pred, gold) else 0.0
