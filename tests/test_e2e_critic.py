"""Critic PPO end to end: `ppo-critic-math` runs actor, critic and reference as three roles, each
on its own mesh, and learns a task a tiny random model can learn in a few steps (emit even token
ids; the reward is the fraction of generated tokens that are even, about 0.5 by chance; as
tests/test_e2e_learning.py does for GRPO): the critic's value loss falls and the reward rises. With
the advantage's sign flipped (a test-only estimator that negates `gae`) the reward falls instead.
The async twin runs 3 tiny steps; `python -m realcore.dfg show` draws the critic's two MFCs."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

from realcore.api.registry import source_keys
from realcore.dfg.graph import build_graph
from realcore.launch.config_loader import import_user_modules, load_config

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = 16

USER = textwrap.dedent('''
    from realcore.api.algorithms import AdvantageOutputs, advantage, register_advantage
    from realcore.api.registry import register_reward

    @register_reward("even-tokens")
    def even_tokens(prompt, completion, prompt_ids, completion_ids, **data):
        return sum(t % 2 == 0 for t in completion_ids) / max(len(completion_ids), 1)

    @register_advantage("negated-gae")
    def negated_gae(inputs):
        out = advantage("gae")(inputs)  # the critic's returns stay right; the actor is pushed the wrong way
        return AdvantageOutputs([-a for a in out.advantages], out.returns, out.stats)
''')

THREE_MESHES = "allocation_mode='actor:d1p1t1,critic:d1p1t1,ref:d1p1t1'"  # quoted: hydra reads a bare a,b as a list
COMMON = ["model=tiny", "dataset=tiny-arith", "imports=[critic_user]", "reward.type=even-tokens",
          "trainer.batch_size=8", "generation.n_samples=4", "generation.max_new_tokens=8", "generation.temperature=1.0",
          "actor.optimizer.lr=0.01", "actor.optimizer.lr_scheduler=constant", "roles.critic.optimizer.lr=0.01",
          "++roles.critic.optimizer.lr_scheduler=constant", "eval.freq_steps=null"]
ACTOR_TRAIN = 4  # mfcs[4] of ppo-critic-math: the actor's ppo_update


def run(tmp_path, experiment, *overrides, steps=STEPS):
    (tmp_path / "critic_user.py").write_text(USER)
    out = str(tmp_path / "run")
    cmd = [sys.executable, "-m", "realcore.launch", f"experiment={experiment}", *COMMON, f"trainer.total_steps={steps}",
           *overrides, f"output_dir={out}", f"model.cache_dir={tmp_path}/cache", f"system.name_resolve.root={out}-nr"]
    # PYTHONPATH: this checkout's realcore, and the test's user module from the run's folder (cwd)
    r = subprocess.run(cmd, cwd=str(tmp_path), capture_output=True, text=True, timeout=550,
                       env={**os.environ, "PYTHONPATH": REPO})
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    metrics = [json.loads(x) for x in open(os.path.join(out, "metrics.jsonl"))]
    assert [m["step"] for m in metrics] == list(range(1, steps + 1))
    return metrics


def mean(xs):
    return sum(xs) / len(xs)


@pytest.mark.timeout(600)
def test_critic_ppo_on_three_meshes_learns(tmp_path):
    metrics = run(tmp_path, "ppo-critic-math", THREE_MESHES)
    rewards = [m["reward/mean"] for m in metrics]
    value_loss = [m["critic/value_loss"] for m in metrics]
    print("reward", [round(x, 3) for x in rewards])
    print("value_loss", [round(x, 4) for x in value_loss])
    print("explained_variance", [round(m["critic/explained_variance"], 3) for m in metrics])
    # The fresh value head starts far from the returns; over 10 steps it regresses onto them.
    assert mean(value_loss[7:10]) < 0.5 * mean(value_loss[:2]), value_loss
    assert mean(rewards[-3:]) > mean(rewards[:3]) + 0.15, rewards
    assert all(m["critic/clipfrac"] >= 0 for m in metrics)


@pytest.mark.timeout(600)
def test_critic_ppo_with_the_advantage_negated_does_not_learn(tmp_path):
    metrics = run(tmp_path, "ppo-critic-math", THREE_MESHES, f"mfcs.{ACTOR_TRAIN}.args.advantage=negated-gae")
    rewards = [m["reward/mean"] for m in metrics]
    print("reward (negated advantage)", [round(x, 3) for x in rewards])
    assert mean(rewards[-3:]) < mean(rewards[:3]) - 0.15, rewards  # it learns the opposite task


@pytest.mark.timeout(600)
def test_async_critic_ppo_runs_three_tiny_steps(tmp_path):
    metrics = run(tmp_path, "async-ppo-critic-math", "allocation_mode=local.d1p1t1+d1p1t1",
                  "rollout.max_head_offpolicyness=1", steps=3)
    assert all("critic/value_loss" in m and "reward/mean" in m for m in metrics)


@pytest.mark.parametrize("experiment", ["ppo-critic-math", "async-ppo-critic-math"])
def test_graph_orders_the_critic(experiment):
    cfg = load_config([f"experiment={experiment}", "model=tiny", "dataset=tiny-arith"])
    import_user_modules(cfg)
    g = build_graph(cfg, source_keys(cfg))
    order = g.order()
    assert order.index("critic_inf") < order.index("critic_train") and order.index("critic_inf") < order.index("actor_train")
    assert g.nodes["critic_train"].model == g.nodes["critic_inf"].model == "critic"
    assert cfg.roles()["critic"].head == "value" and cfg.roles()["critic"].trainable
    train = {m.name: m for m in cfg.mfcs}
    shared = {k: train["critic_train"].args[k] for k in ("gamma", "lam", "kl_in_reward")}
    assert {k: train["actor_train"].args[k] for k in shared} == shared  # one anchor sets both
    assert train["actor_train"].args["advantage"] == "gae"


def test_dfg_show_draws_the_critics_two_mfcs(tmp_path):
    png = tmp_path / "critic.png"
    r = subprocess.run([sys.executable, "-m", "realcore.dfg", "show", "experiment=ppo-critic-math", "model=tiny",
                        f"out={png}"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "critic_inf [critic_inf on critic]: input_ids -> values" in r.stdout
    assert "critic_train [critic_train on critic]:" in r.stdout
    assert png.stat().st_size > 0
