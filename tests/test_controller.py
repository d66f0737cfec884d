"""realcore.Controller: the RL loop as a Python file, run for real (local scheduler, tiny model).

- examples/grpo_loop.py trains exactly as `python -m realcore.launch experiment=ppo-math` does:
  the same metrics every step (every figure but times), the same ledger, the same weights, and
  no process left behind. The reward is a learnable one (the tiny model scores 0 on math), so
  the loss and the rewards are not all zero.
- examples/async_grpo_loop.py with recover_mode=auto: its model worker SIGKILLed mid-run, the
  launcher restarts the run, script included; the script finishes its steps, and the ledger audit
  holds (no sample twice, none lost, the staleness bound kept).
- examples/rejection_sampling_loop.py throws away the batches outside its reward band: the kept
  batches' rewards are inside it, the ledger lists them alone, and the thrown-away prompts are used up.
- A breakpoint() in a script's loop holds the run for several heartbeat timeouts, and no worker
  is declared lost; verbs used out of turn raise LoopError with one line naming what is wrong.
- Ctrl-C (SIGINT to the launcher) stops every process of a script's run.
"""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from test_e2e_sync import assert_all_gone, assert_clean_logs, wait_for_metrics

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PY = sys.executable

PLUGIN = '''
from realcore.api.registry import register_reward


@register_reward("even-tokens")
def even_tokens(prompt, completion, prompt_ids, completion_ids, **data):
    return sum(t % 2 == 0 for t in completion_ids) / max(len(completion_ids), 1)
'''
LEARN = ["model=tiny", "imports=[ctl_plugin]", "reward.type=even-tokens", "actor.optimizer.lr=0.01"]
ASYNC = ["model=tiny", "dataset=tiny-arith", "eval.freq_steps=null", "allocation_mode=local.d1p1t1+d1p1t1",
         "rollout.n_workers=1", "trainer.batch_size=4", "generation.n_samples=2", "generation.max_new_tokens=8",
         "rollout.max_head_offpolicyness=1"]


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    d = tmp_path_factory.mktemp("plugin")
    (d / "ctl_plugin.py").write_text(PLUGIN)
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(d), REPO]), "OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return str(tmp_path_factory.mktemp("model-cache"))


def run_args(out, cache, *overrides):
    return [*overrides, f"output_dir={out}", f"model.cache_dir={cache}", f"system.name_resolve.root={out}/nr",
            f"trial_name=ctl-{os.path.basename(out)}"]


def rows(out) -> list[dict]:
    return [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]


def ledger(out) -> list[dict]:
    return [json.loads(line) for line in open(os.path.join(out, "ledger.jsonl"))]


def untimed(row: dict) -> dict:
    return {k: v for k, v in row.items() if not k.startswith(("time/", "timeline/", "perf/"))}


