"""Local scheduler: every worker is a subprocess of the launcher on this machine.

Children get their own session (a terminal's Ctrl-C reaches only the launcher, which then stops
them in order) and SIGKILL when the launcher dies, so no process is ever left behind.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from realcore.backends.server_launch import copy_redacted
from realcore.launch.process import die_with_parent


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen
    log_path: str | None
    start: Callable[[], subprocess.Popen] | None = None  # starts it again (a restart in place)
    started: float = field(default_factory=time.monotonic)

    def restart(self) -> None:
        self.popen = self.start()
        self.started = time.monotonic()


def spawn(name: str, args: list[str], *, env: dict, log_path: str | None, stdin: bool = False) -> Proc:
    """Start `python -m realcore.launch.run_worker ARGS`; output to log_path (None: inherit)."""
    return spawn_command(name, [sys.executable, "-m", "realcore.launch.run_worker", *args], env=env, log_path=log_path,
                         stdin=stdin)


def spawn_command(name: str, argv: list[str], *, env: dict, log_path: str | None,
                  redact: tuple[str, ...] = (), stdin: bool = False) -> Proc:
    """Start any command (e.g. an SGLang server) under the same rules as realcore's workers.
    `redact`: strings (the run's token and secret) that must not reach the log: the output then
    goes through a pipe and `copy_redacted` (SGLang logs its api_key at start-up). `stdin`: it
    reads the launcher's (a script's master: a breakpoint's debugger); else none."""

    def start() -> subprocess.Popen:
        out = open_log(log_path) if log_path else None
        piped = out is not None and bool(redact)
        try:
            popen = subprocess.Popen(
                argv,
                env=env, stdout=subprocess.PIPE if piped else out, stderr=subprocess.STDOUT if out else None,
                stdin=None if stdin else subprocess.DEVNULL, start_new_session=True, preexec_fn=die_with_parent,
            )
        except BaseException:
            if out:
                out.close()
            raise
        if piped:  # the thread owns `out` now
            threading.Thread(target=copy_redacted, args=(popen.stdout, out, redact), name=f"log {name}",
                             daemon=True).start()
        elif out:
            out.close()
        return popen

    return Proc(name, start(), log_path, start)


def open_log(path: str):
    """`path` opened for appending, mode 0600 (also an existing file): logs may hold what a process
    printed of its arguments, and OUTPUT_DIR may be readable by others."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.fchmod(fd, 0o600)  # O_CREAT's mode applies to a new file only
    return os.fdopen(fd, "ab")


def private_logs_dir(path: str) -> None:
    """Create (or tighten) the logs folder: mode 0700, every file in it 0600."""
    os.makedirs(path, mode=0o700, exist_ok=True)
    os.chmod(path, 0o700)
    for entry in os.scandir(path):
        if entry.is_file(follow_symlinks=False):
            os.chmod(entry.path, 0o600)


def describe_exit(rc: int) -> str:
    if rc < 0:
        try:
            return f"killed by {signal.Signals(-rc).name}"
        except ValueError:
            return f"killed by signal {-rc}"
    return f"exit code {rc}"


def tail(path: str | None, n: int = 15) -> str:
    if not path or not os.path.exists(path):
        return ""
    with open(path, "rb") as f:
        f.seek(0, os.SEEK_END)
        f.seek(max(0, f.tell() - 8192))
        lines = f.read().decode(errors="replace").splitlines()[-n:]
    return "\n".join("    " + line for line in lines)


def dump_stacks_and_kill(p: Proc, wait_s: float = 2.0) -> None:
    """A hung worker: SIGUSR1 makes it write every thread's Python stack to its stderr
    (faulthandler); SIGCONT lets a stopped one run the handler; then SIGKILL, as soon as the
    stacks are in its log file (wait_s at most): a resumed worker must not go on working for long."""
    log = _stderr_file(p.popen.pid)
    start = os.path.getsize(log) if log else 0
    for sig in (signal.SIGUSR1, signal.SIGCONT):
        try:
            p.popen.send_signal(sig)
        except ProcessLookupError:
            return
    deadline = time.monotonic() + wait_s
    while p.popen.poll() is None and time.monotonic() < deadline:
        if log and _written_since(log, start, b"most recent call first"):
            time.sleep(0.05)  # the handler writes the whole dump at once; the rest of it lands
            break
        time.sleep(0.01)
    if p.popen.poll() is None:
        p.popen.kill()
    p.popen.wait()


def _stderr_file(pid: int) -> str | None:
    """The regular file a process's stderr goes to (its log, also under a Slurm task), else None."""
    try:
        path = os.readlink(f"/proc/{pid}/fd/2")
        return path if os.path.isfile(path) else None
    except OSError:
        return None


def _written_since(path: str, offset: int, needle: bytes) -> bool:
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            return needle in f.read(1 << 20)
    except OSError:
        return False


def stop_all(procs: list[Proc], grace_s: float) -> None:
    """SIGTERM every live process, wait up to grace_s, then SIGKILL; reap all."""
    for p in procs:
        if p.popen.poll() is None:
            try:
                p.popen.send_signal(signal.SIGTERM)
            except ProcessLookupError:
                pass
    deadline = time.monotonic() + grace_s
    for p in procs:
        try:
            p.popen.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.popen.kill()
            p.popen.wait()
