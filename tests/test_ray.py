"""scheduler=ray on a 3-node Ray cluster faked on this host (ray.cluster_utils.Cluster).

Ray is an optional extra (`pip install -e ".[ray]"`): skipped with the reason when absent.
"""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

ray = pytest.importorskip("ray", reason="Ray is an optional extra: pip install -e '.[ray]'")

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def cluster():
    from ray.cluster_utils import Cluster

    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    mem = 80 * 1024 * 1024  # a small object store per node: the workers pass nothing through it
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "object_store_memory": mem})
    for _ in range(2):
        c.add_node(num_cpus=2, object_store_memory=mem)
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
        keys = f"{out}/.name_resolve/ppo-math/trial0/model_worker"
        pids = {i: json.load(open(f"{keys}/{i}/.value"))["pid"] for i in (0, 1)}
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