@pytest.mark.timeout(600)
def test_the_script_trains_as_the_yaml_graph_does(tmp_path, env, cache):
    from safetensors.torch import load_file

    steps = ["trainer.total_steps=5"]
    script, graph = str(tmp_path / "script"), str(tmp_path / "graph")
    a = subprocess.run([PY, "examples/grpo_loop.py", *run_args(script, cache, *LEARN, *steps)], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=300)
    assert a.returncode == 0, a.stdout[-2000:] + a.stderr[-3000:]
    assert "step 5: reward" in a.stdout  # the script's own print, from the master process
    assert_all_gone(script)
    b = subprocess.run([PY, "-m", "realcore.launch", "experiment=ppo-math", *run_args(graph, cache, *LEARN, *steps)],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert b.returncode == 0, b.stderr[-3000:]
    mine, theirs = rows(script), rows(graph)
    assert [m["step"] for m in mine] == [1, 2, 3, 4, 5]
    for m, t in zip(mine, theirs):
        assert set(t) <= set(m) and "script/reward_x_entropy" in m  # the script's ctl.log() value too
        assert untimed({k: m[k] for k in t}) == untimed(t), m["step"]
    assert len({m["reward/mean"] for m in mine}) > 1 and any(m["loss"] != 0 for m in mine)  # not a trivial match
    assert open(f"{script}/ledger.jsonl").read() == open(f"{graph}/ledger.jsonl").read()
    wa, wb = (load_file(f"{o}/checkpoints/step_5/model.safetensors") for o in (script, graph))
    assert wa.keys() == wb.keys() and all(bool((wa[k] == wb[k]).all()) for k in wa)


@pytest.mark.timeout(600)
def test_async_script_recovers_from_a_killed_model_worker(tmp_path, env, cache):
    from realcore.trainer.ledger import audit

    out = str(tmp_path / "run")
    proc = subprocess.Popen([PY, "examples/async_grpo_loop.py", *run_args(out, cache, *ASYNC, "trainer.total_steps=8",
                                                                           "recover_mode=auto", "recover_delay_s=0",
                                                                           "trainer.recover_freq_steps=1")],
                            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for_metrics(out, 3, proc)
        pid = json.load(open(os.path.join(out, "pids.json")))["model_worker/0"]
        os.kill(pid, signal.SIGKILL)
        stdout, stderr = proc.communicate(timeout=400)
    finally:
        proc.kill()
    assert proc.returncode == 0, stdout[-2000:] + stderr[-3000:]
    assert "model_worker/0 died (killed by SIGKILL)" in stderr and "restarting the run" in stderr, stderr[-3000:]
    assert "resuming from step" in stdout  # the script again, from the recover checkpoint
    assert [m["step"] for m in rows(out)] == list(range(1, 9))
    a = audit(out, batch_size=4, max_head_offpolicyness=1)
    assert a.steps == 8 and a.duplicated == 0 and a.lost == 0 and a.over_stale == 0 and a.short_steps == [], a
    assert_all_gone(out)


@pytest.mark.timeout(600)
def test_rejection_sampling_keeps_only_batches_in_its_band(tmp_path, env, cache):
    out = str(tmp_path / "run")
    tries, low, high = 3, 0.5, 1.0  # the learnable reward's batch means sit near 0.5: about half are thrown away
    r = subprocess.run([PY, "examples/rejection_sampling_loop.py", *run_args(out, cache, *LEARN, "trainer.total_steps=5")],
                       cwd=REPO, env={**env, "REJECT_LOW": str(low), "REJECT_HIGH": str(high), "REJECT_TRIES": str(tries)},
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    metrics = rows(out)
    rejected = [m["rejected/batches"] for m in metrics]
    assert len(rejected) == 5 and all(0 <= n < tries for n in rejected)
    for m, n in zip(metrics, rejected):
        if n < tries - 1:  # kept for its reward, not for want of tries
            assert low < m["reward/mean"] < high, m
    # The ledger holds the kept batches alone: each step's prompts come after the batches drawn
    # before it, the thrown-away ones included (8 prompts a batch, 4 per data-parallel replica).
    drawn = 0
    for step, n in enumerate(rejected, start=1):
        drawn += n
        want = {f"d{d}:{i}" for d in (0, 1) for i in range(4 * drawn, 4 * drawn + 4)}
        assert {x["sample_id"].split("/")[0] for x in ledger(out) if x["step"] == step} == want, (step, rejected)
        drawn += 1
    assert_all_gone(out)


BREAKPOINT_SCRIPT = '''
from realcore import Controller, LoopError

ctl = Controller(experiment="ppo-math")
try:
    ctl.rollout()
except LoopError as e:
    print("LoopError:", e, flush=True)
for step in ctl.steps():
    batch = ctl.rollout()
    for name in ("actor_train", "no_such_mfc", "actor_gen"):
        try:
            ctl.call(name, batch)
        except LoopError as e:
            print("LoopError:", e, flush=True)
    if step == 2:
        print("stopping at a breakpoint", flush=True)
        breakpoint()
    ctl.mfc.ref_inf(batch)
    ctl.mfc.actor_train(batch)
'''


@pytest.mark.timeout(300)
def test_a_breakpoint_holds_the_run_without_losing_a_worker(tmp_path, env, cache):
    script = tmp_path / "loop_with_breakpoint.py"
    script.write_text(BREAKPOINT_SCRIPT)
    out = str(tmp_path / "run")
    hold_s, timeout_s = 12.0, 3.0
    proc = subprocess.Popen([PY, str(script), *run_args(out, cache, "model=tiny", "trainer.total_steps=3",
                                                        f"system.heartbeat_timeout_s={timeout_s}",
                                                        "system.heartbeat_interval_s=0.5")],
                            cwd=REPO, env={k: v for k, v in env.items() if k != "PYTHONBREAKPOINT"},
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for_metrics(out, 1, proc)
        time.sleep(hold_s)  # the debugger sits at its prompt: the master's main thread is stopped
        stdout, stderr = proc.communicate("c\n", timeout=200)
    finally:
        proc.kill()
    assert proc.returncode == 0, stdout[-2000:] + stderr[-3000:]
    assert "stopping at a breakpoint" in stdout and "(Pdb)" in stdout, stdout[-2000:]
    assert "no heartbeat" not in stderr and "no message from the master" not in stderr, stderr[-3000:]
    assert_clean_logs(out)  # no worker timed out, failed or was restarted
    metrics = rows(out)
    assert [m["step"] for m in metrics] == [1, 2, 3]
    assert metrics[1]["time/step_s"] > hold_s - 2  # step 2 waited for the debugger
    errors = [line for line in stdout.splitlines() if line.startswith("LoopError:")]
    assert errors[0] == "LoopError: rollout(): only inside `for step in ctl.steps():`"
    assert errors[1] == ("LoopError: MFC actor_train needs ref_logprobs, which the batch does not hold: "
                         "run ref_inf on it first")
    assert errors[2].startswith("LoopError: no MFC named 'no_such_mfc' in this experiment's graph (it has actor_gen")
    assert errors[3] == "LoopError: MFC actor_gen ran on this batch already"
    assert len(errors) == 1 + 3 * 3
    assert_all_gone(out)


@pytest.mark.timeout(300)
def test_ctrl_c_stops_every_process_of_a_script_run(tmp_path, env, cache):
    out = str(tmp_path / "run")
    proc = subprocess.Popen([PY, "examples/grpo_loop.py", *run_args(out, cache, "model=tiny", "trainer.total_steps=1000")],
                            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for_metrics(out, 2, proc)
        proc.send_signal(signal.SIGINT)
        proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 130
    assert_all_gone(out)


def test_bad_command_lines_are_one_line_errors(tmp_path, env):
    for args, want in ((["script=x.py"], "script: set by running the file"),
                       (["trainer.total_stepz=3"], "trainer.total_stepz: unknown key")):
        r = subprocess.run([PY, "examples/grpo_loop.py", *args, f"output_dir={tmp_path}"], cwd=REPO, env=env,
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 2 and r.stderr.strip().count("\n") == 0 and want in r.stderr, r.stderr
    r = subprocess.run([PY, "-m", "realcore.launch", f"script={tmp_path}/missing.py", f"output_dir={tmp_path}"],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "script: " in r.stderr and "is not a file" in r.stderr, r.stderr


def test_print_config_names_the_script(tmp_path, env):
    r = subprocess.run([PY, "examples/async_grpo_loop.py", "model=tiny", "--print-config"], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert f"script: {os.path.join(REPO, 'examples', 'async_grpo_loop.py')}" in r.stdout
    assert "experiment_name: async-ppo-math" in r.stdout
