"""scheduler=ray on a 3-node Ray cluster faked on this host (ray.cluster_utils.Cluster).

Ray is an optional extra (`pip install -e ".[ray]"`): skipped with the reason when absent (a failure
under CI, which installs it).
"""

import datetime
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from conftest import import_unless_ci  # noqa: E402

ray = import_unless_ci("ray", "Ray is an optional extra: pip install -e '.[ray]'")

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def cluster():
    from ray.cluster_utils import Cluster

    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    mem = 80 * 1024 * 1024  # a small object store per node: the workers pass nothing through it
    # Loopback only: without node_ip_address Ray binds (and the driver connects to) the host's address.
    node = {"num_cpus": 2, "object_store_memory": mem, "node_ip_address": "127.0.0.1"}
    c = Cluster(initialize_head=True, head_node_args=node)
    for _ in range(2):
        c.add_node(**node)
    c.wait_for_nodes()
    yield c
    c.shutdown()


@pytest.mark.timeout(400)
def test_ppo_math_on_3_ray_nodes(cluster, tmp_path):
    out = str(tmp_path / "run")
    cmd = [sys.executable, "-m", "realcore.launch", "experiment=ppo-math", "model=tiny", "scheduler=ray",
           f"ray.address={cluster.address}", "trainer.total_steps=2", "trainer.batch_size=4", "generation.n_samples=2",
           f"output_dir={out}", f"model.cache_dir={tmp_path}/cache"]
    r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=360)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rows = [json.loads(x) for x in open(os.path.join(out, "metrics.jsonl"))]
    assert [m["version"] for m in rows] == [1, 2]
    assert os.path.exists(os.path.join(out, "checkpoints", "step_2", "model.safetensors"))


@pytest.mark.timeout(400)
def test_a_script_loop_is_the_runs_master(cluster, tmp_path):
    """examples/grpo_loop.py under scheduler=ray: the master's task runs the script."""
    out = str(tmp_path / "run")
    cmd = [sys.executable, "examples/grpo_loop.py", "model=tiny", "scheduler=ray", f"ray.address={cluster.address}",
           "trainer.total_steps=2", "trainer.batch_size=4", "generation.n_samples=2", f"output_dir={out}",
           f"model.cache_dir={tmp_path}/cache"]
    r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=360)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "step 2: reward" in r.stdout  # the script's own print, from the master's task
    assert [json.loads(x)["version"] for x in open(os.path.join(out, "metrics.jsonl"))] == [1, 2]


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.timeout(400)
def test_killed_worker_is_named_and_the_rest_stop(cluster, tmp_path):
    out = str(tmp_path / "run")
    cmd = [sys.executable, "-m", "realcore.launch", "experiment=ppo-math", "model=tiny", "scheduler=ray",
           f"ray.address={cluster.address}", "trainer.total_steps=1000", f"output_dir={out}",
           f"model.cache_dir={tmp_path}/cache"]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 180
        while not (os.path.exists(f"{out}/metrics.jsonl") and open(f"{out}/metrics.jsonl").read()):
            assert proc.poll() is None and time.time() < deadline, proc.communicate()
            time.sleep(0.5)
        from realcore.api.config import ExperimentConfig
        from realcore.transport import keys as rc_keys

        cfg = ExperimentConfig.model_validate_json(open(f"{out}/config.json").read())
        pids = {i: json.loads(open(f"{out}/.name_resolve/{rc_keys.model_worker(cfg, i)}/.value").read().partition("\n")[2])["pid"] for i in (0, 1)}
        os.kill(pids[1], signal.SIGKILL)
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 1, err[-3000:]
    assert "realcore: model_worker/1 died" in err, err[-3000:]
    deadline = time.time() + 20  # the other worker dies with its cancelled Ray task (PDEATHSIG)
    while time.time() < deadline and _alive(pids[0]):
        time.sleep(0.3)
    assert not _alive(pids[0])


