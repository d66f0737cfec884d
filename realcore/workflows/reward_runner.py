"""Reward calls that can neither crash nor hang a run: the registered reward runs in child processes.

A user reward may raise, hang, or kill its process (os._exit, a segfault in C code). The runner keeps
`n_procs` spawned children that import the user's modules once and serve calls over a pipe; one
dispatcher thread in the parent owns them, hands calls to idle children, and enforces each call's
deadline: a raise is an "error" and the child keeps serving; an overrun kills the child and every
process it started, in its group or a session of its own (`_kill_tree`), and starts a replacement (the
same at close); a dead child is an "error" and is replaced. Callers only wait on futures, so `ascore` holds no executor thread.

The dispatcher thread also starts every child, because PR_SET_PDEATHSIG fires when the *thread* that
created the child exits: children started from a short-lived caller thread (e.g. `asyncio.to_thread`)
would be killed with it.
"""

from __future__ import annotations

import asyncio
import atexit
import collections
import concurrent.futures
import ctypes
import importlib
import inspect
import json
import logging
import math
import multiprocessing as mp
import os
import signal
import threading
import time
from dataclasses import dataclass
from multiprocessing.connection import wait

from realcore.api.registry import lookup

log = logging.getLogger("realcore.reward_runner")

_START_TIMEOUT_S = 120.0  # a child imports the built-in registrations and the user's modules (theirs may import torch)
_LOG_INTERVAL_S = 10.0  # at most one warning per failure kind per interval


@dataclass
class RewardCall:
    """The arguments of one reward call (AReaL's signature): `fn(prompt, completion, prompt_ids,
    completion_ids, **data)`; `data` holds the dataset row's JSON-able fields (`answer`, ...)."""

    prompt: str
    completion: str
    prompt_ids: list[int]
    completion_ids: list[int]
    data: dict


@dataclass
class RewardOutcome:
    reward: float  # 0.0 when the call failed
    error: str | None  # None, "error" (raised, bad value, child died) or "timeout"


def _one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:200]}" if text else type(e).__name__


# ----------------------------------------------------------------------------------------------
# Killing a child with everything it started


def _descendants(root: int) -> list[int]:
    """Live (not zombie) processes descended from `root`, from /proc."""
    children = collections.defaultdict(list)
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                stat = f.read()
        except OSError:  # gone meanwhile
            continue
        state, ppid = stat[stat.rindex(b")") + 2 :].split()[:2]  # the name, in parentheses, may hold spaces
        if state != b"Z":
            children[int(ppid)].append(int(name))
    found, todo = [], [root]
    while todo:
        kids = children.get(todo.pop(), [])
        found += kids
        todo += kids
    return found


def _kill_tree(root: int) -> None:
    """SIGKILL `root` and every process it started, those in a session of their own (setsid) too,
    which its process group does not hold. `root` is stopped first so it starts no more; as a child
    subreaper it adopts its descendants' orphans, so each look finds what the last kill left."""
    try:
        os.kill(root, signal.SIGSTOP)
    except ProcessLookupError:
        return
    for _ in range(100):  # each round kills what the previous round's victims forked meanwhile
        found = _descendants(root)
        if not found:
            break
        for pid in found:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    try:
        os.killpg(root, signal.SIGKILL)  # the child leads its group once it runs
    except (ProcessLookupError, PermissionError):
        pass


# ----------------------------------------------------------------------------------------------
# Child process


