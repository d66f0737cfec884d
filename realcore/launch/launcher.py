"""`python -m realcore.launch key=value ...`: validate, prepare, start the workers, watch them.

scheduler=local places every process on GPUs of its own (placement.py: its CUDA_VISIBLE_DEVICES)
and prints the plan when the node has GPUs. `--dry-run` prints what would run (local: that plan;
ray: the placement groups; slurm: the batch script) and starts nothing, writing nothing into
output_dir; `--print-config` prints the composed, validated configuration as YAML; `--help [PREFIX]`
the keys with their defaults (cli_help.py, the usage text too).

Exit codes: 0 done; 1 a worker failed (recover_mode=auto: once the restarts are used up); 2 bad
config or input, a node with too few GPUs for the allocation, or the output_dir is in use by
another launcher (one line, no traceback, before any worker starts); 75 preempted (a recover
checkpoint holds the run: launch the same command again with recover_mode=resume or auto); 130
interrupted.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import sys
import threading
import time

import yaml

from realcore.api.alloc import AllocationMode
from realcore.api.config import ExperimentConfig
from realcore.backends.clients.registry import capabilities, server_command
from realcore.backends.server_launch import server_token, wait_http_ready, wait_own_listener
from realcore.data.datasets import describe_skips
from realcore.dfg.graph import DataFlowGraph, GraphError
from realcore.launch.config_loader import ConfigError, load_config
from realcore.launch.engine_server import free_port
from realcore.launch.cli_help import help_text
from realcore.launch.local import Proc, open_log, private_logs_dir, spawn, spawn_command, tail
from realcore.launch.placement import Plan, describe, describe_meshes
from realcore.launch.process import PREEMPTED_EXIT, node_address
from realcore.launch.ray_scheduler import describe_bundles, run_ray
from realcore.launch.run_lock import claim_output, hold_run
from realcore.launch.slurm import sbatch_script, steps, submit_and_watch
from realcore.launch.supervise import Supervisor, begin_attempt, record, write_pids
from realcore.launch.validate import (check_inputs, check_model_layout, check_placement, check_ray, check_slurm,
                                      validate)
from realcore.transport import addresses, keys
from realcore.transport.name_resolve import make_name_resolver
from realcore.transport.wire import load_secret, write_secret


def run_on_cluster(cfg: ExperimentConfig, dfg: DataFlowGraph, alloc: AllocationMode) -> int:
    """Submit the run as one Slurm job (realcore/launch/slurm.py) or as Ray tasks
    (realcore/launch/ray_scheduler.py) and follow it."""
    make_name_resolver(cfg.system.name_resolve).clear(keys.scope(cfg))
    config_path, secret_path = prepare_output(cfg, dfg)
    if cfg.scheduler == "slurm":
        precreate_slurm_logs(cfg, alloc)
    if cfg.scheduler == "ray":
        rc = run_ray(cfg, alloc, config_path, secret_path, child_env(cfg))
    else:
        rc = submit_and_watch(cfg, alloc, config_path, secret_path, child_env(cfg))
    if rc == 0:
        print(f"realcore: done; metrics in {os.path.join(cfg.output_dir, 'metrics.jsonl')}", flush=True)
    return rc


def check_name_store(cfg: ExperimentConfig) -> None:
    """The name store is private (fs: our own folder, 0700) and reachable, or the run stops here
    with one line (name_resolve.private_root says what is wrong)."""
    try:
        make_name_resolver(cfg.system.name_resolve)
    except (ValueError, ConnectionError, ImportError) as e:
        raise ConfigError(str(e)) from None


def precreate_slurm_logs(cfg: ExperimentConfig, alloc: AllocationMode) -> None:
    """srun creates its --output files with the job's umask (often 0644): create them here, 0600,
    so that srun's --open-mode=append keeps that mode (a task's log may hold what it printed)."""
    logs = os.path.join(cfg.output_dir, "logs")
    for step in steps(cfg, alloc):
        names = ["master.out"] if step.kind == "master" else [f"{step.kind}-{t}.log" for t in range(step.ntasks)]
        for name in names:
            open_log(os.path.join(logs, name)).close()


def prepare_output(cfg: ExperimentConfig, dfg: DataFlowGraph) -> tuple[str, str]:
    """Output folders, the resolved config for workers, a fresh per-run secret, dfg.png (drawn by
    a thread while the workers start: ~1 s of matplotlib that need not delay them)."""
    out = os.path.abspath(cfg.output_dir)
    config_path, secret_path = output_files(cfg)
    private_logs_dir(os.path.join(out, "logs"))  # 0700, files 0600: engines log their arguments
    open_log(os.path.join(out, "logs", "master.log")).close()  # the master's logging appends to it: 0600 first
    if os.path.exists(secret_path):
        os.remove(secret_path)
    write_secret(secret_path)
    # 0600: it may hold rollout.server_token. O_CREAT's mode applies to a new file only: fchmod an old one.
    fd = os.open(config_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(fd, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(cfg.model_dump_json(indent=2))
    # Not a daemon: the launcher's exit waits for it, so the picture is whole whenever it ends.
    threading.Thread(target=draw_dfg, args=(dfg, os.path.join(out, "dfg.png")), name="dfg.png").start()
    return config_path, secret_path


def output_files(cfg: ExperimentConfig) -> tuple[str, str]:
    """Where the resolved config (for the workers) and the run's secret are written."""
    out = os.path.abspath(cfg.output_dir)
    return os.path.join(out, "config.json"), os.path.join(out, ".secret")


