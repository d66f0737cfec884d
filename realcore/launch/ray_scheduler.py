"""`scheduler=ray`: the same worker processes as the local scheduler, placed by Ray.

Each worker is a Ray task that runs `python -m realcore.system.run_worker ...` as a child process
(the child dies with its Ray worker: PDEATHSIG), so the worker code is identical under every
scheduler. Model workers of the training mesh share one placement group (one bundle per rank,
packed onto as few nodes as possible, as a model mesh wants); generation servers get another;
the master, manager and rollout workers are plain tasks.

The launcher waits for the tasks: the master's clean exit ends the run; any task failing ends
it at once (every task is cancelled, the placement groups removed) naming the worker; Ctrl-C
does the same with exit code 130. `ray` is an optional extra: `pip install -e ".[ray]"`.
"""

from __future__ import annotations

import os
import signal
import sys
import time

from realcore.api.alloc import AllocationMode
from realcore.api.config import ExperimentConfig


def worker_specs(cfg: ExperimentConfig, alloc: AllocationMode) -> list[tuple[str, str, int]]:
    """(name, type, index) of every worker process, the master last."""
    specs = [(f"model_worker/{i}", "model_worker", i) for i in range(alloc.train.world_size)]
    if alloc.gen is not None:
        if alloc.backend != "local":
            raise ValueError("scheduler=ray: only built-in generation servers (allocation_mode local.*) for now")
        specs += [(f"gen_server/{i}", "gen_server", i) for i in range(alloc.gen.dp)]
    if cfg.mode == "async":
        specs.append(("gserver_manager", "gserver_manager", 0))
        specs += [(f"rollout_worker/{i}", "rollout_worker", i) for i in range(cfg.rollout.n_workers)]
    specs.append(("master", "master", 0))
    return specs


def _run_worker(argv: list[str], env: dict, log_path: str | None) -> int:
    """Inside a Ray task: run one realcore worker as a child process; raise if it fails."""
    import subprocess

    from realcore.system.process import die_with_parent

    out = open(log_path, "ab") if log_path else None
    try:
        rc = subprocess.run(argv, env=env, stdout=out, stderr=subprocess.STDOUT if out else None,
                            preexec_fn=die_with_parent).returncode
    finally:
        if out:
            out.close()
    if rc != 0:
        raise RuntimeError(f"exited with code {rc}")
    return rc


def run_ray(cfg: ExperimentConfig, alloc: AllocationMode, config_path: str, secret_path: str, env: dict) -> int:
    """Exit codes like the local scheduler: 0 done, 1 a worker failed, 130 interrupted."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    r = cfg.ray
    ray.init(address=r.address, namespace=f"realcore-{cfg.experiment_name}-{cfg.trial_name}",
             include_dashboard=False, log_to_driver=False, ignore_reinit_error=True)
    gpu = 1 if r.gpus_per_worker else 0
    meshes = {"model_worker": alloc.train.world_size}
    if alloc.gen is not None:
        meshes["gen_server"] = alloc.gen.dp
    groups = {}
    for kind, n in meshes.items():
        bundle = {"CPU": r.cpus_per_worker, **({"GPU": gpu} if gpu else {})}
        groups[kind] = placement_group([dict(bundle) for _ in range(n)], strategy=r.placement_strategy)
    try:
        ready = [g.ready() for g in groups.values()]
        _, pending = ray.wait(ready, num_returns=len(ready), timeout=cfg.system.startup_timeout_s)
        if pending:
            print(f"realcore: Ray could not place the workers within {cfg.system.startup_timeout_s:g} s "
                  f"(need {meshes} x {r.cpus_per_worker} CPU); is the cluster big enough?", file=sys.stderr)
            return 1
        task = ray.remote(_run_worker)
        n_servers = alloc.gen.dp if alloc.gen is not None else 0
        common = ["--world", str(alloc.train.world_size), "--config", config_path, "--secret-file", secret_path,
                  "--n-servers", str(n_servers)]
        logs = os.path.join(cfg.output_dir, "logs")
        refs = {}
        for name, kind, index in worker_specs(cfg, alloc):
            argv = [r.python or sys.executable, "-m", "realcore.system.run_worker", "--type", kind, "--index", str(index), *common]
            options = {"num_cpus": r.cpus_per_worker, "max_retries": 0, "name": name}
            if kind in groups:
                options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                    placement_group=groups[kind], placement_group_bundle_index=index)
                if gpu:
                    options["num_gpus"] = gpu
            log = None if kind == "master" else os.path.join(logs, name.replace("/", "-") + ".log")
            refs[task.options(**options).remote(argv, env, log)] = name
        return _wait(refs, cfg)
    finally:
        for g in groups.values():
            remove_placement_group(g)
        ray.shutdown()


def _wait(refs: dict, cfg: ExperimentConfig) -> int:
    import ray

    interrupted: list[int] = []
    old = {s: signal.signal(s, lambda signum, frame: interrupted.append(signum)) for s in (signal.SIGINT, signal.SIGTERM)}
    pending = list(refs)
    try:
        while True:
            if interrupted:
                print(f"realcore: {signal.Signals(interrupted[0]).name}: cancelling the Ray tasks", file=sys.stderr)
                return _cancel(pending, 130)
            done, pending = ray.wait(pending, num_returns=1, timeout=0.5)
            for ref in done:
                name = refs[ref]
                try:
                    ray.get(ref)
                except Exception as e:  # the worker failed or its Ray worker/node died
                    why = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
                    print(f"realcore: {name} died ({why}); cancelling the Ray tasks", file=sys.stderr)
                    log = os.path.join(cfg.output_dir, "logs", name.replace("/", "-") + ".log")
                    if os.path.exists(log):
                        from realcore.launch.local import tail

                        print(f"realcore: last lines of {log}:\n{tail(log)}", file=sys.stderr)
                    return _cancel(pending, 1)
                if name == "master":
                    return _cancel(pending, 0, grace_s=cfg.system.shutdown_timeout_s)
            if not pending:
                return 1  # everything ended without the master finishing: cannot happen cleanly
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def _cancel(refs: list, rc: int, grace_s: float = 0.0) -> int:
    """Let the workers leave on their own for `grace_s` (after the master asked them to), then
    force-cancel what is left; returns rc."""
    import ray

    deadline = time.monotonic() + grace_s
    while refs and time.monotonic() < deadline:
        _, refs = ray.wait(refs, num_returns=len(refs), timeout=max(0.0, deadline - time.monotonic()))
    for ref in refs:
        ray.cancel(ref, force=True)
    return rc
