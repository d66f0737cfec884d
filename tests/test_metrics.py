"""Step metrics (realcore/trainer/metrics.py) in TensorBoard, and what the processes that route
messages import: the master and the manager start without torch (~2 s of CPU each per start)."""

import os
import subprocess
import sys

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from realcore.trainer.metrics import MetricsWriter


def scalars(out, tag):
    tb = EventAccumulator(os.path.join(out, "tensorboard"))
    tb.Reload()
    return [(e.step, e.value) for e in tb.Scalars(tag)]


def test_tensorboard_shows_each_step_once_after_a_resume(tmp_path):
    out = str(tmp_path)
    writer = MetricsWriter(out, 4)
    for step in (1, 2, 3):  # the attempt fails after step 3, its last checkpoint at step 2
        writer.write({"step": step, "loss": float(step), "time/step_s": 0.1})
    writer.close()
    assert scalars(out, "loss") == [(1, 1.0), (2, 2.0), (3, 3.0)]
    writer = MetricsWriter(out, 4, resume_step=2)
    for step in (3, 4):
        writer.write({"step": step, "loss": 10.0 * step, "time/step_s": 0.1})
    writer.close()
    assert scalars(out, "loss") == [(1, 1.0), (2, 2.0), (3, 30.0), (4, 40.0)]


ROUTERS = """
import sys
from realcore.launch.plugins import load_plugins
load_plugins([])  # the built-in datasets, MFCs and workflows register without torch
import realcore.trainer.master, realcore.rollout.gserver_manager, realcore.launch.run_worker
from realcore.backends.server_launch import server_token  # every worker derives the servers' token
from realcore.trainer.metrics import MetricsWriter
MetricsWriter(sys.argv[1], 1).close()
print(sorted(m for m in ("torch", "transformers", "aiohttp") if m in sys.modules))
"""


def test_master_and_manager_start_without_torch(tmp_path):
    r = subprocess.run([sys.executable, "-c", ROUTERS, str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"
