"""`scheduler=ray`: the same worker processes as the local scheduler, placed by Ray.

Each worker is a Ray task that runs `python -m realcore.launch.run_worker ...` as a child process
(the child dies with its Ray worker: PDEATHSIG) under the task runner of realcore/launch/cluster.py,
so the worker code is identical under every scheduler. The runner watches the child's heartbeat
file next to it: a hung worker gets its stacks dumped into its log (SIGUSR1, SIGCONT) and is
killed, and the task ends saying so (the launcher need not reach a process on another node).
Model workers of the training mesh share one placement group (one bundle per rank, packed onto
as few nodes as possible, as a model mesh wants); generation servers get another; the master,
manager and rollout workers are plain tasks. The master's output goes to OUTPUT_DIR/logs/master.out,
which the launcher copies to the console. A task's arguments (the workers' environment among them)
are stored by Ray and visible to whoever reaches the cluster: only what the workers need goes
(`task_env`), never a variable that looks like a credential.

The launcher waits for the tasks:
- the master's clean exit ends the run (0): every other task is cancelled without force, and its
  runner stops its worker as the local launcher does (SIGTERM, SIGKILL past
  `system.shutdown_timeout_s`);
- a rollout-side task (generation server, gserver manager, rollout worker) that dies or hangs is
  submitted again with the same arguments (same type, index and --attempt) while training goes on,
  unless recover_mode=disabled; each restart goes into OUTPUT_DIR/restarts.jsonl; one that keeps
  dying within a minute of its start, more than recover_retries times, fails the run;
- a master or model worker failing fails the run: every task is cancelled; with recover_mode=auto
  all of them start again (scope, `.heartbeat`, `.manager` cleared, `--attempt` + 1) and the run
  resumes from its last recover checkpoint, up to recover_retries times; then exit 1 naming the
  worker;
- SIGTERM to the launcher is a preemption, as with the local scheduler: it creates
  OUTPUT_DIR/.preempt, the master's task runner sees it and sends the master SIGUSR2 (finish the
  step, write a recover checkpoint, exit 75), the launcher exits 75 (past
  `system.preempt_timeout_s` it cancels everything, still 75); Ctrl-C, or a second SIGTERM,
  cancels every task at once (130).
`ray` is an optional extra: `pip install -e ".[ray]"`.
"""

from __future__ import annotations

import os
import re
import signal
import sys
import time

from realcore.api.alloc import AllocationMode
from realcore.api.config import ExperimentConfig
from realcore.launch.cluster import Follow, run_task
from realcore.launch.config_loader import ConfigError
from realcore.launch.local import tail
from realcore.launch.placement import check_nccl, gpus_per_server
from realcore.launch.process import PREEMPTED_EXIT
from realcore.launch.supervise import (ROLLOUT_SIDE, STABLE_S, begin_attempt, count_quick_death, heartbeat_path, hung,
                                       record)
from realcore.transport.name_resolve import make_name_resolver


def worker_specs(cfg: ExperimentConfig, alloc: AllocationMode) -> list[tuple[str, str, int]]:
    """(name, type, index) of every worker process, the master last."""
    specs = [(f"model_worker/{i}", "model_worker", i) for i in range(alloc.world_size)]
    if alloc.gen is not None:
        specs += [(f"gen_server/{i}", "gen_server", i) for i in range(alloc.gen.dp)]
    if cfg.mode == "async":
        specs.append(("gserver_manager", "gserver_manager", 0))
        specs += [(f"rollout_worker/{i}", "rollout_worker", i) for i in range(cfg.rollout.n_workers)]
    specs.append(("master", "master", 0))
    return specs