def _set_up_child(parent_pid: int) -> None:
    """Die with the parent (Linux PR_SET_PDEATHSIG), name the process, lead its own process group,
    and adopt its orphaned descendants (a child subreaper), so `_kill_tree` finds a double fork too."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
        libc.prctl(15, ctypes.c_char_p(b"realcore-reward"), 0, 0, 0)  # PR_SET_NAME
        libc.prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
    except OSError:  # not Linux
        pass
    if os.getppid() != parent_pid:  # the parent died before we asked
        os._exit(1)
    try:
        os.setpgid(0, 0)  # the parent's timeout kill takes the whole group: processes the reward started too
    except OSError:  # then only this process is killed
        pass
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle


def _check_value(value) -> float:
    # Anything with __float__ is a number (int, bool, numpy and 0-d torch scalars); a str is not.
    if getattr(type(value), "__float__", None) is None:
        raise TypeError(f"returned {type(value).__name__} {str(value)[:50]!r}, not a number")
    x = float(value)
    if not math.isfinite(x):
        raise ValueError(f"returned {x}, not a finite number")
    return x


def _child_main(conn, parent_pid: int, modules: list[str], reward_name: str) -> None:
    """Import the modules, find the reward, then answer JSON RewardCall requests
    [prompt, completion, prompt_ids, completion_ids, data] with [1, reward] or [0, "one-line error"]
    until the parent closes its end. An async reward runs to completion on the child's own loop."""
    _set_up_child(parent_pid)
    for m in modules:
        try:
            importlib.import_module(m)
        except BaseException as e:  # ImportError, SyntaxError, a SystemExit at import time
            conn.send_bytes(json.dumps(["fail", f"cannot import {m!r}: {_one_line(e)}"]).encode())
            return
    try:
        fn = lookup("reward", reward_name)
    except KeyError as e:
        conn.send_bytes(json.dumps(["fail", e.args[0]]).encode())
        return
    conn.send_bytes(b'["ready"]')
    loop = asyncio.new_event_loop()
    while True:
        try:
            prompt, completion, prompt_ids, completion_ids, data = json.loads(conn.recv_bytes())
        except EOFError:
            return
        try:
            value = fn(prompt, completion, prompt_ids, completion_ids, **data)
            if inspect.isawaitable(value):
                value = loop.run_until_complete(value)
            reply = [1, _check_value(value)]
        except BaseException as e:  # SystemExit too: the child keeps serving
            reply = [0, _one_line(e)]
        conn.send_bytes(json.dumps(reply).encode())


# ----------------------------------------------------------------------------------------------
# Parent side


class _RateLimitedLog:
    """One WARNING per failure kind ("errors", "timeouts", "child deaths") per interval; the next one
    counts those left out, so a storm of one kind neither floods the log nor hides another kind."""

    def __init__(self, interval_s: float = _LOG_INTERVAL_S):
        self.interval_s = interval_s
        self.last: dict[str, float] = {}
        self.skipped: collections.Counter = collections.Counter()

    def warn(self, kind: str, msg: str) -> None:
        now = time.monotonic()
        if now - self.last.get(kind, -math.inf) < self.interval_s:
            self.skipped[kind] += 1
            return
        more = f" ({self.skipped[kind]} more {kind} since the last report)" if self.skipped[kind] else ""
        log.warning("%s%s", msg, more)
        self.last[kind], self.skipped[kind] = now, 0


class _Child:
    def __init__(self, ctx, parent_pid: int, modules: list[str], reward_name: str):
        self.conn, child_conn = ctx.Pipe()
        self.proc = ctx.Process(target=_child_main, args=(child_conn, parent_pid, modules, reward_name),
                                name="realcore-reward")  # fmt: skip
        self.proc.start()
        child_conn.close()  # so the child's death reads as EOF here
        self.ready = False
        self.deadline = time.monotonic() + _START_TIMEOUT_S  # start-up, then each call's
        self.call: concurrent.futures.Future | None = None  # the call it is running
        self.killed = False

    def kill(self) -> None:
        if self.killed:  # once: after the join its pid may be reused
            return
        self.killed = True
        _kill_tree(self.proc.pid)
        self.proc.kill()  # in case it had not reached setpgid yet
        self.proc.join(5)
        self.conn.close()


