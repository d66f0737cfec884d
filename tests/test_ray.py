"""scheduler=ray on a 3-node Ray cluster faked on this host (ray.cluster_utils.Cluster).

Ray is an optional extra (`pip install -e ".[ray]"`): skipped with the reason when absent.
"""

import json
import os
import subprocess
import sys

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
