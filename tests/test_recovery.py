"""Recovery from failures, with real processes and real signals (local scheduler).

- Sync mode is exact: a run whose model worker or master is SIGKILLed (recover_mode=auto), one
  preempted with SIGTERM and resumed, and one whose launcher is SIGKILLed and then run again, all
  end with the same weights (max |diff| <= 1e-6) and the same metrics as a run never interrupted.
- Async mode loses nothing: one process of each type is SIGKILLed in turn; the ledger shows no
  sequence trained twice, `batch_size` groups every step, staleness within its bound, no accepted
  rollout lost, and rollout-side kills leave the trainer's processes alone.
- A stopped (SIGSTOP) model worker is found by its heartbeat, its stacks written to its log, and
  the run either recovers (auto) or exits 1 naming it (disabled).
- Rewards that raise or hang, and agent episodes that fail, are counted and the run finishes.
"""

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from test_e2e_sync import alive, assert_all_gone, wait_for_metrics

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "bench"))

PLUGIN = '''
import asyncio, time
from realcore.api.registry import register_reward, register_workflow
from realcore.workflows.math import math_single_step


@register_reward("length-test")
def length(prompt, completion, prompt_ids, completion_ids, **data) -> float:
    response = completion
    """A reward the tiny random model can move: longer answers (the weights change every step)."""
    return min(len(response), 40) / 40.0


@register_reward("flaky-test")
def flaky(prompt, completion, prompt_ids, completion_ids, **data) -> float:
    response = completion
    n = len(response) % 4
    if n == 0:
        raise RuntimeError("a bug in the user's reward")
    if n == 1:
        time.sleep(10**6)  # hangs forever
    return 1.0


@register_workflow("failing-test")
async def failing(engine, data):
    """Fails the first attempt of every third prompt, and every attempt of every seventh (the rollout
    worker's engine names the episode: r{worker}-{seq}-{attempt})."""
    seq, attempt = (int(x) for x in engine.rid.split("-")[1:3])
    if seq % 7 == 0 or (seq % 3 == 0 and attempt == 0):
        raise ValueError(f"episode {engine.rid} failed")
    return await math_single_step(engine, data)
'''