def mesh_bundles(cfg: ExperimentConfig, alloc: AllocationMode,
                 gpus_per_worker: int | None = None) -> dict[str, tuple[int, dict]]:
    """kind -> (tasks, resources of each) of the two meshes that get a placement group: model workers
    (one rank, `gpus_per_worker` GPUs each; None: ray.gpus_per_worker, unset counting as 0) and
    generation servers (a built-in server is one rank, on no GPU with generation.device=cpu; an
    SGLang/vLLM server spans tp*pp GPUs, its own TP/PP workers)."""
    r = cfg.ray
    per_worker = (r.gpus_per_worker or 0) if gpus_per_worker is None else gpus_per_worker
    meshes = {"model_worker": (alloc.world_size, per_worker)}
    if alloc.gen is not None:
        meshes["gen_server"] = (alloc.gen.dp, per_worker * gpus_per_server(cfg, alloc))
    return {kind: (n, {"CPU": r.cpus_per_worker, **({"GPU": g} if g else {})}) for kind, (n, g) in meshes.items()}


def cluster_gpus_per_worker(cfg: ExperimentConfig, cluster_resources: dict) -> int:
    """ray.gpus_per_worker, or when it is None: 1 when the Ray cluster has GPUs, else 0."""
    if cfg.ray.gpus_per_worker is not None:
        return cfg.ray.gpus_per_worker
    return 1 if cluster_resources.get("GPU", 0) > 0 else 0


def describe_bundles(cfg: ExperimentConfig, alloc: AllocationMode) -> str:
    """What `--dry-run` prints under scheduler=ray: each placement group's bundles, the plain tasks."""
    lines = [f"realcore: Ray placement of {cfg.allocation_mode} (dry run: no ray.init, nothing submitted):"]
    unknown = cfg.ray.gpus_per_worker is None
    for per_worker in ((0, 1) if unknown else (cfg.ray.gpus_per_worker,)):
        if unknown:
            lines.append(f"  ray.gpus_per_worker=None, decided at ray.init: if the cluster has "
                         f"{'GPUs' if per_worker else 'no GPU'}:")
        for kind, (n, bundle) in mesh_bundles(cfg, alloc, per_worker).items():
            lines.append(f"  {'  ' if unknown else ''}{kind}: a placement group of {n} bundle(s) {bundle} "
                         f"({cfg.ray.placement_strategy})")
    plain = [name for name, kind, _ in worker_specs(cfg, alloc) if kind not in ("model_worker", "gen_server")]
    lines.append(f"  plain tasks of {{'CPU': {cfg.ray.cpus_per_worker}}}, no GPU: {', '.join(plain)}")
    return "\n".join(lines)


def check_ray_gpus(cfg: ExperimentConfig, alloc: AllocationMode, gpus_per_worker: int) -> None:
    """The nccl refusals (placement.check_nccl) for Ray's placement of the meshes."""
    meshes = mesh_bundles(cfg, alloc, gpus_per_worker)
    check_nccl(cfg, alloc, trainer_on_gpu="GPU" in meshes["model_worker"][1],
               servers_on_gpu="GPU" in meshes.get("gen_server", (0, {}))[1])


def preempt_path(cfg: ExperimentConfig) -> str:
    """The launcher's SIGTERM as a file: the master's task runner sees it and preempts the master."""
    return os.path.join(cfg.output_dir, ".preempt")


# The variables a worker and its engine need; anything else of the launcher's environment stays here.
_TASK_ENV_PREFIXES = ("REALCORE_", "PYTHON", "OMP_", "MKL_", "KMP_", "TORCH", "NCCL_", "GLOO_", "CUDA_", "NVIDIA_",
                      "HF_", "TRANSFORMERS_", "TOKENIZERS_", "VLLM_", "SGLANG_", "TRITON_", "WANDB_", "LC_", "CONDA_")
_TASK_ENV_NAMES = {"PATH", "LD_LIBRARY_PATH", "HOME", "USER", "LOGNAME", "LANG", "TMPDIR", "TZ", "VIRTUAL_ENV"}
# HF_TOKEN, WANDB_API_KEY, REALCORE_SERVER_TOKEN, AWS_SECRET_ACCESS_KEY...: the nodes log in on their own.
_CREDENTIAL = re.compile(r"(^|_)(TOKEN|KEY|SECRET|PASSWORD|PASSWD|CREDENTIALS?|AUTH)(_|$)")