# Recovery: async-ppo-math with recover_mode=auto and a recover checkpoint every 2 steps; 7 tasks of
# half a CPU each on the 6 CPUs of the fake cluster.
def launch_async(cluster, tmp_path, *overrides, env=None):
    out = str(tmp_path / "run")
    cmd = [sys.executable, "-m", "realcore.launch", "experiment=async-ppo-math", "eval.freq_steps=null", "model=tiny", "dataset=tiny-arith",
           "scheduler=ray", f"ray.address={cluster.address}", "ray.cpus_per_worker=0.5", "allocation_mode=local.d1+d2",
           "rollout.n_workers=2", "recover_mode=auto", "recover_delay_s=1", "trainer.recover_freq_steps=2",
           "trainer.batch_size=4", "generation.n_samples=2", "generation.max_new_tokens=8",
           "rollout.max_head_offpolicyness=2", f"trial_name={tmp_path.name}", f"output_dir={out}",
           f"model.cache_dir={tmp_path.parent}/ray-cache", *overrides]
    return out, subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


@pytest.mark.timeout(300)
def test_rollout_side_tasks_are_resubmitted(cluster, tmp_path):
    """SIGKILL the rollout workers and the manager, SIGSTOP the generation server (a hang: its task
    runner dumps its stacks and kills it): each task is submitted again while the trainer keeps its
    processes."""
    from test_slurm import assert_ledger_exact, break_rollout_side, metric_rows, restarts

    out, proc = launch_async(cluster, tmp_path, "trainer.total_steps=60", "system.heartbeat_timeout_s=10")
    try:
        before, trainer, after, stdout, err = break_rollout_side(out, proc)
    finally:
        proc.kill()
    assert proc.returncode == 0, stdout[-2000:] + err[-3000:]
    assert {n: after.get(n) for n in trainer} == trainer  # the master and model workers were never restarted
    rows = restarts(out)
    assert [(r["who"], r["action"]) for r in rows] == [
        (n, "restart in place") for n in ("rollout_worker/0", "gen_server/0", "gserver_manager", "rollout_worker/1")]
    assert [r["why"] for r in rows if r["who"] != "gen_server/0"] == ["died (killed by SIGKILL)"] * 3, rows
    assert rows[1]["why"].startswith("hung (no heartbeat"), rows[1]
    assert "most recent call first" in open(f"{out}/logs/gen_server-0.log").read()  # its stacks, dumped
    assert "restarting its Ray task" in err and metric_rows(out) == 60
    print(f"restarts: {[r['who'] for r in rows]}; audit: {assert_ledger_exact(out)}")


