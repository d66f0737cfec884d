"""One launcher per output_dir: a file lock the launcher holds for its whole run.

The output_dir is the run's identity: its name-resolution keys live under a hash of it
(realcore/system/keys.py), so runs with different output_dirs never clash, whatever their
experiment/trial, and only a second launch of the same output_dir has to be refused.

Why flock: taking it is atomic, so two launches a second apart cannot both pass (looking for the
pids that workers publish races: they publish seconds after the launch); and the kernel drops it
when its holder dies, kill -9 included, so a killed launcher never blocks the next launch of the
same command (recover_mode=resume or auto). The lock file holds who took it, for the message.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import time
from collections.abc import Callable, Iterator
from typing import IO

from realcore.api.config import ExperimentConfig
from realcore.launch.config_loader import ConfigError

READ_HOLDER_S = 1.0  # the holder writes its name right after taking the lock


@contextlib.contextmanager
def hold_run(cfg: ExperimentConfig) -> Iterator[None]:
    """Create output_dir (the check that it is writable) and hold its lock; ConfigError (one line:
    who holds it) if another launcher does."""
    out = os.path.abspath(cfg.output_dir)
    try:
        os.makedirs(out, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"output_dir: cannot create {out}: {e.strerror or e}") from None
    owner = {"pid": os.getpid(), "host": socket.gethostname(), "experiment": cfg.experiment_name,
             "trial": cfg.trial_name, "output_dir": out}
    with _locked(os.path.join(out, ".lock"), owner, "output_dir",
                 lambda h: f"output_dir {out} is in use by pid {_pid(h)} (trial {h.get('experiment', '?')}/"
                           f"{h.get('trial', '?')}); wait for it, stop it, or pick another output_dir"):
        yield


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