def draw_dfg(dfg: DataFlowGraph, path: str) -> None:
    from realcore.dfg.draw import draw  # matplotlib: only when the graph is drawn, not at every launch

    try:
        draw(dfg, path)
    except Exception as e:  # a picture is never worth failing a run over
        print(f"realcore: dfg.png not written: {type(e).__name__}: {e}", file=sys.stderr)


def child_env(cfg: ExperimentConfig) -> dict:
    env = dict(os.environ)
    n = str(cfg.system.threads_per_process)
    env.update(OMP_NUM_THREADS=n, MKL_NUM_THREADS=n, TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1")
    # The user's `imports:` modules usually live in the directory the run started from.
    env["PYTHONPATH"] = os.pathsep.join(p for p in (os.getcwd(), env.get("PYTHONPATH", "")) if p)
    return env


def resolve_local_host(cfg: ExperimentConfig) -> None:
    """scheduler=local: `system.host=auto` (or `system.interface`) becomes this machine's address
    here, once, before anything starts, so config.json, every worker and every server command line
    carry the address itself (SGLang would be given the literal `--host auto`). On a cluster each
    worker resolves its own node's address (run_worker)."""
    try:
        cfg.system.host = node_address(cfg.system.host, cfg.system.interface)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    check_bindable(cfg.system.host)


def check_bindable(host: str) -> None:
    """Every local process binds `host`: an address this machine does not have must stop the
    launch here, not fail the first worker that binds it (EADDRNOTAVAIL) after the others started."""
    try:
        infos = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)
    except OSError as e:
        raise ConfigError(f"system.host: {host!r} does not resolve ({e.strerror or e})") from None
    family, _, _, _, addr = infos[0]
    try:
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.bind(addr)
    except OSError as e:
        raise ConfigError(f"system.host: cannot bind {host!r} on this machine ({e.strerror or e}); use one of its "
                          "addresses (127.0.0.1, auto) or system.interface") from None


TOKEN_ENV = "REALCORE_SERVER_TOKEN"


