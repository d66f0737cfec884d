"""`scheduler=slurm`: one sbatch allocation; one job step (`srun --exact`) per worker type.

Every task of a step is a task runner (realcore/launch/cluster.py) around one worker: it dumps the
stacks of a hung worker and kills it, restarts a dead or hung rollout-side worker (generation
server, gserver manager, rollout worker) in place while training goes on, and turns Slurm's
SIGTERM into a preemption (the master gets SIGUSR2; no worker dies before its recover checkpoint).
Restarting inside the task rather than as a new step keeps a run at five steps however many
servers and rollout workers it has (no srun per process on the batch node, no step creation per
restart), keeps a restarted worker on its node and GPU, and needs no launcher: a requeued job, or
one whose login node went away, still recovers.

The batch script (OUTPUT_DIR/slurm/job.sbatch; `--dry-run` prints it and writes nothing) first
runs a `begin` step (a whole-run start: name-resolution scope, `.heartbeat`, `.manager` cleared),
then starts every step in the background and waits:
- the master's step ending cleanly ends the job (COMPLETED; `OUTPUT_DIR/slurm/status`: `done`);
- the master exiting 75 (preempted, a recover checkpoint written) ends the job FAILED with exit
  code 75 (status `preempted`), or with `slurm.requeue=true` requeues it (status `requeued`):
  Slurm starts the same job again later, and it resumes from the checkpoint;
- any other step failing (a master or model worker that died or hung, or a rollout-side worker
  in a crash loop) ends it at once (FAILED, exit code 1, status `failed STEP RC`; Slurm kills the
  other steps).
Workers get `--attempt` = the script's argument (the launcher's resubmissions) + SLURM_RESTART_COUNT
(Slurm's requeues).
Each task writes its log into OUTPUT_DIR/logs/ (srun `--output`, appended across restarts); srun's
own messages go to `OUTPUT_DIR/slurm/step-<type>.err`, where a failed task is named, and its
runner writes why into `OUTPUT_DIR/slurm/why-<name>`.

The launcher submits with `sbatch --parsable`, follows the job with `squeue`/`scontrol` (through
requeues: the job id stays), copies the master's output to the console, and when the job fails:
with recover_mode=auto, submits it again (up to recover_retries, `--attempt` + 1; the run resumes
from its last recover checkpoint), else exits 1 naming the worker. SIGTERM to the launcher stops
the run as a preemption would (the job is not requeued): `scancel --signal=TERM`, the master
writes its recover checkpoint within `system.preempt_timeout_s`, the launcher exits 75; SIGINT (or
a second SIGTERM) cancels the job at once (exit 130).
Tip: `slurm.sbatch_args=[--signal=TERM@300]` makes the time limit a preemption too (the steps get
SIGTERM 300 s before it).
"""

from __future__ import annotations

import glob
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass

from realcore.api.alloc import AllocationMode
from realcore.api.config import ExperimentConfig
from realcore.backends.clients.registry import capabilities
from realcore.launch.cluster import Follow
from realcore.launch.config_loader import ConfigError
from realcore.launch.placement import gpus_per_server
from realcore.launch.supervise import record
from realcore.launch.process import PREEMPTED_EXIT
from realcore.launch.local import tail

ACTIVE = ("PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "SUSPENDED", "REQUEUED", "REQUEUE_FED", "REQUEUE_HOLD",
          "RESIZING", "SIGNALING", "STAGE_OUT")


@dataclass
class Step:
    kind: str  # worker type (run_worker --type)
    ntasks: int
    gpus_per_task: int = 0


def check_config(cfg: ExperimentConfig) -> None:
    if cfg.slurm.requeue and cfg.recover_mode == "disabled":
        raise ValueError("slurm.requeue: a requeued job continues from its recover checkpoint; "
                         "set recover_mode=resume or auto")


_GPU_GRES = re.compile(r"(?:^|,)gpu:(?:[^:,()\s]+:)?(\d+)")  # gpu:8, gpu:a100:8, gpu:a100:8(S:0-1)


