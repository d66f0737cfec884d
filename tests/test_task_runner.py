"""The cluster task runner (realcore/launch/cluster.py) without a cluster: a real runner process and
its real worker process, with the signals Slurm sends when a job ends."""

import os
import signal
import subprocess
import sys
import time

import psutil

RUNNER = """
import sys
from realcore.api.config import ExperimentConfig, MFCConfig
from realcore.launch.cluster import run_task
from realcore.launch.supervise import heartbeat_path

out, status = sys.argv[1], sys.argv[2]
cfg = ExperimentConfig(experiment_name="runner", trial_name="t", output_dir=out, mfcs=[MFCConfig(name="n", type="t")],
                       system={"heartbeat_interval_s": 0.2, "heartbeat_timeout_s": 4.0})
worker = [sys.executable, "-c", "import sys, time; from realcore.launch.process import start_heartbeat; "
          "start_heartbeat(sys.argv[1], 0.2); time.sleep(600)", heartbeat_path(out, "model_worker/1")]
rc, why = run_task(cfg, worker, name="model_worker/1", attempt=0, restart=False, shield_term=True,
                   job_ending=lambda: open(status).read().split()[:1] != ["running"])
print(rc, why, flush=True)
"""


def test_a_stopped_worker_is_named_when_slurms_sigcont_wakes_it_at_the_job_end(tmp_path):
    """A SIGSTOPped model worker makes its peers fail; the job ends and Slurm sends SIGCONT, then
    SIGTERM, to every process of the step. The resumed worker's heartbeat thread may beat before its
    runner looks: the runner must judge by the heartbeat it saw before the SIGTERM."""
    os.makedirs(tmp_path / ".heartbeat")
    status = tmp_path / "status"
    status.write_text("running 0\n")
    runner = subprocess.Popen([sys.executable, "-c", RUNNER, str(tmp_path), str(status)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        beat = tmp_path / ".heartbeat" / "model_worker-1"
        deadline = time.monotonic() + 60
        while not beat.exists():
            assert time.monotonic() < deadline and runner.poll() is None, runner.stderr.read()
            time.sleep(0.1)
        worker = psutil.Process(runner.pid).children()[0]
        worker.send_signal(signal.SIGSTOP)
        time.sleep(3.0)  # over half the 4 s deadline (the job-end judgement), under all of it (the runner's own)
        runner.send_signal(signal.SIGSTOP)
        status.write_text("failed master 1\n")
        resumed = time.time()
        worker.send_signal(signal.SIGCONT)  # Slurm: SIGCONT, then SIGTERM, to the step's processes
        while beat.stat().st_mtime < resumed:  # the worker's heartbeat thread beats again
            assert time.time() - resumed < 30
            time.sleep(0.05)
        runner.send_signal(signal.SIGTERM)
        runner.send_signal(signal.SIGCONT)
        out, err = runner.communicate(timeout=30)
    finally:
        runner.kill()
    assert runner.returncode == 0, err
    rc, why = out.split(" ", 1)
    assert why.startswith("hung (no heartbeat for"), out + err
    assert not psutil.pid_exists(worker.pid) or worker.status() == psutil.STATUS_ZOMBIE


WORKING = """
import faulthandler, os, signal, sys, time
faulthandler.register(signal.SIGUSR1, all_threads=True)
n = 0
while True:  # one unit of work every 10 ms, each written down (replaced whole: never read half-written)
    n += 1
    with open(sys.argv[1] + ".tmp", "w") as f:
        f.write(str(n))
    os.replace(sys.argv[1] + ".tmp", sys.argv[1])
    time.sleep(0.01)
"""


def test_a_hung_worker_is_killed_once_its_stacks_are_written(tmp_path):
    """SIGCONT, sent so that a stopped worker can dump its stacks, also lets it work again: it must
    be killed as soon as the stacks are in its log, not after a fixed wait (a stopped generation
    server served 30 training steps in the 2 s the launcher used to wait)."""
    from realcore.launch.local import dump_stacks_and_kill, spawn_command

    work, log = tmp_path / "work", tmp_path / "worker.log"
    p = spawn_command("gen_server/0", [sys.executable, "-c", WORKING, str(work)], env=dict(os.environ), log_path=str(log))
    try:
        deadline = time.monotonic() + 30
        while not (work.exists() and int(work.read_text()) > 5):
            assert time.monotonic() < deadline and p.popen.poll() is None, log.read_text()
            time.sleep(0.05)
        p.popen.send_signal(signal.SIGSTOP)
        time.sleep(0.2)
        stopped_at = int(work.read_text())
        dump_stacks_and_kill(p, wait_s=2.0)
    finally:
        p.popen.kill()
    assert p.popen.returncode == -signal.SIGKILL
    assert "most recent call first" in log.read_text()
    assert int(work.read_text()) - stopped_at < 50, "the resumed worker went on working"  # 2 s: ~200