class RewardRunner:
    """Runs the registered reward `reward_name` in `n_procs` spawned children that import `modules`;
    every call is bounded by `timeout_s`. Calls beyond the free children wait in a queue."""

    def __init__(self, reward_name: str, modules: list[str], *, timeout_s: float, n_procs: int = 1):
        if timeout_s <= 0 or n_procs < 1:
            raise ValueError(f"RewardRunner: need timeout_s > 0 and n_procs >= 1, got {timeout_s}, {n_procs}")
        self.reward_name, self.modules = reward_name, list(modules)
        self.timeout_s, self.n_procs = timeout_s, n_procs
        self._ctx = mp.get_context("spawn")  # never fork: the parent holds torch and ZeroMQ threads
        self._owner_pid = os.getpid()
        self._queue: collections.deque = collections.deque()  # (future, (response, answer)) calls
        self._lock = threading.Lock()  # a call is queued only while the dispatcher still runs
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)
        self._children: list[_Child] = []
        self._stopping = False
        self._failure: str | None = None  # set once the runner can no longer serve
        self._started = threading.Event()
        self._log = _RateLimitedLog()
        self._thread = threading.Thread(target=self._run, name="realcore-reward-runner", daemon=True)
        self._thread.start()
        if not self._started.wait(_START_TIMEOUT_S + 10) and self._failure is None:
            self._failure = f"children not ready within {_START_TIMEOUT_S:.0f} s"
        if self._failure is not None:
            failure = self._failure
            self.close()
            raise ValueError(f"RewardRunner({reward_name!r}): {failure}")
        # After the children started: atexit is LIFO, and multiprocessing's own exit hook would wait
        # forever for non-daemon children (they are not daemons, so a reward may start processes).
        atexit.register(self.close)

    @property
    def pids(self) -> list[int]:
        """The current children's pids (for monitoring and tests)."""
        return [c.proc.pid for c in list(self._children)]

    # -- calls -------------------------------------------------------------------------------

    def _submit(self, items: list[RewardCall]) -> list[concurrent.futures.Future]:
        if os.getpid() != self._owner_pid:
            raise RuntimeError("RewardRunner: used in a forked copy of its process; create one per process")
        futs = [concurrent.futures.Future() for _ in items]
        with self._lock:
            if self._failure is not None:
                raise RuntimeError(f"RewardRunner({self.reward_name!r}): {self._failure}")
            self._queue.extend(zip(futs, items))
            self._wake()
        return futs

    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"x")
        except BlockingIOError:  # pipe full: the dispatcher will wake anyway
            pass

    def score(self, items: list[RewardCall]) -> list[RewardOutcome]:
        """Score calls, spread over the children; returns in order."""
        return [f.result() for f in self._submit(items)]

    async def ascore(self, call: RewardCall) -> RewardOutcome:
        """Score one call; no thread waits for it. Cancelling before a child takes it drops the call."""
        (fut,) = self._submit([call])
        return await asyncio.wrap_future(fut)

    def close(self) -> None:
        """Stop the dispatcher and kill every child; calls still queued raise RuntimeError."""
        if os.getpid() != self._owner_pid or self._stopping:
            return
        self._stopping = True
        atexit.unregister(self.close)
        with self._lock:
            self._wake()
        self._thread.join(30)
        if not self._thread.is_alive():  # else leak two fds rather than close them under the dispatcher
            os.close(self._wake_r)
            os.close(self._wake_w)

    # -- dispatcher thread -------------------------------------------------------------------

    def _spawn(self) -> None:
        self._children.append(_Child(self._ctx, self._owner_pid, self.modules, self.reward_name))

    def _run(self) -> None:
        try:
            for _ in range(self.n_procs):
                self._spawn()
            while not self._stopping and self._failure is None:
                self._step()
        except Exception as e:  # a bug here must not leave callers waiting forever
            log.exception("reward runner dispatcher failed")
            self._failure = f"dispatcher failed: {_one_line(e)}"
        finally:
            with self._lock:
                if self._failure is not None and self._started.is_set():  # broke after start-up
                    log.error("reward runner for %r stopped: %s", self.reward_name, self._failure)
                self._failure = self._failure or "closed"
            for c in self._children:
                c.kill()
                if c.call is not None:
                    c.call.set_exception(RuntimeError(f"RewardRunner({self.reward_name!r}): {self._failure}"))
            self._children = []
            while self._queue:
                fut, _ = self._queue.popleft()
                if fut.set_running_or_notify_cancel():
                    fut.set_exception(RuntimeError(f"RewardRunner({self.reward_name!r}): {self._failure}"))
            self._started.set()  # the constructor may still be waiting

    def _step(self) -> None:
        """Hand queued calls to idle children, wait for a reply, a death or a deadline, handle it."""
        for c in self._children:
            if c.ready and c.call is None:
                self._dispatch(c)
        deadlines = [c.deadline for c in self._children if not c.ready or c.call]
        timeout = max(0.0, min(deadlines) - time.monotonic()) if deadlines else None
        waitables = [self._wake_r] + [c.conn for c in self._children] + [c.proc.sentinel for c in self._children]
        ready = set(wait(waitables, timeout))
        if self._wake_r in ready:
            os.read(self._wake_r, 4096)
        for c in list(self._children):
            if c.conn in ready or c.proc.sentinel in ready:
                self._on_readable(c)
            elif time.monotonic() >= c.deadline and (not c.ready or c.call):
                self._on_deadline(c)

    def _dispatch(self, c: _Child) -> None:
        while self._queue:
            fut, item = self._queue.popleft()
            if not fut.set_running_or_notify_cancel():  # cancelled while queued
                continue
            c.call, c.deadline = fut, time.monotonic() + self.timeout_s
            try:
                c.conn.send_bytes(json.dumps([item.prompt, item.completion, item.prompt_ids, item.completion_ids, item.data]).encode())
            except OSError:  # died while idle; the sentinel reports it next
                pass
            return

    def _on_readable(self, c: _Child) -> None:
        try:
            msg = json.loads(c.conn.recv_bytes()) if c.conn.poll() else None
        except (EOFError, OSError):
            msg = None
        if msg is None:  # the child died
            c.kill()
            why = f"exited with code {c.proc.exitcode}"
            if not c.ready:
                self._failure = f"a child {why} during start-up"
                return
            where = "mid-call" if c.call is not None else "while idle"
            self._log.warn("child deaths", f"reward {self.reward_name!r}: child {c.proc.pid} {why} {where}; replaced")
            if c.call is not None:
                c.call.set_result(RewardOutcome(0.0, "error"))
            self._replace(c)
        elif not c.ready:
            if msg[0] == "fail":
                self._failure = msg[1]
                return
            c.ready = True
            if all(x.ready for x in self._children):
                self._started.set()
        else:
            assert c.call is not None, "a reply without a call"
            ok, value = msg
            fut, c.call = c.call, None
            if ok:
                fut.set_result(RewardOutcome(value, None))
            else:
                self._log.warn("errors", f"reward {self.reward_name!r} failed: {value}")
                fut.set_result(RewardOutcome(0.0, "error"))

    def _on_deadline(self, c: _Child) -> None:
        c.kill()  # before answering, so nothing is running the call once the caller hears "timeout"
        if not c.ready:
            self._failure = f"a child was not ready within {_START_TIMEOUT_S:.0f} s"
            return
        self._log.warn("timeouts", f"reward {self.reward_name!r} exceeded {self.timeout_s} s; "
                                  f"child {c.proc.pid} killed and replaced")  # fmt: skip
        c.call.set_result(RewardOutcome(0.0, "timeout"))
        self._replace(c)

    def _replace(self, c: _Child) -> None:
        self._children.remove(c)
        self._spawn()


def reward_modules(cfg) -> list[str]:
    """What a reward process imports to find registered rewards: ours and the user's."""
    return ["realcore.data", "realcore.mfc", "realcore.workflows", *cfg.imports]


def reward_runner_for(cfg) -> RewardRunner:
    """The run's reward runner (`reward:` section): the one way every caller builds it."""
    r = cfg.reward
    return RewardRunner(r.type, reward_modules(cfg), timeout_s=r.timeout_s, n_procs=r.n_procs)