SYNC = ["experiment=ppo-math", "model=tiny", "trainer.total_steps=6", "trainer.batch_size=4", "generation.n_samples=2",
        "generation.max_new_tokens=8", "imports=[rc_test_plugin]", "reward.type=length-test", "actor.optimizer.lr=1e-3"]


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    d = tmp_path_factory.mktemp("plugin")
    (d / "rc_test_plugin.py").write_text(PLUGIN)
    return {**os.environ, "PYTHONPATH": str(d), "OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return str(tmp_path_factory.mktemp("model-cache"))


def cmd(out, *overrides, cache, base=SYNC):
    return [sys.executable, "-m", "realcore.launch", *base, f"output_dir={out}", f"model.cache_dir={cache}",
            f"system.name_resolve.root={out}/nr", f"trial_name={os.path.basename(out)}", *overrides]


def stragglers(out) -> list[int]:
    """Live processes in the sessions of the run's workers (each worker leads its own session, and
    what it starts, reward processes included, stays in it)."""
    sessions = set(json.load(open(os.path.join(out, "pids.json"))).values())
    found = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                if os.getsid(int(name)) in sessions and alive(int(name)):
                    found.append(int(name))
            except (ProcessLookupError, FileNotFoundError):
                pass
    return found


def metrics(out) -> list[dict]:
    return [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]


def weights(out, step):
    from safetensors.torch import load_file

    return load_file(os.path.join(out, "checkpoints", f"step_{step}", "model.safetensors"))


def kill_when(proc, out, who, rows, sig=signal.SIGKILL):
    """Send `sig` to process `who` (a name in pids.json) once metrics.jsonl has `rows` rows."""
    wait_for_metrics(out, rows, proc)
    pid = json.load(open(os.path.join(out, "pids.json")))[who]
    os.kill(pid, sig)
    return pid


@pytest.fixture(scope="module")
def straight(tmp_path_factory, env, cache):
    """The reference: 6 steps, never interrupted."""
    out = str(tmp_path_factory.mktemp("straight") / "run")
    r = subprocess.run(cmd(out, cache=cache), cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return out


def assert_same_run(out, ref):
    a, b = weights(out, 6), weights(ref, 6)
    assert a.keys() == b.keys()
    assert max(float((a[k] - b[k]).abs().max()) for k in a) <= 1e-6
    keys = ("step", "loss", "reward/mean")
    assert [[m[k] for k in keys] for m in metrics(out)] == [[m[k] for k in keys] for m in metrics(ref)]
    assert open(os.path.join(out, "ledger.jsonl")).read() == open(os.path.join(ref, "ledger.jsonl")).read()


def test_the_reference_run_learns(straight, cache):
    """Otherwise "the same weights" would prove nothing: training moved them."""
    from realcore.backends.models import prepare_model

    from realcore.api.config import ModelConfig

    initial = prepare_model(ModelConfig(name="tiny", cache_dir=cache), 1)
    from safetensors.torch import load_file

    start = load_file(os.path.join(initial, "model.safetensors"))
    end = weights(straight, 6)
    assert max(float((start[k] - end[k]).abs().max()) for k in start) > 1e-4


@pytest.mark.parametrize("who", ["model_worker/1", "master"])
def test_sync_recovery_is_exact(tmp_path, env, cache, straight, who):
    out = str(tmp_path / "run")
    proc = subprocess.Popen(cmd(out, "recover_mode=auto", "trainer.recover_freq_steps=2", "recover_delay_s=0", cache=cache),
                            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        kill_when(proc, out, who, 3)
        stdout, stderr = proc.communicate(timeout=300)
    finally:
        proc.kill()
    assert proc.returncode == 0, stderr[-3000:]
    assert f"{who} died (killed by SIGKILL)" in stderr and "restarting the run" in stderr
    assert re.search(r"resuming from step [246] ", stdout)  # a checkpoint every 2 steps
    assert_same_run(out, straight)
    # TensorBoard too shows each step once: the failed attempt's later events are purged.
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tb = EventAccumulator(os.path.join(out, "tensorboard"))
    tb.Reload()
    assert [e.step for e in tb.Scalars("loss")] == [1, 2, 3, 4, 5, 6]
    restarts = [json.loads(line) for line in open(os.path.join(out, "restarts.jsonl"))]
    assert [(r["who"], r["action"]) for r in restarts] == [(who, "restart run")]
    assert_all_gone(out)


def wait_for_line(path, text, proc, timeout=120) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        assert proc.poll() is None, f"launcher exited early with {proc.returncode}"
        if os.path.exists(path) and text in open(path).read():
            return
        time.sleep(0.02)
    raise AssertionError(f"no {text!r} in {path} within {timeout} s")


def test_preempted_run_resumes_exactly(tmp_path, env, cache, straight):
    """SIGTERM to the launcher: the step in progress ends, a recover checkpoint is written, exit
    75; the same command with recover_mode=resume continues to the end as if never stopped."""
    out = str(tmp_path / "run")
    proc = subprocess.Popen(cmd(out, cache=cache), cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        # A tiny model's step can take 50 ms: once the master is configured (its preemption handler
        # is set), freeze the model workers, so its step in progress waits for them while the
        # launcher passes the preemption on: it lands mid-run on any machine.
        wait_for_line(os.path.join(out, "logs", "master.log"), "dataset:", proc)
        workers = [p for n, p in json.load(open(os.path.join(out, "pids.json"))).items() if n.startswith("model_worker")]
        for pid in workers:
            os.kill(pid, signal.SIGSTOP)
        try:
            proc.send_signal(signal.SIGTERM)
            time.sleep(1.0)  # the launcher polls every 0.2 s
        finally:
            for pid in workers:
                os.kill(pid, signal.SIGCONT)
        _, stderr = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 75, stderr[-3000:]
    assert "preempted" in stderr
    done = len(metrics(out))
    assert 1 <= done < 6 and os.path.isdir(os.path.join(out, "recover", f"step_{done}"))
    assert_all_gone(out)
    r = subprocess.run(cmd(out, "recover_mode=resume", cache=cache), cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"resuming from step {done}" in r.stdout
    assert_same_run(out, straight)


def test_killed_launcher_then_the_same_command_resumes(tmp_path, env, cache, straight):
    out = str(tmp_path / "run")
    again = cmd(out, "recover_mode=auto", "trainer.recover_freq_steps=1", cache=cache)
    proc = subprocess.Popen(again, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for_metrics(out, 3, proc)
        proc.kill()
        proc.wait(timeout=10)
    finally:
        proc.kill()
    assert_all_gone(out)  # the workers died with the launcher
    r = subprocess.run(again, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resuming from step" in r.stdout
    assert_same_run(out, straight)


def test_async_loses_nothing_when_each_process_type_is_killed(tmp_path, cache):
    """bench/chaos.py's trial: SIGKILL a generation server, a rollout worker, the manager, a model
    worker and the master, in turn, at random moments."""
    import random

    from chaos import KINDS, trial

    # The last kill comes after step 14; 10 steps more leave it time on a machine where a step of the
    # tiny model takes a third of a second.
    r = trial(str(tmp_path / "run"), 24, cache, random.Random(1), timeout_s=600)
    assert r["rc"] == 0, open(str(tmp_path / "run") + ".log").read()[-3000:]
    assert [k.split("/")[0] for k in r["kills"]] == list(KINDS), r["missed"]
    a = r["audit"]
    assert a.steps == 24 and a.duplicated == 0 and a.short_steps == [] and a.over_stale == 0 and a.lost == 0, a
    assert r["trainer_kept"]  # rollout-side kills did not restart the trainer
    assert r["restarts"] == {"gen_server: restart in place": 1, "rollout_worker: restart in place": 1,
                             "gserver_manager: restart in place": 1, "model_worker: restart run": 1,
                             "master: restart run": 1}, (r["restarts"], r["missed"])


ASYNC = ["experiment=async-ppo-math", "eval.freq_steps=null", "model=tiny", "dataset=tiny-arith", "allocation_mode=local.d1p1t1+d1p1t1",
         "rollout.n_workers=1", "trainer.total_steps=6", "trainer.batch_size=4", "generation.n_samples=2",
         "generation.max_new_tokens=8", "rollout.max_head_offpolicyness=1"]


def test_rewards_that_raise_or_hang_are_counted(tmp_path, env, cache):
    """Async (rollout workers) and sync (the reward MFC): the run finishes; every failed call is
    counted as an error or a timeout, and no hung reward process is left."""
    for base in (ASYNC, SYNC[:6]):
        out = str(tmp_path / base[0].split("=")[1])
        r = subprocess.run(cmd(out, "imports=[rc_test_plugin]", "reward.type=flaky-test", "reward.timeout_s=1",
                               "trainer.total_steps=3", cache=cache, base=base),
                           cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stderr[-3000:]
        m = metrics(out)
        assert sum(x.get("reward/errors", 0) for x in m) > 0 and sum(x.get("reward/timeouts", 0) for x in m) > 0, m
        assert_all_gone(out)
        assert not stragglers(out)


def test_failing_episodes_are_retried_then_dropped(tmp_path, env, cache):
    out = str(tmp_path / "run")
    r = subprocess.run(cmd(out, "imports=[rc_test_plugin]", "rollout.workflow=failing-test", cache=cache, base=ASYNC),
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    m = metrics(out)
    assert sum(x.get("rollout/failed_episodes", 0) for x in m) > 0
    ledger = [json.loads(line)["sample_id"] for line in open(os.path.join(out, "ledger.jsonl"))]
    seqs = {int(s.split(":")[1].split("/")[0]) for s in ledger}
    assert not [s for s in seqs if s % 7 == 0]  # never succeeded: dropped
    assert [s for s in seqs if s % 3 == 0]  # failed once, retried, trained


@pytest.mark.parametrize("mode", ["disabled", "auto"])
def test_stopped_model_worker_is_found_by_its_heartbeat(tmp_path, env, cache, mode):
    out = str(tmp_path / "run")
    overrides = ["trainer.total_steps=40", f"recover_mode={mode}", "trainer.recover_freq_steps=2", "recover_delay_s=0",
                 "system.heartbeat_timeout_s=10"]  # the default (30 s) would only make the test wait longer
    proc = subprocess.Popen(cmd(out, *overrides, cache=cache), cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        pid = kill_when(proc, out, "model_worker/1", 2, signal.SIGSTOP)
        t0 = time.monotonic()
        _, stderr = proc.communicate(timeout=600)
    finally:
        proc.kill()
    log = open(os.path.join(out, "logs", "model_worker-1.log")).read()
    assert "model_worker/1 hung (no heartbeat for" in stderr, stderr[-3000:]
    assert "Thread 0x" in log and 'File "' in log  # faulthandler's dump of every thread
    assert not alive(pid)
    if mode == "disabled":
        assert proc.returncode == 1 and time.monotonic() - t0 < 40
    else:
        assert proc.returncode == 0 and len(metrics(out)) == 40
        assert [json.loads(line)["action"] for line in open(os.path.join(out, "restarts.jsonl"))] == ["restart run"]
    assert_all_gone(out)


@pytest.mark.parametrize("update", ["disk", "memory", "nccl"])
def test_restarted_server_gets_the_current_weights(tmp_path, cache, update):
    """The only generation server is SIGKILLed mid-run: restarted in place, it gets the current
    weights (disk: the manager loads them; memory: the master pushes them; nccl: rank 0 builds a
    new weight-update group with it and broadcasts them) before it serves
    again, so the run finishes, with its trainer untouched and its samples within the bound."""
    from realcore.trainer.ledger import audit

    out = str(tmp_path / "run")
    proc = subprocess.Popen(cmd(out, "recover_mode=auto", f"rollout.weight_update={update}", "trainer.total_steps=10",
                                "generation.max_new_tokens=16", cache=cache, base=ASYNC),
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for_metrics(out, 3, proc)
        trainer = {n: p for n, p in json.load(open(os.path.join(out, "pids.json"))).items() if n in ("master", "model_worker/0")}
        kill_when(proc, out, "gen_server/0", 3)
        _, stderr = proc.communicate(timeout=300)
    finally:
        proc.kill()
    assert proc.returncode == 0, stderr[-3000:]
    assert "gen_server/0 died (killed by SIGKILL); restarting it" in stderr
    after = json.load(open(os.path.join(out, "pids.json")))
    assert all(after[n] == p for n, p in trainer.items())
    manager_log = open(os.path.join(out, "logs", "gserver_manager.log")).read()
    assert "server 0 restarted at" in manager_log
    a = audit(out, batch_size=4, max_head_offpolicyness=1)
    assert a.steps == 10 and a.duplicated == 0 and a.over_stale == 0 and a.short_steps == [], a
    # The push that found the server gone (memory) failed at once: no step waited out a deadline.
    assert max(m["time/step_s"] for m in metrics(out)) < 20, [m["time/step_s"] for m in metrics(out)]


def test_auto_gives_up_when_its_restarts_are_used_up(tmp_path, env, cache):
    out = str(tmp_path / "run")
    proc = subprocess.Popen(cmd(out, "recover_mode=auto", "recover_retries=1", "recover_delay_s=0", "trainer.total_steps=1000",
                                cache=cache), cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        first = kill_when(proc, out, "model_worker/0", 2)
        # The restarted run: kill it again once it has a new model worker (the pid killed above is the
        # one to compare with: pids.json may already name the new one when restarts.jsonl appears).
        deadline = time.time() + 120
        while time.time() < deadline and json.load(open(os.path.join(out, "pids.json")))["model_worker/0"] == first:
            time.sleep(0.2)
        time.sleep(3)
        os.kill(json.load(open(os.path.join(out, "pids.json")))["model_worker/0"], signal.SIGKILL)
        _, stderr = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 1, stderr[-3000:]
    assert "giving up after 1 restarts (recover_retries=1)" in stderr
    assert [json.loads(line)["action"] for line in open(os.path.join(out, "restarts.jsonl"))] == ["restart run", "give up"]
    assert_all_gone(out)
