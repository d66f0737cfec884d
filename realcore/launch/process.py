"""Per-process set-up shared by every realcore worker: threads, parent-death signal, name, SIGTERM."""

from __future__ import annotations

import atexit
import ctypes
import faulthandler
import gc
import os
import signal
import socket
import sys
import threading
import time

import psutil

_PR_SET_NAME = 15
_PR_SET_PDEATHSIG = 1
# The master (and then the launcher) exits with this after a preemption (SIGTERM) once a recover
# checkpoint holds the run: sysexits' EX_TEMPFAIL, "try again later".
PREEMPTED_EXIT = 75


def _prctl(option: int, arg) -> None:
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(option, arg, 0, 0, 0)
    except OSError:  # not Linux: nothing to do
        pass


def die_with_parent() -> None:
    """The kernel sends SIGKILL to this process when its parent dies (Linux); safe in preexec_fn."""
    _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


_forking_pid: int | None = None


def _note_forking_pid() -> None:
    global _forking_pid
    _forking_pid = os.getpid()


def _die_with_forking_parent() -> None:
    die_with_parent()
    if os.getppid() != _forking_pid:  # the parent died between the fork and the prctl
        os._exit(1)


def forks_die_with_parent() -> None:
    """Every child this process forks later (os.fork, multiprocessing's fork context) gets the
    parent-death signal too. Libraries fork helpers of their own: megatron-core's checkpoint writer
    forks one per bucket, and a worker SIGKILLed during a save left such a child behind for good."""
    os.register_at_fork(before=_note_forking_pid, after_in_child=_die_with_forking_parent)


def run_and_exit(main) -> None:
    """`sys.exit(main())` without the interpreter's teardown of every module: with torch and
    transformers loaded, that teardown took 1-3 s per process on two busy cores, at the end of
    every run (and of every test that runs one). What of the teardown matters still happens, in
    Python's order: non-daemon threads are joined, atexit handlers run (logging flushes its
    handlers), then one garbage collection runs the finalizers of what is unreachable, so an HTTP
    session or task left open still warns in the log. An exception other than SystemExit takes the
    usual way out (its traceback)."""
    try:
        code = main()
    except SystemExit as e:
        code = e.code
    # Python's own first step at exit: threading's exit hooks (concurrent.futures tells the idle
    # workers of an executor still referenced, e.g. an event loop's default one, to stop), then
    # the join of every non-daemon thread.
    threading._shutdown()
    atexit._run_exitfuncs()  # first, as Python does: exit_on_sigterm's handler then ignores a late SIGTERM
    gc.collect()
    if code is not None and not isinstance(code, int):  # as sys.exit("message") does
        print(code, file=sys.stderr)
        code = 1
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # closed, or its reader is gone
            pass
    os._exit(code or 0)


def set_title(name: str) -> None:
    _prctl(_PR_SET_NAME, ctypes.c_char_p(name.encode()[:15]))


def set_threads(n: int, *, torch_too: bool = True) -> None:
    """Pin torch/OpenMP threads: two threads per process are pathologically slow on these CPUs.
    `torch_too=False` (a process that computes nothing with torch: the master, the manager) sets
    only the variables, which torch reads if something imports it later, and saves importing it."""
    os.environ["OMP_NUM_THREADS"] = str(n)
    os.environ["MKL_NUM_THREADS"] = str(n)
    if not torch_too:
        return
    import torch  # only in a process that computes with torch (see torch_too)

    torch.set_num_threads(n)
    try:
        torch.set_num_interop_threads(n)
    except RuntimeError:  # already set once in this process
        pass


def exit_on_sigterm() -> None:
    """Turn SIGTERM into SystemExit so `finally` blocks and atexit handlers run."""

    exiting = threading.Event()

    def handler(signum, frame):
        if exiting.is_set():  # already on its way out: a SystemExit inside a finalizer is only a traceback
            return
        raise SystemExit(128 + signum)

    atexit.register(exiting.set)  # atexit runs last-registered first: before finalizers registered earlier
    signal.signal(signal.SIGTERM, handler)


def setup_worker_process(name: str, threads: int, *, ignore_sigterm: bool = False, torch_threads: bool = True) -> None:
    """`ignore_sigterm`: a task runner stops this process, not SIGTERM (Slurm sends SIGTERM to
    every process of a step, also on preemption, when the master must first write its checkpoint).
    `torch_threads`: see set_threads' `torch_too`."""
    die_with_parent()
    if os.getppid() == 1:  # the parent died before we asked to be told
        sys.exit(1)
    forks_die_with_parent()
    # A crash prints every thread's stack; `kill -USR1 PID` prints them on demand (a stalled run).
    faulthandler.enable()
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    set_title(name)
    set_threads(threads, torch_too=torch_threads)
    if ignore_sigterm:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    else:
        exit_on_sigterm()


def start_heartbeat(path: str, interval_s: float) -> None:
    """Touch `path` every interval from a daemon thread: the launcher reads its age to tell a hung
    process (stopped, or wedged with every thread stuck) from a busy one."""
    def beat() -> None:
        while True:
            try:
                with open(path, "a"):
                    os.utime(path)
            except OSError:  # the launcher clears the folder between attempts: try again next time
                pass
            time.sleep(interval_s)

    threading.Thread(target=beat, name="heartbeat", daemon=True).start()


def node_address(host: str, interface: str | None = None) -> str:
    """The address this process binds and publishes: `interface`'s IPv4 address if given (e.g. the
    InfiniBand or cluster network), this node's resolvable address for host 'auto', else `host`."""
    if interface:
        addrs = psutil.net_if_addrs()
        if interface not in addrs:
            raise ValueError(f"system.interface: no network interface {interface!r} here (have {sorted(addrs)})")
        for a in addrs[interface]:
            if a.family == socket.AF_INET:
                return a.address
        raise ValueError(f"system.interface: {interface!r} has no IPv4 address")
    if host == "auto":
        try:
            return socket.gethostbyname(socket.getfqdn())
        except OSError as e:  # the node's name does not resolve (no DNS entry, no /etc/hosts line)
            raise ValueError(f"system.host=auto: this node's name {socket.getfqdn()!r} does not resolve ({e}); "
                             "set system.host to an address or system.interface to a network interface") from None
    return host