def resolve_server_token(cfg: ExperimentConfig) -> None:
    """rollout.server_token from rollout.server_token_file or $REALCORE_SERVER_TOKEN, so it need not
    be on the command line (every user's `ps` shows it there); config.json (0600) carries it on."""
    r = cfg.rollout
    if r.server_token and r.server_token_file:
        raise ConfigError("rollout.server_token and rollout.server_token_file are both set: set one")
    if r.server_token_file:
        path = os.path.expanduser(r.server_token_file)
        try:
            st = os.stat(path)
            with open(path) as f:
                token = f.read().strip()
        except OSError as e:
            raise ConfigError(f"rollout.server_token_file: cannot read {path}: {e.strerror or e}") from None
        if st.st_mode & 0o077:
            raise ConfigError(f"rollout.server_token_file: {path} is readable or writable by other users "
                              f"(mode {st.st_mode & 0o777:o}); chmod 600 it")
        if not token or any(c.isspace() for c in token):
            raise ConfigError(f"rollout.server_token_file: {path} must hold one token (no spaces), got "
                              f"{'nothing' if not token else 'whitespace inside'}")
        r.server_token, r.server_token_file = token, None
    elif not r.server_token and os.environ.get(TOKEN_ENV):
        r.server_token = os.environ[TOKEN_ENV].strip()


def engine_server_command(cfg: ExperimentConfig, alloc: AllocationMode, plan: Plan, i: int, port: int, token: str,
                          write_files: bool = True) -> tuple[list[str], dict[str, str]]:
    """(argv, env on top of the launcher's) of SGLang/vLLM server `i` on the GPUs the plan gives it
    (the GPU flags when it has some: the plan decides, not the launcher's own torch)."""
    name = f"gen_server/{i}"
    argv, env = server_command(alloc.backend, model_path=cfg.model.path, host=cfg.system.host, port=port,
                               tp=alloc.gen.tp, pp=alloc.gen.pp, seed=cfg.seed + 1000 * i,
                               max_batch_size=cfg.generation.max_batch_size, api_key=token,
                               private_dir=os.path.abspath(cfg.output_dir), python=cfg.rollout.server_python,
                               lora=cfg.actor.lora, cuda=name in plan.gpus,
                               mem_fraction=plan.mem_fraction(name, cfg.rollout.server_mem_fraction),
                               dtype=cfg.generation.dtype, write_files=write_files)
    return argv, {**env, **plan.env(name)}


def start_engine_servers(cfg: ExperimentConfig, alloc: AllocationMode, env: dict, logs: str,
                         plan: Plan | None = None) -> list[Proc]:
    """SGLang or vLLM servers: started here on free ports, each published once it listens and
    answers (publish_when_ready); the manager waits for each before any rollout starts. Each
    requires the run's bearer token, derived here from the run's secret as every worker derives it
    (run_worker), kept off the command line and filtered out of what the server prints.
    `rollout.server_python` runs them (SGLang/vLLM in an environment of their own). `plan`: their
    GPUs (None: none, the CPU route)."""
    plan = plan or Plan((), "")
    out = os.path.abspath(cfg.output_dir)
    secret = load_secret(os.path.join(out, ".secret"))  # prepare_output wrote it
    resolver = make_name_resolver(cfg.system.name_resolve, secret)
    token = server_token(secret, cfg.rollout.server_token)
    redact = (token, secret.hex())  # SGLang logs its server_args, api_key included, at INFO

    def server(i: int) -> Proc:
        # A restart gets a new port: the manager tells a restarted server (to catch up) by its address.
        port = free_port(cfg.system.host)
        argv, extra_env = engine_server_command(cfg, alloc, plan, i, port, token)
        proc = spawn_command(f"gen_server/{i}", argv, env={**env, **extra_env}, log_path=os.path.join(logs, f"gen_server-{i}.log"),
                             redact=redact)
        publish_when_ready(cfg, resolver, i, proc, port, token)
        return proc

    procs = [server(i) for i in range(alloc.gen.dp)]
    for i, p in enumerate(procs):
        p.start = lambda i=i: server(i).popen
    return procs


