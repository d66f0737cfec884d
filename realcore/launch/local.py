"""Local scheduler: every worker is a subprocess of the launcher on this machine.

Children get their own session (a terminal's Ctrl-C reaches only the launcher, which then stops
them in order) and SIGKILL when the launcher dies, so no process is ever left behind.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Callable

from realcore.system.process import die_with_parent


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


def spawn(name: str, args: list[str], *, env: dict, log_path: str | None) -> Proc:
    """Start `python -m realcore.system.run_worker ARGS`; output to log_path (None: inherit)."""
    return spawn_command(name, [sys.executable, "-m", "realcore.system.run_worker", *args], env=env, log_path=log_path)


def spawn_command(name: str, argv: list[str], *, env: dict, log_path: str | None) -> Proc:
    """Start any command (e.g. an SGLang server) under the same rules as realcore's workers."""

    def start() -> subprocess.Popen:
        out = open(log_path, "ab") if log_path else None
        try:
            return subprocess.Popen(
                argv,
                env=env, stdout=out, stderr=subprocess.STDOUT if out else None, stdin=subprocess.DEVNULL,
                start_new_session=True, preexec_fn=die_with_parent,
            )
        finally:
            if out:
                out.close()

    return Proc(name, start(), log_path, start)


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
    """A hung worker: SIGUSR1 makes it write every thread's Python stack to its log
    (faulthandler); SIGCONT lets a stopped one run the handler; then SIGKILL."""
    for sig in (signal.SIGUSR1, signal.SIGCONT):
        try:
            p.popen.send_signal(sig)
        except ProcessLookupError:
            return
    try:
        p.popen.wait(timeout=wait_s)
    except subprocess.TimeoutExpired:
        p.popen.kill()
        p.popen.wait()


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
