"""One launcher per output_dir and per experiment/trial: file locks the launcher holds for its whole run.

Why flock: taking it is atomic, so two launches a second apart cannot both pass (looking for the
pids that workers publish races: they publish seconds after the launch); and the kernel drops it
when its holder dies, kill -9 included, so a killed launcher never blocks the next launch of the
same command (recover_mode=resume or auto). The lock files hold who took them, for the message.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import socket
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import IO

from realcore.api.config import ExperimentConfig
from realcore.launch.config_loader import ConfigError

READ_HOLDER_S = 1.0  # the holder writes its name right after taking the lock


@contextlib.contextmanager
def hold_run(cfg: ExperimentConfig) -> Iterator[None]:
    """Create output_dir (the check that it is writable) and hold its lock and the trial's; ConfigError
    (one line: who holds it) if another launcher does."""
    out = os.path.abspath(cfg.output_dir)
    try:
        os.makedirs(out, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"output_dir: cannot create {out}: {e.strerror or e}") from None
    owner = {"pid": os.getpid(), "host": socket.gethostname(), "experiment": cfg.experiment_name,
             "trial": cfg.trial_name, "output_dir": out}
    with contextlib.ExitStack() as held:
        held.enter_context(_locked(
            os.path.join(out, ".lock"), owner, "output_dir",
            lambda h: f"output_dir {out} is in use by pid {_pid(h)} (trial {h.get('experiment', '?')}/"
                      f"{h.get('trial', '?')}); wait for it, stop it, or pick another output_dir"))
        held.enter_context(_locked(
            trial_lock_path(cfg), owner, "trial lock",
            lambda h: f"trial_name: {cfg.experiment_name}/{cfg.trial_name} is already running here (pid "
                      f"{_pid(h)}, output_dir {h.get('output_dir', '?')}); stop it or pick another trial_name"))
        yield


def trial_lock_path(cfg: ExperimentConfig) -> str:
    """A per-user lock file on this host for the run's name-resolution scope (experiment/trial in
    one name-resolution store): two runs with the same scope would clear each other's keys."""
    nr = cfg.system.name_resolve
    store = os.path.abspath(nr.root) if nr.type == "fs" else f"{nr.address}/{nr.namespace}"
    digest = hashlib.sha256("\0".join((nr.type, store, cfg.experiment_name, cfg.trial_name)).encode()).hexdigest()[:16]
    return os.path.join(tempfile.gettempdir(), f"realcore-{os.getuid()}", "trials",
                        f"{cfg.experiment_name}.{cfg.trial_name}.{digest}.lock")


@contextlib.contextmanager
def _locked(path: str, owner: dict, what: str, in_use: Callable[[dict], str]) -> Iterator[None]:
    f = _open(path, what)
    try:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise ConfigError(in_use(_holder(f))) from None
        f.truncate(0)
        f.write(json.dumps(owner))
        f.flush()
        yield
    finally:
        f.close()  # releases the lock


def _open(path: str, what: str) -> IO[str]:
    try:
        os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
        # Not "w": truncating before the lock is taken would erase the holder's name.
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except OSError as e:
        raise ConfigError(f"{what}: cannot write {path}: {e.strerror or e}") from None
    return os.fdopen(fd, "r+")


def _pid(holder: dict) -> str:
    host = holder.get("host")
    where = f" on {host}" if host and host != socket.gethostname() else ""  # a shared output_dir
    return f"{holder.get('pid', '?')}{where}"


def _holder(f: IO[str]) -> dict:
    """Who holds the lock, as it wrote; {} if it has not yet (or the file is not ours)."""
    deadline = time.monotonic() + READ_HOLDER_S
    while True:
        f.seek(0)
        try:
            holder = json.loads(f.read())
            if isinstance(holder, dict):
                return holder
        except ValueError:
            pass
        if time.monotonic() > deadline:
            return {}
        time.sleep(0.05)