def publish_when_ready(cfg: ExperimentConfig, resolver, i: int, proc: Proc, port: int, token: str) -> threading.Thread:
    """Publish server `i`'s address once the process we started listens on `port` and answers an
    authenticated probe (a thread: start-up takes 24-60 s). Before the first probe, which carries
    the token, the listener must be ours: a local user who bound the port first would get it."""
    url = f"http://{cfg.system.host}:{port}"
    popen = proc.popen

    def run() -> None:
        deadline = time.monotonic() + cfg.system.startup_timeout_s
        try:
            wait_own_listener(popen, port, timeout_s=cfg.system.startup_timeout_s)
            asyncio.run(wait_http_ready(url, timeout_s=max(0.1, deadline - time.monotonic()), proc=popen, token=token))
        except RuntimeError:  # it exited: the supervisor reports it (and restarts it, if it may)
            return
        except TimeoutError as e:  # never published: stop it, so the supervisor reports it
            print(f"realcore: gen_server/{i}: {e}; stopping it", file=sys.stderr, flush=True)
            if popen.poll() is None:
                popen.kill()
            return
        addresses.publish_gen_server(resolver, cfg, i, addresses.GenServerAddress(url))

    t = threading.Thread(target=run, name=f"publish gen_server/{i}", daemon=True)
    t.start()
    return t


def start_processes(cfg: ExperimentConfig, alloc: AllocationMode, config_path: str, secret_path: str,
                    attempt: int = 0, plan: Plan | None = None) -> list[Proc]:
    """Model workers (the training mesh), generation servers if the allocation has them, in async
    mode their manager and rollout workers; the master first in the list (it is started last: it
    waits for the others anyway). Each on the GPUs `plan` gives it (placement.py; None: the
    environment as it is), restarts included."""
    plan = plan or Plan((), "")
    env = child_env(cfg)
    logs = os.path.join(cfg.output_dir, "logs")
    n_servers = alloc.gen.dp if alloc.gen is not None else 0
    common = ["--world", str(alloc.world_size), "--config", config_path, "--secret-file", secret_path,
              "--n-servers", str(n_servers), "--attempt", str(attempt)]
    kinds = [("model_worker", alloc.world_size)]
    procs = []
    if alloc.gen is not None:
        if capabilities(alloc.backend).own_worker:
            kinds.append(("gen_server", n_servers))
        else:
            procs += start_engine_servers(cfg, alloc, env, logs, plan)
    if cfg.mode == "async":
        kinds += [("gserver_manager", 1), ("rollout_worker", cfg.rollout.n_workers)]
    for kind, count in kinds:
        for i in range(count):
            name = kind if kind == "gserver_manager" else f"{kind}/{i}"
            log = os.path.join(logs, name.replace("/", "-") + ".log")
            procs.append(spawn(name, ["--type", kind, "--index", str(i), *common], env={**env, **plan.env(name)},
                               log_path=log))
    # A script's master (realcore.Controller) reads the console: a breakpoint in its loop can be used.
    procs.insert(0, spawn("master", ["--type", "master", *common], env={**env, **plan.env("master")}, log_path=None,
                          stdin=cfg.script is not None))
    return procs


def print_help(argv: list[str]) -> None:
    """`--help [PREFIX]`: the usage, then every config key (under PREFIX) with its default and what it does."""
    prefix = next((a for a in argv if not a.startswith("-")), "")
    print(help_text(prefix))


def print_config(argv: list[str]) -> int:
    """`--print-config`: the configuration a launch with these arguments would run, composed and
    validated as check_all does (before it looks at the machine, the model or the dataset), as YAML;
    nothing is started or written. rollout.server_token, if set, is shown as <hidden>."""
    try:
        with contextlib.redirect_stdout(sys.stderr):  # stdout is the YAML alone; validate's notes go to stderr
            cfg = load_config(argv)
            resolve_server_token(cfg)
            validate(cfg)
    except (ConfigError, GraphError) as e:
        print(f"realcore: config error: {e}", file=sys.stderr)
        return 2
    cfg.output_dir = os.path.abspath(cfg.output_dir)
    dump = cfg.model_dump(mode="json")
    if dump["rollout"]["server_token"]:
        dump["rollout"]["server_token"] = "<hidden>"
    print(yaml.safe_dump(dump, sort_keys=False, width=120), end="", flush=True)
    return 0


