"""What the cluster schedulers (slurm.py, ray_scheduler.py) share: the task runner, which watches one
worker process on the node where it runs, and the set-up of each whole-run start.

The task runner (`python -m realcore.launch.cluster run [--restart] -- RUN_WORKER_ARGS`, or
`run_task` inside a Ray task) starts `python -m realcore.launch.run_worker RUN_WORKER_ARGS` as its
child and watches it as the local launcher watches its children (supervise.py), next to it:
- Hangs: a child whose heartbeat file (`OUTPUT_DIR/.heartbeat/NAME`, on the shared filesystem) is
  older than `system.heartbeat_timeout_s` gets SIGUSR1 (faulthandler writes its stacks to its
  log) and SIGCONT, then SIGKILL. The runner holds the child's process, so exactly that process is
  signalled (a launcher on a login node could only signal a whole Slurm step, or look pids up by
  name, which generation servers and rollout workers do not publish), and this works while no
  launcher follows the job (a requeued job, a login node that went away).
- With `--restart` (rollout-side processes, unless recover_mode=disabled) a dead or hung child is
  started again with the same arguments (same type, index and --attempt) and the restart appended
  to `OUTPUT_DIR/restarts.jsonl`; one that died more than `recover_retries` times in a row within
  a minute of starting (a crash loop) ends the task. Otherwise the runner ends as its child did
  (exit code, or 128 + the signal), and writes why to `--why-dir` (the Slurm launcher reads it).
- `--shield-term` (Slurm): Slurm sends SIGTERM to every process of a step (`scancel
  --signal=TERM JOB`, Slurm's preemption, a cancel, the end of the job), and a realcore worker
  exits on SIGTERM. The child starts with SIGTERM blocked, and ignores it (`run_worker
  --ignore-sigterm`: the blocked mask alone does not hold, Python's multiprocessing unblocks it
  when it starts its resource tracker), so no worker dies before the master's recover checkpoint
  is written; the runner takes the TERM itself. While the job runs (`--status-file` says `running`) it is a preemption:
  the master's runner sends its child SIGUSR2 (finish the step, write a recover checkpoint, exit
  75), the others keep going until the master tells their child to exit. Once the batch script
  has written that the job ends, the runner kills its child and leaves.
- `preempt_file` (Ray): the launcher's SIGTERM arrives as a file; the master's runner then sends
  SIGUSR2 as above.

`python -m realcore.launch.cluster begin --config C --attempt N` runs at each start of a Slurm job
(a requeue included): it clears what an earlier attempt left (supervise.begin_attempt) and notes
the attempt for the launcher.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from typing import Callable

from realcore.api.config import ExperimentConfig
from realcore.launch.local import Proc, describe_exit, dump_stacks_and_kill, spawn_command, stop_all
from realcore.launch.supervise import (ROLLOUT_SIDE, STABLE_S, begin_attempt, count_quick_death, heartbeat_path, hung,
                                       last_beat, record)
from realcore.launch.process import PREEMPTED_EXIT, run_and_exit
from realcore.transport.name_resolve import make_name_resolver

POLL_S = 0.5


def worker_name(kind: str, index: int) -> str:
    return kind if kind in ("master", "gserver_manager") else f"{kind}/{index}"


def run_task(cfg: ExperimentConfig, argv: list[str], *, name: str, attempt: int, restart: bool,
             env: dict | None = None, log_path: str | None = None, shield_term: bool = False,
             job_ending: Callable[[], bool] | None = None, preempt_file: str | None = None) -> tuple[int, str]:
    """Run the worker command `argv` until it ends for good; (exit code, why) — why is "" when it
    ended as it should (exit 0; the master's 75 after a preemption) or with its job.
    `job_ending()` (Slurm): true once the job is ending, when a SIGTERM is the end, not a preemption.
    `preempt_file` (Ray): once it exists, the run is preempted as by a SIGTERM."""
    kind = name.split("/")[0]
    preempted = False
    if shield_term:
        # Blocked here and so in every child started from here on; sigtimedwait below takes it.
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
        # `scancel --signal=USR1 JOB` dumps every worker's stacks: it must not kill the runners.
        signal.signal(signal.SIGUSR1, lambda signum, frame: None)
    proc = spawn_command(name, argv, env=env if env is not None else dict(os.environ), log_path=log_path)
    try:
        quick_deaths: dict[str, int] = {}
        while True:
            # Seen before a SIGTERM: Slurm's SIGCONT at the job's end resumes a stopped worker, whose
            # heartbeat thread may beat before we look again.
            beat = last_beat(cfg.output_dir, name)
            if not shield_term:
                time.sleep(POLL_S)
            elif signal.sigtimedwait({signal.SIGTERM}, POLL_S) is not None:
                if job_ending is not None and job_ending():  # the job ends: nothing to wait for
                    return _end_with_job(cfg, proc, name, beat)
                _preempt(proc, kind)
            if preempt_file is not None and not preempted and os.path.exists(preempt_file):
                preempted = True
                _preempt(proc, kind)
            rc = proc.popen.poll()
            if rc == 0 or (kind == "master" and rc == PREEMPTED_EXIT):
                return rc, ""
            why = f"died ({describe_exit(rc)})" if rc is not None else hung(cfg, name, proc.started, time.monotonic())
            if why is None:
                continue
            if rc is None:  # a hang is news even when the job ends (it may be why the job ends)
                dump_stacks_and_kill(proc)
            elif job_ending is not None and job_ending():  # it died with its job (a peer that went away)
                return _code(rc), ""
            rc = proc.popen.returncode
            if not restart:
                return _code(rc), why
            if count_quick_death(quick_deaths, name, proc.started) > cfg.recover_retries:
                return _code(rc), f"{why}; it died {quick_deaths[name]} times within {STABLE_S:g} s of starting"
            print(f"realcore: {name} {why}; restarting it (training goes on)", file=sys.stderr, flush=True)
            record(cfg.output_dir, attempt, name, why, "restart in place")
            try:
                os.remove(heartbeat_path(cfg.output_dir, name))
            except FileNotFoundError:
                pass
            proc.restart()
    except KeyboardInterrupt:
        # Ray cancels a task without force at the end of a run (ray_scheduler._cancel): the worker
        # is stopped as the local launcher stops it (SIGTERM, SIGKILL past the grace), not left to
        # PDEATHSIG.
        stop_all([proc], cfg.system.shutdown_timeout_s)
        raise


def _end_with_job(cfg: ExperimentConfig, proc: Proc, name: str, beat: float | None) -> tuple[int, str]:
    """Stop the worker of a job that ends. One silent for half the heartbeat deadline (`beat`: its
    last heartbeat seen before the job's SIGTERM) is probably why the job ends (its peers lost it
    and failed first): its stacks are dumped, and it is named."""
    why = hung(cfg, name, proc.started, time.monotonic(), margin=0.5, beat=beat)
    if why is not None:
        dump_stacks_and_kill(proc)
    else:
        proc.popen.kill()
    return _code(proc.popen.wait()), why or ""


def _preempt(proc: Proc, kind: str) -> None:
    if kind == "master":
        print("realcore: SIGTERM (preemption): the master finishes its step, writes a recover checkpoint and exits 75",
              file=sys.stderr, flush=True)
        proc.popen.send_signal(signal.SIGUSR2)
    else:
        print("realcore: SIGTERM (preemption): kept running until the master's recover checkpoint is written",
              file=sys.stderr, flush=True)


def _code(rc: int) -> int:
    """A runner's exit code for its child's: the same, or 128 + N for a child killed by signal N."""
    return 128 - rc if rc < 0 else rc


def why_path(why_dir: str, name: str) -> str:
    return os.path.join(why_dir, "why-" + name.replace("/", "-"))


def _read_config(path: str) -> ExperimentConfig:
    with open(path) as f:
        return ExperimentConfig.model_validate_json(f.read())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("begin", help="a whole-run start (each start of a Slurm job)")
    b.add_argument("--config", required=True)
    b.add_argument("--attempt", type=int, required=True)
    b.add_argument("--note", help="write the attempt to this file (the launcher reads it)")
    r = sub.add_parser("run", help="run one worker (the arguments after -- go to realcore.launch.run_worker)")
    r.add_argument("--restart", action="store_true", help="restart the worker in place when it dies or hangs")
    r.add_argument("--shield-term", action="store_true", help="SIGTERM means preemption (Slurm)")
    r.add_argument("--status-file", help="the batch script's status: SIGTERM ends the task once it says the job ends")
    r.add_argument("--why-dir", help="write why the worker failed into this folder")
    r.add_argument("worker_args", nargs=argparse.REMAINDER)
    args = p.parse_args(argv)
    if args.cmd == "begin":
        return begin(_read_config(args.config), args.attempt, args.note)

    worker_args = args.worker_args[1:] if args.worker_args[:1] == ["--"] else args.worker_args
    w = argparse.ArgumentParser(add_help=False)
    for flag in ("--type", "--config", "--index-from"):
        w.add_argument(flag)
    w.add_argument("--index", type=int, default=0)
    w.add_argument("--attempt", type=int, default=0)
    known, _ = w.parse_known_args(worker_args)
    index = int(os.environ[known.index_from]) if known.index_from else known.index
    if known.index_from:  # the same index on every restart, and visible in `ps`
        i = worker_args.index("--index-from")
        worker_args = worker_args[:i] + ["--index", str(index)] + worker_args[i + 2:]
    cfg = _read_config(known.config)
    name = worker_name(known.type, index)
    shield = ["--ignore-sigterm"] if args.shield_term else []
    rc, why = run_task(cfg, [sys.executable, "-m", "realcore.launch.run_worker", *worker_args, *shield], name=name,
                       attempt=known.attempt,
                       restart=args.restart and known.type in ROLLOUT_SIDE, shield_term=args.shield_term,
                       job_ending=(lambda: _job_ending(args.status_file)) if args.status_file else None)
    if why:
        print(f"realcore: {name} {why}", file=sys.stderr, flush=True)
        if args.why_dir:
            with open(why_path(args.why_dir, name), "w") as f:
                f.write(f"{name} {why}\n")
    return rc


def _job_ending(status_file: str) -> bool:
    """The batch script says `running N` until the job ends (done, failed, preempted, requeued)."""
    try:
        with open(status_file) as f:
            return f.read().split()[:1] != ["running"]
    except FileNotFoundError:
        return False


def begin(cfg: ExperimentConfig, attempt: int, note: str | None) -> int:
    begin_attempt(cfg, make_name_resolver(cfg.system.name_resolve))
    restarts = int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0)
    if restarts:  # Slurm started this job again (a requeue after preemption, or a node failure)
        why = f"requeued by Slurm (restart {restarts} of the job)"
        record(cfg.output_dir, attempt, "job", why, "resume after requeue")
    if note:
        with open(note, "w") as f:
            f.write(f"{attempt}\n")
    return 0


class Follow:
    """Copies the new whole lines of a growing file (the master's output) to stdout."""

    def __init__(self, path: str):
        self.path, self.pos = path, 0

    def poll(self) -> None:
        try:
            with open(self.path, "rb") as f:
                if os.fstat(f.fileno()).st_size < self.pos:  # truncated: a new file
                    self.pos = 0
                f.seek(self.pos)
                chunk = f.read()
        except FileNotFoundError:
            return
        end = chunk.rfind(b"\n") + 1
        if end:
            sys.stdout.write(chunk[:end].decode(errors="replace"))
            sys.stdout.flush()
            self.pos += end


if __name__ == "__main__":
    run_and_exit(main)
