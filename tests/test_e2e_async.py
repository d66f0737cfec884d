"""End-to-end asynchronous PPO: 2 generation servers (built-in engine, SGLang's HTTP API), their
manager, 2 rollout workers streaming trajectories, 2 model workers (DP=2 over gloo), the master.
Real processes, sockets and HTTP. The staleness bound is asserted from metrics.jsonl; a rollout held
past it by a test workflow is dropped at the stream (or trained, with rollout.drop_stale=false), and
a workflow whose every episode fails stops the run."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

from test_e2e_sync import assert_all_gone, assert_clean_logs

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def async_cmd(tmp_path, *overrides, steps=4):
    out = tmp_path / "run"
    return out, [sys.executable, "-m", "realcore.launch", "experiment=async-ppo-math", "eval.freq_steps=null", "model=tiny", "dataset=tiny-arith",
           "allocation_mode=local.d2p1t1+d2p1t1", "rollout.n_workers=2", f"trainer.total_steps={steps}",
           "trainer.batch_size=4", "generation.n_samples=2", "generation.max_new_tokens=8",
           "actor.optimizer.lr=1e-3", f"output_dir={out}", f"model.cache_dir={tmp_path}/cache",
           f"system.name_resolve.root={tmp_path}/nr", *overrides]


def run_async(tmp_path, *overrides, steps=4):
    out, cmd = async_cmd(tmp_path, *overrides, steps=steps)
    r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    metrics = [json.loads(x) for x in open(out / "metrics.jsonl")]
    assert [m["step"] for m in metrics] == list(range(1, steps + 1))
    assert_all_gone(str(out))
    # Every process ends cleanly: its HTTP sessions closed, no task left pending, nothing logged as
    # an error, also by the rollout side, which the launcher stops with SIGTERM at the end.
    assert_clean_logs(str(out), r.stdout, r.stderr)
    return out, metrics


@pytest.mark.parametrize("eta", [1, 0])
def test_async_ppo_math_respects_the_staleness_bound(tmp_path, eta):
    out, metrics = run_async(tmp_path, f"rollout.max_head_offpolicyness={eta}")
    for m in metrics:
        assert 0 <= m["staleness/tail"] <= m["staleness/head"] <= eta, m
        for key in ("reward/mean", "loss", "time/actor_inf_s", "time/actor_train_s", "time/weight_update_s"):
            assert key in m, key
    if eta == 0:  # only on-policy samples: generated entirely by the version that trains on them
        assert all(m["staleness/head"] == 0 and m["staleness/interrupted_frac"] == 0 for m in metrics)
    assert metrics[-1]["version"] == len(metrics)
    assert os.path.exists(out / "checkpoints" / f"step_{len(metrics)}" / "model.safetensors")


# Workflows of the tests below, imported by every process of the run (`imports=[h_test_workflows]`).
TEST_WORKFLOWS = textwrap.dedent('''
    import asyncio, json, os, time
    from realcore.api.registry import register_workflow
    from realcore.workflows.math import math_single_step

    @register_workflow("slow-first-episode")
    async def slow_first_episode(engine, data):
        """The first episode of each rollout worker (its engine's rid: r{worker}-{seq}-{attempt})
        generates (its first token: version 0), then holds its group until the trainer is past
        version 2, so it arrives stale for eta 1."""
        group = await math_single_step(engine, data)
        if engine.rid.split("-")[1] == "0":
            metrics, deadline = os.path.join(os.environ["H_TESTS_OUT"], "metrics.jsonl"), time.monotonic() + 300
            while time.monotonic() < deadline and not (
                    os.path.exists(metrics) and sum(1 for _ in open(metrics)) >= 3):
                await asyncio.sleep(0.1)
        return group

    @register_workflow("always-raises")
    async def always_raises(engine, data):
        await engine.agenerate(data["prompt_ids"])
        raise ValueError("a broken workflow")
''')


def with_test_workflows(tmp_path, monkeypatch):
    (tmp_path / "h_test_workflows.py").write_text(TEST_WORKFLOWS)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (str(tmp_path), os.environ.get("PYTHONPATH")) if p))
    monkeypatch.setenv("H_TESTS_OUT", str(tmp_path / "run"))
    return "imports=[h_test_workflows]"


@pytest.mark.parametrize("drop_stale", [True, False])
def test_a_rollout_that_arrives_stale_is_dropped_at_the_stream(tmp_path, monkeypatch, drop_stale):
    """Each rollout worker's first group is held until version 3 (it started at 0; eta 1). With
    rollout.drop_stale the stream drops both, counted in staleness/dropped, and every trained batch
    stays within eta; without, none is dropped and they are trained, staler than eta."""
    out, metrics = run_async(tmp_path, with_test_workflows(tmp_path, monkeypatch), "rollout.workflow=slow-first-episode",
                             "rollout.max_head_offpolicyness=1", f"rollout.drop_stale={str(drop_stale).lower()}", steps=6)
    dropped = sum(m["staleness/dropped"] for m in metrics)
    if drop_stale:
        assert dropped >= 2 and all(m["staleness/head"] <= 1 for m in metrics), metrics
    else:
        assert dropped == 0 and max(m["staleness/head"] for m in metrics) >= 2, metrics


def test_every_episode_failing_stops_the_run(tmp_path, monkeypatch):
    """README: a failing episode is retried, then dropped and counted; if every episode fails from
    the start, the rollout worker stops the run with that error (exit 1, the worker named)."""
    out, cmd = async_cmd(tmp_path, with_test_workflows(tmp_path, monkeypatch), "rollout.workflow=always-raises",
                         "rollout.episode_retries=0", "rollout.max_concurrent_rollouts=8", steps=4)
    r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert r.returncode == 1, r.stdout[-2000:] + r.stderr[-2000:]
    assert "rollout_worker/" in r.stderr and "all failed" in r.stderr, r.stderr[-3000:]
    assert not os.path.exists(out / "metrics.jsonl") or not open(out / "metrics.jsonl").read()
    assert_all_gone(str(out))


def test_in_memory_weight_update(tmp_path):
    """Weights pushed over the authenticated wire to the paused servers (no disk)."""
    out, metrics = run_async(tmp_path, "rollout.weight_update=memory", "rollout.max_head_offpolicyness=1", steps=3)
    assert all(m["staleness/head"] <= 1 for m in metrics)
    assert metrics[-1]["version"] == 3 and not os.path.exists(out / "weights")


@pytest.mark.parametrize("update", ["memory", "nccl", "disk+lora", "memory+lora"])
def test_in_flight_weight_updates(tmp_path, update):
    """rollout.inflight_weight_update: the servers swap weights under running requests (no abort;
    nccl: they hold their requests while the buckets arrive, gloo here; a LoRA adapter from disk:
    held through its unload + load + version). Some trajectories then hold tokens of two versions,
    in one segment each, and the staleness bound, which counts from a rollout's first token, still
    holds."""
    steps = 6
    how, _, lora = update.partition("+")
    extra = ["actor.lora={rank:4,alpha:8}"] if lora else []
    out, metrics = run_async(tmp_path, f"rollout.weight_update={how}", *extra, "rollout.inflight_weight_update=true",
                             "rollout.max_head_offpolicyness=1", "generation.max_new_tokens=128", steps=steps)
    assert all(0 <= m["staleness/tail"] <= m["staleness/head"] <= 1 for m in metrics)
    # Tokens of two versions: e.g. rollouts of batch 3 run while version 2 lands (admitted at
    # version 1 with eta 1; responses long enough to outlast the update). With eta 1 such a rollout
    # is trained only if it finishes in time for the next batch, which depends on its sampled length
    # and the machine's timing: 6 steps give every run several chances (4 missed once on a CI run).
    assert sum(m["staleness/interrupted_frac"] for m in metrics) > 0
    assert metrics[-1]["version"] == steps
    logs = {name: (out / "logs" / name).read_text() for name in os.listdir(out / "logs")}
    for name, text in logs.items():  # no reply was refused (each is read, spans and all)
        assert "asking for another server" not in text, name
    # Requests ran across an update, not aborted by it (nccl: held while the buckets arrived).
    servers = [t for n, t in logs.items() if n.startswith("gen_server")]
    assert any("running requests go on under it" in t for t in servers), logs.keys()
    from realcore.trainer.ledger import audit

    a = audit(str(out), batch_size=4, max_head_offpolicyness=1)
    assert (a.steps, a.duplicated, a.short_steps, a.over_stale) == (steps, 0, [], 0)


def test_in_flight_weight_update_needs_built_in_servers(tmp_path, monkeypatch):
    from realcore.backends.clients import registry as server_launch
    from realcore.launch.config_loader import ConfigError, load_config
    from realcore.launch.validate import validate

    base = ["experiment=async-ppo-math", "model=tiny", f"model.cache_dir={tmp_path}/cache", f"output_dir={tmp_path}/run",
            "rollout.inflight_weight_update=true"]
    monkeypatch.setattr(server_launch, "engine_available", lambda *a: None)  # as if SGLang were installed
    with pytest.raises(ConfigError, match="rollout.inflight_weight_update: needs built-in servers"):
        validate(load_config([*base, "allocation_mode=sglang.d1p1t1+d1p1t1"]))
    for update in ("disk", "memory", "nccl"):  # built-in servers: accepted, with LoRA too
        validate(load_config([*base, f"rollout.weight_update={update}"]))
        validate(load_config([*base, f"rollout.weight_update={update}", "actor.lora={rank:4}"]))


@pytest.mark.skipif(__import__("importlib").util.find_spec("sglang") is not None, reason="sglang is installed here")
def test_missing_engine_is_a_one_line_config_error(tmp_path):
    r = subprocess.run([sys.executable, "-m", "realcore.launch", "experiment=async-ppo-math", "eval.freq_steps=null", "model=tiny",
                        "allocation_mode=sglang.d1p1t1+d1p1t1", f"output_dir={tmp_path}"],
                       cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "sglang is not installed" in lines[0] and "pip install sglang" in lines[0]