def main(argv: list[str]) -> int:
    if "--help" in argv or "-h" in argv:
        print_help([a for a in argv if a not in ("--help", "-h")])
        return 0
    if "--print-config" in argv:
        if "--dry-run" in argv:
            print("realcore: config error: --print-config and --dry-run: give one", file=sys.stderr)
            return 2
        return print_config([a for a in argv if a != "--print-config"])
    dry_run = "--dry-run" in argv
    argv = [a for a in argv if a != "--dry-run"]
    with contextlib.ExitStack() as held:  # the run's locks, released when the launcher ends (or dies)
        # A dry run shows its plan even when the model does not fit the layout; the error follows it.
        layout_errors: list[ConfigError] = []
        try:
            # A dry run's stdout is the plan (or the batch script) alone; what the checks say goes to stderr.
            with contextlib.redirect_stdout(sys.stderr) if dry_run else contextlib.nullcontext():
                cfg, dfg, alloc, plan = check_all(argv, dry_run, held, layout_errors.append if dry_run else None)
        except (ConfigError, GraphError) as e:
            print(f"realcore: config error: {e}", file=sys.stderr)
            return 2
        if dry_run:
            rc = print_plan(cfg, alloc, plan)
        elif cfg.scheduler in ("slurm", "ray"):
            rc = run_on_cluster(cfg, dfg, alloc)
        else:
            return run_local(cfg, dfg, alloc, plan)
        for e in layout_errors:
            print(f"realcore: config error: {e} (this run would stop here)", file=sys.stderr)
        return 2 if layout_errors else rc


def print_plan(cfg: ExperimentConfig, alloc: AllocationMode, plan: Plan | None) -> int:
    """`--dry-run`: under scheduler=local each process, its GPUs, each SGLang/vLLM server's command
    line (the port is picked again when the run starts); ray: the placement groups; slurm: the batch
    script (on stdout, as sbatch would get it) and the files the run would write first. Writes nothing."""
    if cfg.scheduler == "slurm":
        config_path, secret_path = output_files(cfg)
        print(sbatch_script(cfg, alloc, config_path, secret_path), end="")
        print(f"realcore: dry run: nothing was written; a run would first write {config_path}, {secret_path}, "
              f"{os.path.join(cfg.output_dir, 'slurm', 'job.sbatch')} (the script above) and the logs in "
              f"{os.path.join(cfg.output_dir, 'logs')}, then submit it with sbatch", file=sys.stderr, flush=True)
        return 0
    if cfg.scheduler == "ray":
        print(describe_bundles(cfg, alloc))
    else:
        commands = {}
        if alloc.gen is not None and not capabilities(alloc.backend).own_worker:
            for i in range(alloc.gen.dp):  # the token stays off the command line: a stand-in will do
                argv, _ = engine_server_command(cfg, alloc, plan, i, free_port(cfg.system.host), token="dry-run",
                                                write_files=False)
                commands[f"gen_server/{i}"] = argv
        print(describe(cfg, alloc, plan, commands))
    if alloc.role_meshes:
        print(describe_meshes(cfg, alloc))
    print("realcore: dry run: nothing was started", flush=True)
    return 0


def check_all(argv: list[str], dry_run: bool, held: contextlib.ExitStack,
              on_layout_error=None) -> tuple[ExperimentConfig, DataFlowGraph, AllocationMode, Plan | None]:
    """Every check that needs no worker, config first (the local GPU placement among them), then the
    model and the dataset. The run's locks are taken (into `held`) before the model is built, so a
    second launch stops at once; a dry run (any scheduler) takes no lock and writes nothing into
    output_dir. `on_layout_error`: takes the model-layout
    check's error instead of raising it (a dry run). The plan: scheduler=local only (else None)."""
    cfg = load_config(argv)
    resolve_server_token(cfg)
    dfg, alloc = validate(cfg)
    plan = None
    if cfg.scheduler == "slurm":
        check_slurm(cfg, alloc, dry_run)
    if cfg.scheduler == "ray":
        check_ray(cfg, alloc)
    if cfg.scheduler == "local":
        plan = check_placement(cfg, alloc)
    cfg.output_dir = os.path.abspath(cfg.output_dir)
    if cfg.scheduler == "local":
        resolve_local_host(cfg)
    if not dry_run:
        held.enter_context(hold_run(cfg))
    if not dry_run:  # under the run's lock (the default root is in output_dir); a dry run creates no folder
        check_name_store(cfg)
    # torch and transformers: not for --help or a config error
    from transformers.utils import logging as hf_logging

    from realcore.backends.models import prepare_model

    hf_logging.disable_progress_bar()  # building a model here must not break the one-line errors
    try:
        cfg.model.path = prepare_model(cfg.model, cfg.seed)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    loaded = check_inputs(cfg, alloc)
    try:
        check_model_layout(cfg, alloc)
    except ConfigError as e:
        if on_layout_error is None:
            raise
        on_layout_error(e)
    if cfg.mode == "async":  # in sync mode the master reports its model workers' counts
        print(f"realcore: dataset: {loaded.n_rows} rows, {len(loaded.samples)} usable, "
              f"skipped {describe_skips(loaded.skipped)}", flush=True)
    if not dry_run:  # last: a live Slurm job of output_dir, another run's records (moved aside only now)
        claim_output(cfg)
    return cfg, dfg, alloc, plan