def sinfo_gpus_per_node(partition: str | None) -> int | None:
    """GPUs per node of the cluster (of `partition`), as `sinfo` lists the nodes' gres: the fewest
    among the nodes that have GPUs (so the request fits each of them; Slurm picks GPU nodes), 0
    when no node has one (a CPU cluster), None when sinfo is missing or fails (e.g. a dry run on a
    machine without Slurm)."""
    argv = ["sinfo", "-h", "-o", "%G"] + (["-p", partition] if partition else [])
    try:  # answers in well under a second; a broken slurm.conf makes it retry for a minute
        r = subprocess.run(argv, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if r.returncode != 0:
        return None
    counts = [sum(int(n) for n in _GPU_GRES.findall(line.strip())) for line in r.stdout.splitlines() if line.strip()]
    return min((n for n in counts if n > 0), default=0)


def resolve_gpus_per_node(cfg: ExperimentConfig) -> None:
    """slurm.gpus_per_node=None: ask Slurm (sinfo); unknown stays None (steps: GPUs for SGLang/vLLM
    servers only)."""
    if cfg.slurm.gpus_per_node is None:
        cfg.slurm.gpus_per_node = sinfo_gpus_per_node(cfg.slurm.partition)


def steps(cfg: ExperimentConfig, alloc: AllocationMode) -> list[Step]:
    """The job steps of a run, in start order (the master last, like the local scheduler).
    slurm.gpus_per_node N > 0 (or resolved so by resolve_gpus_per_node): each training rank gets a
    GPU, each server its own (tp*pp for SGLang/vLLM, one for a built-in server, none with
    generation.device=cpu); 0: none; None (Slurm could not be asked): GPUs for SGLang/vLLM runs
    only, which serve on GPUs only."""
    check_config(cfg)
    gpus = cfg.slurm.gpus_per_node
    if gpus is None:
        use_gpus = alloc.gen is not None and not capabilities(alloc.backend).own_worker
    else:
        use_gpus = gpus > 0
    out = [Step("model_worker", alloc.world_size, 1 if use_gpus else 0)]  # one rank per GPU
    if alloc.gen is not None:
        # One task per server: a built-in server is one process on one GPU; an SGLang/vLLM server
        # spans tp*pp GPUs of its node (its own TP/PP workers; multi-node servers are not supported).
        per_server = gpus_per_server(cfg, alloc)
        if gpus and per_server > gpus:
            raise ValueError(f"allocation_mode: a {alloc.backend} server of tp*pp={per_server} GPUs does not fit on a "
                             f"node of slurm.gpus_per_node={gpus} (servers across nodes are not supported)")
        out.append(Step("gen_server", alloc.gen.dp, per_server if use_gpus else 0))
    if cfg.mode == "async":
        out += [Step("gserver_manager", 1), Step("rollout_worker", cfg.rollout.n_workers)]
    out.append(Step("master", 1))
    return out


def _common_args(alloc: AllocationMode, config_path: str, secret_path: str) -> list[str]:
    n_servers = alloc.gen.dp if alloc.gen is not None else 0
    return ["--world", str(alloc.world_size), "--config", config_path, "--secret-file", secret_path,
            "--n-servers", str(n_servers)]


def _srun(cfg: ExperimentConfig, name: str, ntasks: int, log: str) -> list[str]:
    s = cfg.slurm
    # --nodes: a step may use fewer nodes than the job (srun would inherit the job's count).
    # --open-mode=append: a restarted or requeued run adds to the logs instead of wiping them.
    argv = ["srun", "--exact", "--kill-on-bad-exit=1", f"--ntasks={ntasks}", f"--nodes=1-{ntasks}",
            f"--cpus-per-task={s.cpus_per_task}", f"--job-name={name}", f"--output={log}", "--open-mode=append"]
    if s.mem_per_cpu_mb:
        argv.append(f"--mem-per-cpu={s.mem_per_cpu_mb}")
    return argv + s.srun_args + shlex.split(s.container_prefix) + [s.python or sys.executable]


def step_command(cfg: ExperimentConfig, alloc: AllocationMode, step: Step, config_path: str, secret_path: str) -> str:
    """The srun command line of one step (shell text: the attempt is the script's $attempt)."""
    logs = os.path.join(cfg.output_dir, "logs")
    log = os.path.join(logs, "master.out" if step.kind == "master" else f"{step.kind}-%t.log")
    argv = _srun(cfg, step.kind, step.ntasks, log)
    if step.gpus_per_task:
        argv.insert(argv.index("--open-mode=append") + 1, f"--gpus-per-task={step.gpus_per_task}")
    slurm_dir = os.path.join(cfg.output_dir, "slurm")
    runner = ["-m", "realcore.launch.cluster", "run", "--shield-term",
              "--status-file", os.path.join(slurm_dir, "status"), "--why-dir", slurm_dir]
    if cfg.recover_mode != "disabled" and step.kind in ("gen_server", "gserver_manager", "rollout_worker"):
        runner.insert(3, "--restart")
    worker = ["--type", step.kind, "--index-from", "SLURM_PROCID", *_common_args(alloc, config_path, secret_path)]
    return shlex.join(argv + runner + ["--"] + worker) + ' --attempt "$attempt"'


def sbatch_script(cfg: ExperimentConfig, alloc: AllocationMode, config_path: str, secret_path: str) -> str:
    s = cfg.slurm
    all_steps = steps(cfg, alloc)
    slurm_dir = os.path.join(cfg.output_dir, "slurm")
    directives = [f"--job-name=realcore-{cfg.experiment_name}-{cfg.trial_name}",
                  f"--ntasks={sum(st.ntasks for st in all_steps)}", f"--cpus-per-task={s.cpus_per_task}",
                  f"--output={slurm_dir}/batch-%j.log", "--open-mode=append",
                  # Only slurm.requeue lets Slurm run the job again: else the launcher decides about restarts.
                  "--requeue" if s.requeue else "--no-requeue"]
    for flag, value in (("nodes", s.nodes), ("partition", s.partition), ("account", s.account), ("qos", s.qos),
                        ("time", s.time_limit), ("gpus-per-node", s.gpus_per_node or None),
                        ("mem-per-cpu", s.mem_per_cpu_mb)):
        if value is not None:
            directives.append(f"--{flag}={value}")
    directives += s.sbatch_args
    q = shlex.quote
    begin = _srun(cfg, "begin", 1, os.path.join(slurm_dir, "begin.log")) + [
        "-m", "realcore.launch.cluster", "begin", "--config", config_path, "--note", os.path.join(slurm_dir, "attempt")]
    lines = ["#!/bin/bash"] + [f"#SBATCH {d}" for d in directives] + [
        "# Generated by realcore (realcore/launch/slurm.py); the launcher follows this job.",
        "# One step per worker type; each task is a runner (python -m realcore.launch.cluster run) that",
        "# restarts a dead or hung rollout-side worker in place, kills a hung one after dumping its stacks,",
        "# and turns SIGTERM (preemption) into SIGUSR2 for the master.",
        "set -u",
        *s.setup,
        f"slurm={q(slurm_dir)}",
        "# $1: the attempt the launcher submitted (its whole-run restarts); each requeue by Slurm adds one.",
        'attempt=$(( ${1:-0} + ${SLURM_RESTART_COUNT:-0} ))',
        'echo "running $attempt" > "$slurm/status"',
        "# Preemption signals the steps (their runners handle it); this shell must keep waiting.",
        "trap 'echo \"realcore: SIGTERM to the batch script: waiting for the master\"' TERM",
        "rm -f \"$slurm\"/why-*",
        shlex.join(begin) + ' --attempt "$attempt" 2> "$slurm/step-begin.err" || '
        '{ echo "failed begin $?" > "$slurm/status"; exit 1; }',
        "declare -A step_of",
        '# srun\'s messages of this start (the first "task N:" line names the task that failed)',
        'start() { local name=$1; shift; "$@" 2> "$slurm/step-$name.err" & step_of[$!]=$name; }',
    ]
    for st in all_steps:
        lines.append(f"# {_describe(cfg, alloc, st)}")
        lines.append(f"start {st.kind} " + step_command(cfg, alloc, st, config_path, secret_path))
    requeue = [
        '        if [ ! -e "$slurm/stop" ]; then  # not when the launcher was told to stop',
        '            echo "requeued $attempt" > "$slurm/status"',
        '            scontrol requeue "$SLURM_JOB_ID" && sleep 300  # Slurm ends this script now',
        '        fi',
    ] if s.requeue else []
    lines += [
        "# The master ending cleanly ends the job; its exit 75 (preempted, a recover checkpoint written)",
        "# ends it with exit code 75 or requeues it; any failed step ends it now (Slurm kills the rest).",
        'while [ ${#step_of[@]} -gt 0 ]; do',
        '    done_pid=""',
        '    wait -n -p done_pid; rc=$?',
        '    [ -n "$done_pid" ] || continue  # a trapped signal interrupted wait',
        '    name=${step_of[$done_pid]}; unset "step_of[$done_pid]"',
        '    if [ "$name" = master ] && [ $rc = 0 ]; then echo "done" > "$slurm/status"; exit 0; fi',
        f'    if [ "$name" = master ] && [ $rc = {PREEMPTED_EXIT} ]; then',
        *requeue,
        f'        echo "preempted" > "$slurm/status"; exit {PREEMPTED_EXIT}',
        '    fi',
        '    if [ $rc != 0 ]; then echo "failed $name $rc" > "$slurm/status"; exit 1; fi',
        'done',
        'echo "failed master 0" > "$slurm/status"; exit 1',
        "",
    ]
    return "\n".join(lines)


def _describe(cfg: ExperimentConfig, alloc: AllocationMode, st: Step) -> str:
    """One comment line per step in the batch script: what its tasks are."""
    gpus = f", {st.gpus_per_task} GPU(s) each" if st.gpus_per_task else ""
    if st.kind == "model_worker":
        return f"{st.ntasks} model worker(s): the training mesh {cfg.allocation_mode.split('+')[-1]}{gpus}"
    if st.kind == "gen_server" and not capabilities(alloc.backend).own_worker:
        g = alloc.gen
        return f"{st.ntasks} {alloc.backend} server(s) (tp {g.tp}, pp {g.pp}){gpus}, each started by its task"
    if st.kind == "gen_server":
        return f"{st.ntasks} built-in generation server(s){gpus}"
    return f"{st.ntasks} {st.kind.replace('_', ' ')}(s)" if st.ntasks > 1 else st.kind.replace("_", " ")


def _run(argv: list[str], timeout_s: float = 30, env: dict | None = None) -> str:
    r = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, env=env)
    if r.returncode != 0:
        raise RuntimeError(f"{argv[0]} failed ({r.returncode}): {r.stderr.strip() or r.stdout.strip()}")
    return r.stdout