def task_env(env: dict) -> dict:
    """The part of the launcher's environment `env` that goes with every task (see the docstring)."""
    return {k: v for k, v in env.items()
            if (k in _TASK_ENV_NAMES or k.startswith(_TASK_ENV_PREFIXES)) and not _CREDENTIAL.search(k)}


def _run_worker(cfg: ExperimentConfig, argv: list[str], env: dict, log_path: str, name: str,
                attempt: int) -> tuple[int, str]:
    """Inside a Ray task: run one realcore worker under the task runner; (exit code, why)."""
    if "CUDA_VISIBLE_DEVICES" in os.environ:  # Ray's choice of GPUs for this task reaches the worker (and its engine)
        env = {**env, "CUDA_VISIBLE_DEVICES": os.environ["CUDA_VISIBLE_DEVICES"]}
    try:
        return run_task(cfg, argv, name=name, attempt=attempt, restart=False, env=env, log_path=log_path,
                        preempt_file=preempt_path(cfg) if name == "master" else None)
    except KeyboardInterrupt:  # cancelled without force: the run is over and the worker stopped (_cancel)
        return 0, ""


def run_ray(cfg: ExperimentConfig, alloc: AllocationMode, config_path: str, secret_path: str, env: dict) -> int:
    """Exit codes like the local scheduler: 0 done, 1 a worker failed (recover_mode=auto: once the
    restarts are used up), 75 preempted (SIGTERM), 130 interrupted."""
    import ray  # optional (pip install realcore[ray]); the launcher imports this module without it
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    r = cfg.ray
    ray.init(address=r.address, namespace=f"realcore-{cfg.experiment_name}-{cfg.trial_name}",
             include_dashboard=False, log_to_driver=False, ignore_reinit_error=True)
    gpus = cluster_gpus_per_worker(cfg, ray.cluster_resources())
    if cfg.ray.gpus_per_worker is None:
        try:  # what the config alone could not tell: whether the cluster's workers are on GPUs
            check_ray_gpus(cfg, alloc, gpus)
        except ConfigError as e:
            ray.shutdown()
            print(f"realcore: config error: {e}", file=sys.stderr)
            return 2
        print(f"realcore: ray.gpus_per_worker={gpus} (the Ray cluster has {'GPUs' if gpus else 'no GPU'})", flush=True)
    meshes = mesh_bundles(cfg, alloc, gpus)
    groups = {kind: placement_group([dict(bundle) for _ in range(n)], strategy=r.placement_strategy)
              for kind, (n, bundle) in meshes.items()}
    try:
        ready = [g.ready() for g in groups.values()]
        _, pending = ray.wait(ready, num_returns=len(ready), timeout=cfg.system.startup_timeout_s)
        if pending:
            need = ", ".join(f"{kind} {n} x {bundle}" for kind, (n, bundle) in meshes.items())
            print(f"realcore: Ray could not place the workers within {cfg.system.startup_timeout_s:g} s "
                  f"(need {need}); is the cluster big enough?", file=sys.stderr)
            return 1
        task = ray.remote(_run_worker)
        n_servers = alloc.gen.dp if alloc.gen is not None else 0
        common = ["--world", str(alloc.world_size), "--config", config_path, "--secret-file", secret_path,
                  "--n-servers", str(n_servers)]
        logs = os.path.join(cfg.output_dir, "logs")
        kinds = {name: (kind, index) for name, kind, index in worker_specs(cfg, alloc)}

        def submit(name: str, attempt: int):
            kind, index = kinds[name]
            argv = [r.python or sys.executable, "-m", "realcore.launch.run_worker", "--type", kind,
                    "--index", str(index), *common, "--attempt", str(attempt)]
            options = {"num_cpus": r.cpus_per_worker, "max_retries": 0, "name": name}
            if kind in groups:
                options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                    placement_group=groups[kind], placement_group_bundle_index=index)
                if "GPU" in meshes[kind][1]:
                    options["num_gpus"] = meshes[kind][1]["GPU"]
            log = os.path.join(logs, "master.out" if kind == "master" else name.replace("/", "-") + ".log")
            return task.options(**options).remote(cfg, argv, task_env(env), log, name, attempt)

        return _attempts(cfg, kinds, submit, make_name_resolver(cfg.system.name_resolve))
    finally:
        for g in groups.values():
            remove_placement_group(g)
        ray.shutdown()