@pytest.mark.timeout(300)
def test_killed_model_worker_restarts_the_run(cluster, tmp_path):
    from test_slurm import assert_ledger_exact, metric_rows, restarts, running_workers, wait_rows

    out, proc = launch_async(cluster, tmp_path, "trainer.total_steps=30", "system.shutdown_timeout_s=20")
    try:
        wait_rows(out, 3, proc)  # past the recover checkpoint of step 2
        os.kill(running_workers(out)["model_worker/1"], signal.SIGKILL)
        stdout, err = proc.communicate(timeout=240)
        ended = time.time()
    finally:
        proc.kill()
    assert proc.returncode == 0, stdout[-2000:] + err[-3000:]
    # The end: the rollout side is stopped at once (SIGTERM through its task runner), not waited
    # for until the shutdown grace (20 s) runs out.
    last = open(f"{out}/logs/master.log").read().splitlines()[-1]
    lag = ended - datetime.datetime.strptime(last[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp()
    assert lag < 10, (lag, last)
    assert "realcore: model_worker/1 died (killed by SIGKILL)" in err and "restarting the run" in err, err[-3000:]
    resumed = int(stdout.split("resuming from step ")[1].split()[0])  # the master's output reaches the console
    assert resumed >= 2 and resumed % 2 == 0, stdout[-3000:]
    assert [(r["who"], r["action"], r["attempt"]) for r in restarts(out)] == [("model_worker/1", "restart run", 0)]
    assert metric_rows(out) == 30
    print(f"resumed from step {resumed}; audit: {assert_ledger_exact(out)}")


@pytest.mark.timeout(300)
def test_sigterm_preempts_the_run(cluster, tmp_path):
    """SIGTERM to the launcher: the master writes a recover checkpoint after its step, every task
    ends, the launcher exits 75."""
    from test_slurm import assert_gone, metric_rows, running_workers, wait_rows

    out, proc = launch_async(cluster, tmp_path, "trainer.total_steps=1000")
    try:
        wait_rows(out, 3, proc)
        pids = running_workers(out)
        proc.send_signal(signal.SIGTERM)
        stdout, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 75, stdout[-2000:] + err[-3000:]
    step = int(stdout.split("preempted after step ")[1].split(":")[0])
    assert os.path.exists(f"{out}/recover/step_{step}") and metric_rows(out) == step, stdout[-2000:]
    assert "realcore: preempted" in err, err[-2000:]
    assert_gone(pids)


@pytest.mark.timeout(300)
def test_hung_model_worker_is_named_with_its_stacks(cluster, tmp_path):
    """SIGSTOP a model worker: the master loses it and fails first, yet the hung worker is named
    and its task runner dumps its stacks (recover_mode=disabled: exit 1)."""
    from test_slurm import assert_gone, running_workers, wait_rows

    out, proc = launch_async(cluster, tmp_path, "trainer.total_steps=1000", "recover_mode=disabled",
                             "system.heartbeat_timeout_s=10")
    try:
        wait_rows(out, 2, proc)
        pids = running_workers(out)
        os.kill(pids["model_worker/1"], signal.SIGSTOP)
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 1, err[-3000:]
    assert "realcore: model_worker/1 hung (no heartbeat for" in err, err[-3000:]
    assert "most recent call first" in open(f"{out}/logs/model_worker-1.log").read()
    print(next(line for line in err.splitlines() if "hung" in line))
    assert_gone(pids)


# SGLang servers as Ray tasks, through the real launch path; the test switch makes the engine's
# command `python -m realcore.serve` (the built-in server, which takes SGLang's flags).
@pytest.mark.timeout(300)
def test_sglang_server_that_exits_0_is_resubmitted(cluster, tmp_path):
    """SGLang exits 0 on SIGTERM: a server that ends unasked fails its task all the same, and Ray's
    launcher submits the task again while training goes on."""
    from test_slurm import (assert_engines_gone, engine_env, engine_pids, metric_rows, n_restarts, restarts,
                            wait_engines, wait_restarted, wait_rows)

    out, proc = launch_async(cluster, tmp_path, "allocation_mode=sglang.d2+d2", "trainer.total_steps=150",
                             env=engine_env())
    try:
        wait_rows(out, 3, proc)
        first = wait_engines(out, {0, 1}, proc)  # a server may still be starting after 3 steps
        before = n_restarts(out)  # a server that missed its start-up deadline on a busy machine was restarted already
        os.kill(first[1], signal.SIGTERM)
        wait_restarted(out, "gen_server/1", proc, after=before)
        deadline = time.time() + 90
        while 1 not in (again := engine_pids(out)) or again[1] == first[1]:
            assert proc.poll() is None and time.time() < deadline, "server 1 did not come back"
            time.sleep(0.3)
        stdout, err = proc.communicate(timeout=240)
    finally:
        proc.kill()
    assert proc.returncode == 0, stdout[-2000:] + err[-3000:]
    assert [(r["who"], r["why"]) for r in restarts(out)[before:]] == [("gen_server/1", "died (exit code 1)")]
    assert "exited on its own (exit code 0)" in open(f"{out}/logs/gen_server-1.log").read()
    for i in range(2):
        assert f"sglang server {i} ready at http://" in open(f"{out}/logs/gen_server-{i}.log").read()
    assert metric_rows(out) == 150
    assert_engines_gone(out)