def job_state(job_id: str) -> str | None:
    """PENDING, RUNNING, COMPLETING, ... while squeue lists the job; its final state after
    (from scontrol, which keeps finished jobs for MinJobAge); None if Slurm forgot it."""
    out = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%T"], capture_output=True, text=True, timeout=30)
    if out.returncode == 0 and out.stdout.strip():
        return out.stdout.split()[0]
    out = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True, timeout=30)
    m = re.search(r"JobState=(\S+)", out.stdout)
    return m.group(1) if m else None


def refuse_live_job(output_dir: str) -> None:
    """ConfigError (one line) when the job last submitted for `output_dir` (OUTPUT_DIR/slurm/job_id)
    is still pending or running: its launcher died, the job did not, and a second job on the same
    folder would clear its keys and replace its secret. Asked of squeue (requeued and held jobs
    count as live); a Slurm that cannot answer is a refusal too: a live job cannot be ruled out."""
    try:
        with open(os.path.join(output_dir, "slurm", "job_id")) as f:
            job_id = f.read().strip()
    except FileNotFoundError:
        return
    if not job_id.isdigit():  # not written by realcore (it submits single jobs)
        return
    try:
        r = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%T"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        r = subprocess.CompletedProcess([], 1, "", str(e))
    if r.returncode != 0 and "Invalid job id" not in r.stderr:  # a job Slurm forgot is over
        raise ConfigError(f"output_dir {output_dir}: cannot ask Slurm whether its job {job_id} still runs: "
                          f"{' '.join(r.stderr.split()) or f'squeue exit {r.returncode}'}")
    state = r.stdout.split()[0] if r.returncode == 0 and r.stdout.strip() else None
    if state in ACTIVE:  # with -j, squeue also shows a job that ended a moment ago
        raise ConfigError(f"output_dir {output_dir} is in use by Slurm job {job_id} ({state}), whose launcher is gone; "
                          f"wait for it or `scancel {job_id}`, then launch again (recover_mode=resume continues it)")


