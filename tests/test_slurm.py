"""scheduler=slurm against a real Slurm: a throw-away 4-node cluster on this host
(launch/slurm_test_cluster.sh: munge, slurmctld, 4 slurmd), jobs submitted with sbatch.

The dry run needs no Slurm. The cluster tests skip with the reason when the Slurm binaries are
not installed or this is not root (CI installs the Debian packages; see .ci/run).
"""

import glob
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(REPO, "launch", "slurm_test_cluster.sh")
# 2 model workers + 1 server + manager + 2 rollout workers + master = 7 tasks over 4 nodes
RUN = ["experiment=async-ppo-math", "model=tiny", "scheduler=slurm", "slurm.nodes=4", "slurm.poll_interval_s=0.5",
       "allocation_mode=local.d1+d2", "rollout.n_workers=2"]


def launch_cmd(out, *overrides, cache):
    return [sys.executable, "-m", "realcore.launch", *RUN, f"output_dir={out}", f"model.cache_dir={cache}", *overrides]


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return str(tmp_path_factory.mktemp("model-cache"))


def test_dry_run_prints_the_job(tmp_path, cache):
    r = subprocess.run(launch_cmd(str(tmp_path), "slurm.partition=gpu", "slurm.gpus_per_node=8",
                                  "slurm.setup=[module load cuda]", "--dry-run", cache=cache),
                       cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    script = r.stdout
    for line in ("#SBATCH --ntasks=7", "#SBATCH --nodes=4", "#SBATCH --partition=gpu", "#SBATCH --gpus-per-node=8",
                 "module load cuda"):
        assert line in script, script
    for kind, n in (("model_worker", 2), ("gen_server", 1), ("gserver_manager", 1), ("rollout_worker", 2), ("master", 1)):
        step = next(x for x in script.splitlines() if x.startswith(f"start {kind} srun"))
        assert f"--ntasks={n}" in step and f"--type {kind}" in step, step
        assert ("--gpus-per-task=1" in step) == (kind in ("model_worker", "gen_server")), step
    assert not os.path.exists(tmp_path / "metrics.jsonl")


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    missing = [b for b in ("sbatch", "slurmctld", "slurmd", "munged") if shutil.which(b) is None]
    if missing:
        pytest.skip(f"Slurm is not installed ({', '.join(missing)} missing): apt-get install slurmctld slurmd slurm-client munge")
    if os.geteuid() != 0:
        pytest.skip("the test cluster's slurmd must run as root")
    d = str(tmp_path_factory.mktemp("slurm"))
    r = subprocess.run(["bash", SCRIPT, "up", d], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    os.environ["SLURM_CONF"] = r.stdout.strip().splitlines()[-1]
    yield d
    subprocess.run(["bash", SCRIPT, "down", d], capture_output=True, timeout=120)
    os.environ.pop("SLURM_CONF", None)


def squeue() -> str:
    return subprocess.run(["squeue", "-h"], capture_output=True, text=True, timeout=30).stdout.strip()


def worker_pids(out) -> dict[str, int]:
    pids = {}
    for path in glob.glob(f"{out}/.name_resolve/**/.value", recursive=True):
        try:
            pids[os.path.relpath(os.path.dirname(path), f"{out}/.name_resolve")] = json.load(open(path))["pid"]
        except (ValueError, KeyError, TypeError):
            pass  # not a worker's address (e.g. the process-group rendezvous)
    return pids


def assert_gone(pids: dict[str, int], timeout=20):
    deadline = time.time() + timeout
    alive = lambda p: os.path.exists(f"/proc/{p}") and open(f"/proc/{p}/stat").read().split(")")[-1].split()[0] != "Z"
    while time.time() < deadline and any(alive(p) for p in pids.values()):
        time.sleep(0.3)
    assert not [n for n, p in pids.items() if alive(p)], f"left behind: {pids}"


def wait_for_metrics(out, proc, timeout=180):
    deadline = time.time() + timeout
    while time.time() < deadline:
        assert proc.poll() is None, proc.communicate()
        if os.path.exists(f"{out}/metrics.jsonl") and open(f"{out}/metrics.jsonl").read().strip():
            return
        time.sleep(0.5)
    raise AssertionError("no metrics in time")


@pytest.mark.timeout(400)
def test_async_ppo_math_across_4_nodes(slurm, tmp_path, cache):
    out = str(tmp_path / "run")
    r = subprocess.run(launch_cmd(out, "trainer.total_steps=3", cache=cache), cwd=REPO, capture_output=True,
                       text=True, timeout=360)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "submitted Slurm job" in r.stdout and "step 3/3" in r.stdout  # the master's output reaches the console
    assert len(open(f"{out}/metrics.jsonl").read().splitlines()) == 3
    nodes = set()
    for log in glob.glob(f"{out}/logs/*.log"):
        for line in open(log):
            if " on node " in line:
                nodes.add(line.split(" on node ")[1].split()[0])
    assert len(nodes) >= 2, nodes  # the workers really were spread over the virtual nodes
    assert squeue() == ""
    assert open(f"{out}/slurm/status").read().strip() == "done"


@pytest.mark.timeout(400)
def test_killed_worker_cancels_the_job_and_is_named(slurm, tmp_path, cache):
    out = str(tmp_path / "run")
    proc = subprocess.Popen(launch_cmd(out, "trainer.total_steps=1000", cache=cache), cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for_metrics(out, proc)
        pids = worker_pids(out)
        os.kill(pids["async-ppo-math/trial0/model_worker/1"], signal.SIGKILL)
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 1, err[-3000:]
    assert "realcore: model_worker/1 (on n" in err and "died; Slurm job" in err, err[-3000:]
    assert squeue() == ""
    assert_gone(pids)


@pytest.mark.timeout(400)
def test_interrupt_cancels_the_job(slurm, tmp_path, cache):
    out = str(tmp_path / "run")
    proc = subprocess.Popen(launch_cmd(out, "trainer.total_steps=1000", cache=cache), cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for_metrics(out, proc)
        pids = worker_pids(out)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 130, err[-3000:]
    assert squeue() == ""
    assert_gone(pids)