def _attempts(cfg: ExperimentConfig, kinds: dict, submit, resolver) -> int:
    """Whole-run starts: the first, then (recover_mode=auto) one per failure of the trainer."""
    signals: list[int] = []
    old = {s: signal.signal(s, lambda signum, frame: signals.append(signum)) for s in (signal.SIGINT, signal.SIGTERM)}
    follow = Follow(os.path.join(cfg.output_dir, "logs", "master.out"))
    restarts = 0
    try:
        for attempt in range(cfg.recover_retries + 1):
            begin_attempt(cfg, resolver)
            if os.path.exists(preempt_path(cfg)):
                os.remove(preempt_path(cfg))
            refs = {submit(name, attempt): name for name in kinds}
            rc, why = _watch(cfg, refs, submit, attempt, follow, signals)
            if rc == PREEMPTED_EXIT:
                print("realcore: preempted; a recover checkpoint holds the run: run the same command again with "
                      "recover_mode=resume (or auto) to continue", file=sys.stderr)
            if rc != 1:
                return rc
            print(f"realcore: {why}; cancelling the Ray tasks", file=sys.stderr)
            log = os.path.join(cfg.output_dir, "logs", why.split()[0].replace("/", "-") + ".log")
            if os.path.exists(log):
                print(f"realcore: last lines of {log}:\n{tail(log)}", file=sys.stderr)
            _cancel(list(refs), wait_s=cfg.system.shutdown_timeout_s)
            if cfg.recover_mode != "auto" or restarts == cfg.recover_retries:
                if cfg.recover_mode == "auto":
                    print(f"realcore: giving up after {restarts} restarts (recover_retries={cfg.recover_retries})",
                          file=sys.stderr)
                record(cfg.output_dir, attempt, why.split()[0], why, "give up")
                return 1
            restarts += 1
            record(cfg.output_dir, attempt, why.split()[0], why, "restart run")
            print(f"realcore: restarting the run from its last recover checkpoint in {cfg.recover_delay_s:g} s "
                  f"(restart {restarts} of {cfg.recover_retries})", file=sys.stderr, flush=True)
            deadline = time.monotonic() + cfg.recover_delay_s
            while time.monotonic() < deadline and not signals:
                time.sleep(0.2)
            if signals:
                return 130 if signals[0] == signal.SIGINT else PREEMPTED_EXIT
        return 1  # not reached: the last attempt returns above
    finally:
        follow.poll()
        for s, h in old.items():
            signal.signal(s, h)