def run_local(cfg: ExperimentConfig, dfg: DataFlowGraph, alloc: AllocationMode, plan: Plan | None = None) -> int:
    """Start every process here, each on the GPUs `plan` gives it, and supervise them (supervise.py);
    with recover_mode=auto, a failed run is stopped and started again (it resumes from its last
    recover checkpoint), up to recover_retries times."""
    plan = plan or Plan((), "")
    config_path, secret_path = prepare_output(cfg, dfg)
    resolver = make_name_resolver(cfg.system.name_resolve, load_secret(secret_path))
    restarts = 0
    for attempt in range(cfg.recover_retries + 1):
        begin_attempt(cfg, resolver)
        procs = start_processes(cfg, alloc, config_path, secret_path, attempt, plan)
        if attempt == 0:
            if plan.gpus or plan.hide:  # a CPU run's output stays as it was
                print(describe(cfg, alloc, plan, {}), flush=True)
            print(f"realcore: {cfg.experiment_name}/{cfg.trial_name}: {', '.join(p.name for p in procs)}; "
                  f"output in {cfg.output_dir}", flush=True)
            if alloc.role_meshes:
                print(describe_meshes(cfg, alloc), flush=True)
            print(dfg.describe(), flush=True)
        write_pids(cfg.output_dir, procs)
        own = alloc.gen is not None and capabilities(alloc.backend).own_worker
        realcore_procs = {p.name for p in procs if p.name.split("/")[0] != "gen_server" or own}
        outcome = Supervisor(cfg, procs, attempt, watch_heartbeats=realcore_procs).run()
        if outcome.rc != 1:
            break
        print(f"realcore: {outcome.why}; stopping all workers", file=sys.stderr)
        if outcome.log_path:
            print(f"realcore: last lines of {outcome.log_path}:\n{tail(outcome.log_path)}", file=sys.stderr)
        if cfg.recover_mode != "auto" or restarts == cfg.recover_retries:
            if cfg.recover_mode == "auto":
                print(f"realcore: giving up after {restarts} restarts (recover_retries={cfg.recover_retries})", file=sys.stderr)
            record(cfg.output_dir, attempt, outcome.why.split()[0], outcome.why, "give up")
            return 1
        restarts += 1
        record(cfg.output_dir, attempt, outcome.why.split()[0], outcome.why, "restart run")
        print(f"realcore: restarting the run from its last recover checkpoint in {cfg.recover_delay_s:g} s "
              f"(restart {restarts} of {cfg.recover_retries})", file=sys.stderr, flush=True)
        time.sleep(cfg.recover_delay_s)
    if outcome.rc == 0:
        print(f"realcore: done; metrics in {os.path.join(cfg.output_dir, 'metrics.jsonl')}", flush=True)
    elif outcome.rc == PREEMPTED_EXIT:
        print("realcore: preempted; a recover checkpoint holds the run: run the same command again with "
              "recover_mode=resume (or auto) to continue", file=sys.stderr)
    return outcome.rc