def read_status(slurm_dir: str) -> list[str]:
    """The batch script's `OUTPUT_DIR/slurm/status`, split: [running N] [done] [preempted]
    [requeued N] [failed STEP RC]; [] before the job starts."""
    try:
        with open(os.path.join(slurm_dir, "status")) as f:
            return f.read().split()
    except FileNotFoundError:
        return []


def failed_worker(slurm_dir: str) -> str | None:
    """`kind/index why (on NODE)` of the worker that failed, from the runners' why files, the batch
    script's status and srun's messages. A hung worker makes its peers fail too (they lose it):
    a runner's "hung" report names it first, as the local supervisor does."""
    whys = {}
    for path in glob.glob(os.path.join(slurm_dir, "why-*")):
        with open(path) as f:
            name, _, why = f.read().strip().partition(" ")
        whys[name] = why
    for name, why in sorted(whys.items()):
        if why.startswith("hung"):
            return f"{name} {why}"
    status = read_status(slurm_dir)
    if not status or status[0] != "failed":
        return None
    kind, rc = status[1], status[2] if len(status) > 2 else "?"
    try:
        with open(os.path.join(slurm_dir, f"step-{kind}.err")) as f:
            err = f.read()
    except FileNotFoundError:
        err = ""
    # srun: error: n2: task 1: Killed  /  srun: error: n1: task 0: Exited with exit code 3
    found = re.findall(r"error: (\S+): task (\d+): (.+)", err)
    if not found:
        return f"{kind} died (step exit {rc})"
    # The first: srun kills the step's other tasks after it (--kill-on-bad-exit), "Killed" too.
    node, index, message = found[0]
    name = kind if kind in ("master", "gserver_manager") else f"{kind}/{index}"
    return f"{name} {whys.get(name, f'died (srun: {message.strip()})')} (on {node})"