def _watch(cfg: ExperimentConfig, refs: dict, submit, attempt: int, follow, signals: list[int]) -> tuple[int, str]:
    """Wait for one attempt's tasks, restarting rollout-side ones: (0, "") done, (130, "")
    interrupted, (1, why) the run failed. `refs` holds the live tasks (the caller cancels them)."""
    import ray  # optional, as above

    started = {name: time.monotonic() for name in refs.values()}
    quick_deaths: dict[str, int] = {}
    preempt_deadline: float | None = None
    while True:
        follow.poll()
        if signals and (signals[0] == signal.SIGINT or len(signals) > 1):
            print(f"realcore: {signal.Signals(signals[-1]).name}: cancelling the Ray tasks", file=sys.stderr)
            _cancel(list(refs))
            return 130, ""
        if signals and preempt_deadline is None:  # SIGTERM: a preemption, as with the local scheduler
            preempt_deadline = time.monotonic() + cfg.system.preempt_timeout_s
            print(f"realcore: SIGTERM: the master writes a recover checkpoint after its current step (deadline "
                  f"{cfg.system.preempt_timeout_s:g} s)", file=sys.stderr, flush=True)
            with open(preempt_path(cfg), "w") as f:
                f.write("the launcher got SIGTERM\n")
        if preempt_deadline is not None and time.monotonic() > preempt_deadline:
            print(f"realcore: no recover checkpoint within {cfg.system.preempt_timeout_s:g} s; stopping "
                  "(the last recover checkpoint holds the run)", file=sys.stderr)
            _cancel(list(refs))
            return PREEMPTED_EXIT, ""
        done, _ = ray.wait(list(refs), num_returns=1, timeout=0.5)
        for ref in done:
            name = refs.pop(ref)
            try:
                rc, why = ray.get(ref)
            except Exception as e:  # its Ray worker or node died, or Ray cancelled it
                rc, why = None, f"died ({str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__})"
            if name == "master" and rc in (0, PREEMPTED_EXIT):
                _cancel(list(refs), grace_s=cfg.system.shutdown_timeout_s)  # the master told them to exit
                return rc, ""
            if rc == 0:  # it left because the master told it to (EXIT at the end)
                continue
            why = why or f"died (exit code {rc})"
            if name.split("/")[0] in ROLLOUT_SIDE and cfg.recover_mode != "disabled":
                n = count_quick_death(quick_deaths, name, started[name])
                if n <= cfg.recover_retries:
                    print(f"realcore: {name} {why}; restarting its Ray task (training goes on)", file=sys.stderr,
                          flush=True)
                    record(cfg.output_dir, attempt, name, why, "restart in place")
                    try:
                        os.remove(heartbeat_path(cfg.output_dir, name))
                    except FileNotFoundError:
                        pass
                    refs[submit(name, attempt)] = name
                    started[name] = time.monotonic()
                    continue
                why += f"; it died {n} times within {STABLE_S:g} s of starting"
            return 1, _blame(cfg, name, why, refs, started)
        if not refs:
            return 1, "master ended without finishing the run"


def _blame(cfg: ExperimentConfig, name: str, why: str, refs: dict, started: dict) -> str:
    """What failed the run. A trainer process that hangs makes its peers fail about when its task
    runner finds it hung (they lose it), so a trainer failure waits a little for a peer's runner to
    report a hang (its stack dump takes 2 s; one silent for half the heartbeat deadline gets the
    other half) and names that one instead, as the local supervisor does."""
    import ray  # optional, as above

    trainer = ("master", "model_worker")
    if name.split("/")[0] not in trainer or why.startswith("hung"):
        return f"{name} {why}"
    peers = {ref: peer for ref, peer in refs.items() if peer.split("/")[0] in trainer}
    now = time.monotonic()
    silent = any(hung(cfg, peer, started[peer], now, margin=0.5) for peer in peers.values())
    deadline = now + 5 + (cfg.system.heartbeat_timeout_s / 2 if silent else 0)
    pending = list(peers)
    while pending and time.monotonic() < deadline:
        done, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
        for ref in done:
            try:
                _, peer_why = ray.get(ref)
            except Exception:  # its Ray worker died too: no word from its runner
                continue
            if peer_why.startswith("hung"):
                return f"{peers[ref]} {peer_why}"
    return f"{name} {why}"


def _cancel(refs: list, grace_s: float = 0.0, wait_s: float = 0.0) -> None:
    """End the tasks `refs`. With `grace_s` (the run is over): cancel them without force at once, so
    each task runner stops its worker as the local launcher does (SIGTERM, SIGKILL past
    `system.shutdown_timeout_s`; the rollout side is never told to exit, and waiting for it cost
    every run its whole grace), and wait up to `grace_s` + 2 s for them. Then force-cancel what is
    left (its Ray worker is killed, and the worker with it: PDEATHSIG), and wait up to `wait_s`
    until Ray reports them ended (before a restart starts new ones)."""
    import ray  # optional, as above

    if grace_s:
        for ref in refs:
            ray.cancel(ref, force=False)
        deadline = time.monotonic() + grace_s + 2
        while refs and time.monotonic() < deadline:
            _, refs = ray.wait(refs, num_returns=len(refs), timeout=max(0.0, deadline - time.monotonic()))
    for ref in refs:
        ray.cancel(ref, force=True)
    if refs and wait_s:
        ray.wait(refs, num_returns=len(refs), timeout=wait_s)
