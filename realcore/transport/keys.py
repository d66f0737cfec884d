"""Name-resolution keys of a run's processes, in one place both sides import (no cycles).

A run's keys live under experiment/trial/RUN, RUN a short hash of its absolute output_dir: two runs
of one experiment/trial with different output_dirs (both `trial0` by default) never see or clear
each other's keys, while a run started again in its output_dir (a restart, recover_mode=resume)
finds its own scope. Two launches of one output_dir are refused by its lock (launch/run_lock.py).
"""

from __future__ import annotations

import hashlib
import os

from realcore.api.config import ExperimentConfig
from realcore.transport.name_resolve import scoped_key

MANAGER = "gserver_manager"


def run_id(cfg: ExperimentConfig) -> str:
    """'run-' + 12 hex digits of sha256(absolute output_dir). The path as written, not resolved:
    every process of the run, on any node, reads the same string from the run's config."""
    return "run-" + hashlib.sha256(os.path.abspath(cfg.output_dir).encode()).hexdigest()[:12]


def _key(cfg: ExperimentConfig, *parts: str) -> str:
    return scoped_key(cfg.experiment_name, cfg.trial_name, run_id(cfg), *parts)


def scope(cfg: ExperimentConfig) -> str:
    """Every key of the run lives under this; a whole-run (re)start clears it."""
    return _key(cfg)


def model_worker(cfg: ExperimentConfig, index: int) -> str:
    """Model worker `index`'s address (addresses.ModelWorkerAddress)."""
    return _key(cfg, "model_worker", str(index))


def manager(cfg: ExperimentConfig) -> str:
    """The generation-server manager's address (addresses.ManagerAddress)."""
    return _key(cfg, MANAGER)


def gen_server(cfg: ExperimentConfig, index: int) -> str:
    """Generation server `index`'s address (addresses.GenServerAddress)."""
    return _key(cfg, "gen_server", str(index))


def gen_servers(cfg: ExperimentConfig) -> str:
    """Prefix of every generation server's key (find() returns them all)."""
    return _key(cfg, "gen_server")


def dist_init(cfg: ExperimentConfig) -> str:
    """The torch.distributed rendezvous address of the training mesh."""
    return _key(cfg, "dist_init")
