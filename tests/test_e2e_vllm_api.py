"""End-to-end asynchronous PPO on vLLM's API: `allocation_mode=vllm.*` through realcore's real launch
path, with tests/vllm_standin.py (vLLM's endpoints on the built-in engine) as the server's
interpreter. vLLM's replies carry no weight version, so the rollout workers must learn each
server's version from the gserver manager: otherwise every trajectory is stamped version 0 and,
once the trainer is more than max_head_offpolicyness ahead, dropped as too stale for ever (the run
stalls). And a server that fails every request while its /health answers is restarted."""

import json
import os
import re
import signal
import subprocess
import sys

import vllm_standin
from test_e2e_sync import assert_all_gone, assert_clean_logs

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS, ETA = 6, 1  # more than ETA + 2 steps: a run that stamps version 0 stalls after step ETA + 1


def launch(tmp_path, python: str, *overrides: str, timeout_s: float = 120) -> tuple[int, str, str]:
    """Run the launcher; on a stall, SIGINT it (it stops every process it started) and fail."""
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "realcore.launch", "experiment=async-ppo-math", "model=tiny", "dataset=tiny-arith",
           "allocation_mode=vllm.d1p1t1+d1p1t1", f"rollout.server_python={python}", "rollout.n_workers=1",
           f"rollout.max_head_offpolicyness={ETA}", "rollout.max_concurrent_rollouts=4", "trainer.batch_size=2",
           "generation.n_samples=2", "generation.max_new_tokens=8", "actor.optimizer.lr=1e-3", f"output_dir={out}",
           f"model.cache_dir={tmp_path}/cache", f"system.name_resolve.root={tmp_path}/nr", "trial_name=v-e2e-vllm-api",
           "eval.freq_steps=null", *overrides]  # no held-out evaluation: its 100 prompts would double the run
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=60)
        metrics = out / "metrics.jsonl"
        steps = sum(json.loads(x)["step"] > 0 for x in open(metrics)) if metrics.exists() else 0
        raise AssertionError(f"the run stalled: {steps} of the steps done after {timeout_s:g} s\n{stderr[-3000:]}")
    return proc.returncode, stdout, stderr


def test_async_run_on_vllm_api_learns_the_servers_versions(tmp_path):
    python = vllm_standin.interpreter(tmp_path / "vllm-env")
    rc, stdout, stderr = launch(tmp_path, python, f"trainer.total_steps={STEPS}")
    out = tmp_path / "run"
    assert rc == 0, stdout[-3000:] + stderr[-3000:]
    metrics = [json.loads(x) for x in open(out / "metrics.jsonl")]
    assert [m["step"] for m in metrics] == list(range(1, STEPS + 1))
    assert all(0 <= m["staleness/head"] <= ETA for m in metrics), metrics
    rows = [json.loads(x) for x in open(out / "ledger.jsonl")]
    # Trained samples carry the versions that generated them: late steps train on samples of
    # versions > 0, and none is newer than the policy that trains on it, nor beyond the bound.
    assert max(r["version_start"] for r in rows) > 0, rows[-4:]
    assert all(0 <= r["trained_version"] - r["version_start"] <= ETA for r in rows), rows
    assert all(r["version_start"] <= r["version_end"] <= r["trained_version"] for r in rows), rows
    assert_all_gone(str(out))
    assert_clean_logs(str(out), stdout, stderr)


def test_a_server_that_fails_every_request_is_restarted_until_its_restarts_are_used_up(tmp_path):
    """A server that answers HTTP 500 to every request, yet 200 to /health: the manager stops it, the
    launcher restarts it like a dead one (once here), and when it is stopped again the run ends,
    naming the server."""
    python = vllm_standin.interpreter(tmp_path / "vllm-env", fail_generation=True)
    rc, stdout, stderr = launch(tmp_path, python, "trainer.total_steps=2", "recover_mode=resume", "recover_retries=1")
    out = tmp_path / "run"
    assert rc == 1, stdout[-3000:] + stderr[-3000:]
    restarts = [json.loads(x) for x in open(out / "restarts.jsonl")]
    assert [(r["who"], r["action"]) for r in restarts] == [("gen_server/0", "restart in place"), ("gen_server/0", "give up")]
    final = [line for line in stderr.splitlines() if line.endswith("; stopping all workers")]
    assert len(final) == 1 and final[0].startswith("realcore: gen_server/0 ") and "HTTP 500" in final[0], stderr[-3000:]
    manager_log = open(out / "logs" / "gserver_manager.log").read()
    stopped = [line for line in manager_log.splitlines() if "stopped it, to be restarted" in line]
    assert len(stopped) == 2, manager_log[-3000:]  # the server, then its restart
    assert all(re.search(r"gen_server/0 \(http://\S+\) failed \d+ requests in a row over \d+ s while its /health "
                         r"answered \(the last: vLLM /v1/completions answered HTTP 500: ", line) for line in stopped), stopped
    assert_all_gone(str(out))
