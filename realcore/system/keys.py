"""Name-resolution keys of a run's processes, in one place both sides import (no cycles)."""

from __future__ import annotations

from realcore.api.config import ExperimentConfig
from realcore.system.name_resolve import scoped_key

MANAGER = "gserver_manager"


def scope(cfg: ExperimentConfig) -> str:
    """Every key of the run lives under this; a whole-run (re)start clears it."""
    return scoped_key(cfg.experiment_name, cfg.trial_name)


def model_worker(cfg: ExperimentConfig, index: int) -> str:
    """JSON {control, data, pid[, stream]} of model worker `index`."""
    return scoped_key(cfg.experiment_name, cfg.trial_name, "model_worker", str(index))


def manager(cfg: ExperimentConfig) -> str:
    """JSON {control, pid} of the generation-server manager."""
    return scoped_key(cfg.experiment_name, cfg.trial_name, MANAGER)


def gen_server(cfg: ExperimentConfig, index: int) -> str:
    """JSON {http, weights} of generation server `index` (weights: its in-memory update socket or null)."""
    return scoped_key(cfg.experiment_name, cfg.trial_name, "gen_server", str(index))


def gen_servers(cfg: ExperimentConfig) -> str:
    """Prefix of every generation server's key (find() returns them all)."""
    return scoped_key(cfg.experiment_name, cfg.trial_name, "gen_server")


def dist_init(cfg: ExperimentConfig) -> str:
    """The torch.distributed rendezvous address of the training mesh."""
    return scoped_key(cfg.experiment_name, cfg.trial_name, "dist_init")