def submit_and_watch(cfg: ExperimentConfig, alloc: AllocationMode, config_path: str, secret_path: str,
                     env: dict) -> int:
    """Exit codes like the local scheduler: 0 done, 1 a worker failed (recover_mode=auto: once the
    resubmissions are used up), 75 preempted, 130 interrupted."""
    slurm_dir = os.path.join(cfg.output_dir, "slurm")
    os.makedirs(slurm_dir, exist_ok=True)
    script = sbatch_script(cfg, alloc, config_path, secret_path)
    path = os.path.join(slurm_dir, "job.sbatch")
    with open(path, "w") as f:
        f.write(script)
    signals: list[int] = []
    old = {s: signal.signal(s, lambda signum, frame: signals.append(signum)) for s in (signal.SIGINT, signal.SIGTERM)}
    follow = Follow(os.path.join(cfg.output_dir, "logs", "master.out"))
    attempt, restarts = 0, 0
    try:
        while True:
            for stale in ("status", "stop", "attempt"):  # from an earlier job of this output_dir
                if os.path.exists(os.path.join(slurm_dir, stale)):
                    os.remove(os.path.join(slurm_dir, stale))
            job_id = _run(["sbatch", "--parsable", path, str(attempt)], env=env).strip().split(";")[0]
            _write_job_id(slurm_dir, job_id)
            print(f"realcore: submitted Slurm job {job_id} ({path}, attempt {attempt}); logs in "
                  f"{os.path.join(cfg.output_dir, 'logs')}", flush=True)
            rc, why = follow_job(cfg, job_id, attempt, follow, signals)
            if rc != 1:
                return rc
            attempt = _attempt_of(slurm_dir, attempt) + 1
            if why is None:
                return 1
            if cfg.recover_mode != "auto" or restarts == cfg.recover_retries:
                if cfg.recover_mode == "auto":
                    print(f"realcore: giving up after {restarts} resubmissions (recover_retries={cfg.recover_retries})",
                          file=sys.stderr)
                record(cfg.output_dir, attempt - 1, why.split()[0], why, "give up")
                return 1
            restarts += 1
            record(cfg.output_dir, attempt - 1, why.split()[0], why, "restart run")
            print(f"realcore: submitting the job again in {cfg.recover_delay_s:g} s; it resumes from its last recover "
                  f"checkpoint (restart {restarts} of {cfg.recover_retries})", file=sys.stderr, flush=True)
            deadline = time.monotonic() + cfg.recover_delay_s
            while time.monotonic() < deadline and not signals:
                time.sleep(0.2)
            if signals:
                return 130 if signals[0] == signal.SIGINT else PREEMPTED_EXIT
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def _write_job_id(slurm_dir: str, job_id: str) -> None:
    """OUTPUT_DIR/slurm/job_id, for the next launch's refuse_live_job (whole or absent: renamed in)."""
    tmp = os.path.join(slurm_dir, f".job_id-{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(job_id + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(slurm_dir, "job_id"))


def _attempt_of(slurm_dir: str, default: int) -> int:
    """The attempt the job last ran as (its `begin` step notes it; a requeue adds one)."""
    try:
        with open(os.path.join(slurm_dir, "attempt")) as f:
            return int(f.read())
    except (FileNotFoundError, ValueError):
        return default


def follow_job(cfg: ExperimentConfig, job_id: str, attempt: int, follow: Follow,
               signals: list[int]) -> tuple[int, str | None]:
    """Follow one job (submitted as `attempt`) to its end, through requeues: (0 | 75 | 130, None),
    or (1, why) — why None when the job was cancelled from outside (not to be restarted)."""
    slurm_dir = os.path.join(cfg.output_dir, "slurm")
    preempt_deadline: float | None = None
    seen = read_status(slurm_dir)
    while True:
        follow.poll()
        if signals and (signals[0] == signal.SIGINT or len(signals) > 1):
            print(f"realcore: {signal.Signals(signals[-1]).name}: cancelling job {job_id}", file=sys.stderr)
            cancel(cfg, job_id)
            return 130, None
        state = job_state(job_id)
        if signals and preempt_deadline is None:
            preempt_deadline = time.monotonic() + cfg.system.preempt_timeout_s
            _preempt(cfg, job_id, state)
        if preempt_deadline is not None and time.monotonic() > preempt_deadline:
            print(f"realcore: no recover checkpoint within {cfg.system.preempt_timeout_s:g} s; cancelling job {job_id} "
                  "(the last recover checkpoint holds the run)", file=sys.stderr)
            cancel(cfg, job_id)
            return PREEMPTED_EXIT, None
        status = read_status(slurm_dir)
        if status != seen:
            _report(job_id, attempt, status)
            seen = status
        if state is None or state not in ACTIVE:
            break
        time.sleep(cfg.slurm.poll_interval_s)
    follow.poll()
    status = read_status(slurm_dir)
    if state == "COMPLETED":  # the batch script exits 0 only after the master did
        return 0, None
    if status[:1] == ["preempted"] or preempt_deadline is not None:
        cancel(cfg, job_id)
        print(f"realcore: preempted; Slurm job {job_id} ended {state} (exit code {PREEMPTED_EXIT}); a recover "
              "checkpoint holds the run: run the same command again with recover_mode=resume (or auto) to continue",
              file=sys.stderr)
        return PREEMPTED_EXIT, None
    who = failed_worker(slurm_dir)
    cancel(cfg, job_id)  # a job that failed may still be tearing down
    if state == "CANCELLED" and status[:1] != ["failed"]:
        print(f"realcore: Slurm job {job_id} was cancelled (scancel?); not restarting it", file=sys.stderr)
        return 1, None
    print(f"realcore: {who or 'a worker died'}; Slurm job {job_id} ended {state} and was cancelled", file=sys.stderr)
    log = _worker_log(cfg.output_dir, who)
    if log:
        print(f"realcore: last lines of {log}:\n{tail(log)}", file=sys.stderr)
    return 1, who or f"job {job_id} ended {state}"


def _preempt(cfg: ExperimentConfig, job_id: str, state: str | None) -> None:
    """SIGTERM to the launcher: a preemption of the job that does not requeue it."""
    with open(os.path.join(cfg.output_dir, "slurm", "stop"), "w") as f:
        f.write("the launcher got SIGTERM: do not requeue\n")
    if state != "RUNNING":  # nothing runs yet, or it is ending anyway
        print(f"realcore: SIGTERM: cancelling job {job_id} ({state})", file=sys.stderr, flush=True)
        subprocess.run(["scancel", job_id], capture_output=True, timeout=30)
        return
    print(f"realcore: SIGTERM: the master writes a recover checkpoint after its current step (deadline "
          f"{cfg.system.preempt_timeout_s:g} s), then job {job_id} ends", file=sys.stderr, flush=True)
    subprocess.run(["scancel", "--signal=TERM", job_id], capture_output=True, timeout=30)


def _report(job_id: str, attempt: int, status: list[str]) -> None:
    if status[:1] == ["requeued"]:
        print(f"realcore: Slurm job {job_id} was preempted and requeued; it resumes from its recover checkpoint when "
              "Slurm starts it again", file=sys.stderr, flush=True)
    elif status[:1] == ["running"] and status[1:2] != [str(attempt)]:
        print(f"realcore: Slurm started job {job_id} again (attempt {status[1]}); it resumes from its recover "
              "checkpoint", file=sys.stderr, flush=True)


def _worker_log(output_dir: str, who: str | None) -> str | None:
    if not who or "/" not in who.split()[0]:
        return None
    kind, index = who.split()[0].split("/")
    path = os.path.join(output_dir, "logs", f"{kind}-{index}.log")
    return path if os.path.exists(path) else None


def cancel(cfg: ExperimentConfig, job_id: str) -> None:
    """scancel, then wait (bounded) until squeue no longer lists the job. The status says the job
    ends first: the task runners then stop their workers at Slurm's SIGTERM, not after KillWait."""
    status = os.path.join(cfg.output_dir, "slurm", "status")
    if read_status(os.path.dirname(status))[:1] in (["running"], ["requeued"]):
        with open(status, "w") as f:
            f.write("cancelled\n")
    subprocess.run(["scancel", job_id], capture_output=True, timeout=30)
    timeout_s = cfg.slurm.cancel_timeout_s
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        out = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%T"], capture_output=True, text=True, timeout=30)
        if out.returncode != 0 or not out.stdout.strip():
            return
        time.sleep(0.5)
    print(f"realcore: job {job_id} still listed by squeue {timeout_s:g} s after scancel", file=sys.stderr)
