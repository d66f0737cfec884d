"""One launcher per output_dir: a file lock the launcher holds for its whole run.

The output_dir is the run's identity: its name-resolution keys live under a hash of it
(realcore/transport/keys.py), so runs with different output_dirs never clash, whatever their
experiment/trial, and only a second launch of the same output_dir has to be refused.

Why flock: taking it is atomic, so two launches a second apart cannot both pass (looking for the
pids that workers publish races: they publish seconds after the launch); and the kernel drops it
when its holder dies, kill -9 included, so a killed launcher never blocks the next launch of the
same command (recover_mode=resume or auto). The lock file holds who took it, for the message.

Holding the lock is not enough: under Slurm the job outlives a launcher that died (its id, kept in
OUTPUT_DIR/slurm/job_id, is asked about), and a folder can hold the records of a run that ended.
`claim_output` refuses both, one line each, before anything in output_dir is touched.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import time
from collections.abc import Callable, Iterator
from datetime import datetime, timezone
from typing import IO

from realcore.api.config import ExperimentConfig
from realcore.launch.config_loader import ConfigError
from realcore.transport.durable import fsync_dir
from realcore.launch.slurm import refuse_live_job

READ_HOLDER_S = 1.0  # the holder writes its name right after taking the lock
# What makes a folder another run's: a resume would continue from these, a fresh run would mix with them.
RECORDS = ("metrics.jsonl", "ledger.jsonl", "recover", "checkpoints")
PREVIOUS = "previous"  # OUTPUT_DIR/previous/DATE-TIME/: the records of runs started over


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


def claim_output(cfg: ExperimentConfig) -> None:
    """With the lock held, before anything is written: refuse (ConfigError, one line) a live Slurm
    job of this output_dir, and another run's records unless told to resume (recover_mode resume
    or auto) or to start over (start_over=true: they move aside, see move_aside)."""
    out = cfg.output_dir
    if cfg.scheduler == "slurm":
        refuse_live_job(out)
    found = previous_records(out)
    if not found:
        return
    if cfg.start_over:
        print(f"realcore: start_over: the previous run's records moved to {move_aside(out)}", flush=True)
    elif cfg.recover_mode == "disabled":
        raise ConfigError(f"output_dir {out} holds another run's records ({', '.join(found)}): recover_mode=resume "
                          f"continues that run, start_over=true moves them into {os.path.join(out, PREVIOUS)}/ and "
                          "starts again; or pick another output_dir")


def previous_records(out: str) -> list[str]:
    """Which of RECORDS `out` holds (a file, or a folder that is not empty)."""
    found = []
    for name in RECORDS:
        path = os.path.join(out, name)
        if os.path.isfile(path) or (os.path.isdir(path) and os.listdir(path)):
            found.append(name)
    return found


def move_aside(out: str) -> str:
    """Move everything in `out` but the lock and earlier runs' folders into a new
    `out/previous/DATE-TIME/` (UTC), on disk before the run writes: renames in one filesystem, so
    nothing is copied or lost, and the old `recover/` is no longer where a resume looks."""
    stamp = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H-%M-%SZ")
    dest, n = os.path.join(out, PREVIOUS, stamp), 1
    while os.path.exists(dest):  # two starts over in one second
        n += 1
        dest = os.path.join(out, PREVIOUS, f"{stamp}-{n}")
    os.makedirs(dest, mode=0o700)  # the old .secret and config.json go there too
    for name in sorted(os.listdir(out)):
        if name not in (".lock", PREVIOUS):
            os.rename(os.path.join(out, name), os.path.join(dest, name))
    for folder in (dest, os.path.dirname(dest), out):
        fsync_dir(folder)
    return dest
