"""`realcore.Controller`: the RL loop in one Python file, over the same workers as the YAML graph.

    ctl = Controller()                    # python my_loop.py key=value ...
    for step in ctl.steps():
        batch = ctl.rollout()
        ctl.call("ref_inf", batch)
        ctl.call("actor_train", batch)

A script runs twice. Started by you, `Controller()` is the launcher: it composes and checks the
config from the command line (as `python -m realcore.launch` does, with `script=` this file), starts
every worker under the configured scheduler, and this file again as the run's master process, then
watches them (recover_mode=auto restarts the whole run, the script included) and exits with the
launcher's exit code: nothing after `Controller()` runs in the process you started. In the master
process, `Controller()` connects to the workers and returns the loop's verbs
(realcore.trainer.script_loop.ScriptLoop).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import runpy
import sys

from realcore.api.config import ExperimentConfig
from realcore.launch.process import PREEMPTED_EXIT
from realcore.trainer.master import Master, Preempted
from realcore.trainer.script_loop import Batch, LoopError, ScriptLoop

__all__ = ["Batch", "Controller", "LoopError"]


@dataclasses.dataclass
class _MasterProcess:
    """What run_worker hands the script it runs as the master."""

    cfg: ExperimentConfig
    secret: bytes
    world: int
    controller: Controller | None = None


_master: _MasterProcess | None = None  # set in the master process of a script's run, before the script runs


class Controller(ScriptLoop):
    def __init__(self, experiment: str | None = None, argv: list[str] | None = None):
        """`experiment`: the experiment this script runs when its command line names none;
        `argv`: the overrides (default: the command line, sys.argv[1:])."""
        if _master is None:
            sys.exit(launch(experiment, sys.argv[1:] if argv is None else list(argv)))
        if _master.controller is not None:
            raise LoopError("Controller(): the script made one already; a run has one controller")
        super().__init__(Master(_master.cfg, _master.secret, _master.world))
        _master.controller = self


def launch(experiment: str | None, argv: list[str]) -> int:
    """The launcher's main with this script as the master's loop: its exit code."""
    from realcore.launch.launcher import main  # the master process never launches

    if any(a.split("=", 1)[0].lstrip("+") == "script" for a in argv):
        print("realcore: config error: script: set by running the file; do not give it", file=sys.stderr)
        return 2
    if experiment is not None and not any(a.startswith("experiment=") for a in argv):
        argv = [f"experiment={experiment}", *argv]
    if "--help" in argv or "-h" in argv:  # the keys' help: no run, no script
        return main(argv)
    return main([*argv, f"script={os.path.abspath(sys.argv[0])}"])


def run_script(cfg: ExperimentConfig, secret: bytes, world: int) -> int:
    """In the master process: run cfg.script as __main__; its Controller() is the master. The
    master's exit code (run_worker's): 0 the script ended, 75 preempted."""
    global _master
    _master = _MasterProcess(cfg, secret, world)
    sys.argv = [cfg.script]
    sys.path.insert(0, os.path.dirname(cfg.script))  # as `python FILE` has it: the script's own imports
    try:
        runpy.run_path(cfg.script, run_name="__main__")
    except Preempted as e:
        logging.warning("%s: a recover checkpoint holds the run; start it again to continue", e)
        return PREEMPTED_EXIT
    finally:
        if _master.controller is not None:
            _master.controller.master.shutdown()
    if _master.controller is None:
        logging.error("%s made no realcore.Controller: nothing ran", cfg.script)
        return 1
    return 0
