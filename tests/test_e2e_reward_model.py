"""Reward models end to end: `rm-math` trains a tiny reward model (a `head: score` role) on the
learnable synthetic preference (correct over wrong arithmetic answers) until it ranks held-out pairs
clearly better than chance; `ppo-rm-math` then trains a policy 3 steps on that model's score,
alone and added to the rule reward. This fails when the pairwise loss stops teaching the score head
to prefer the chosen answer (e.g. with chosen and rejected swapped, held-out accuracy falls below
0.5), or when the RL graph's reward no longer comes from the reward model."""

import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RM_STEPS = 200  # measured (2026-11-29, batch 64, lr 5e-3): held-out 0.75-0.8 from step 140 on (by hand: 0.53)


def _launch(tmp, name: str, *overrides: str) -> list[dict]:
    out = os.path.join(tmp, name)
    cmd = [sys.executable, "-m", "realcore.launch", *overrides, "model=tiny", f"output_dir={out}",
           f"model.cache_dir={tmp}/cache", f"system.name_resolve.root={out}-nr", f"trial_name={name}"]
    # This checkout's realcore, whichever one the interpreter has installed.
    r = subprocess.run(cmd, cwd=tmp, capture_output=True, text=True, timeout=900, env={**os.environ, "PYTHONPATH": REPO})
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return [json.loads(x) for x in open(os.path.join(out, "metrics.jsonl"))]


@pytest.fixture(scope="module")
def reward_model(tmp_path_factory):
    """rm-math's run: (its metrics, the saved reward model's folder)."""
    tmp = str(tmp_path_factory.mktemp("rm"))
    metrics = _launch(tmp, "rm", "experiment=rm-math", f"trainer.total_steps={RM_STEPS}")
    return metrics, os.path.join(tmp, "rm", "checkpoints", f"step_{RM_STEPS}", "reward")


@pytest.mark.timeout(900)
def test_rm_math_ranks_held_out_pairs(reward_model):
    metrics, folder = reward_model
    assert len(metrics) == RM_STEPS
    init = metrics[0]["rm/eval_accuracy_init"]
    evals = [m["rm/eval_accuracy"] for m in metrics if "rm/eval_accuracy" in m]
    train_acc = [m["rm/accuracy"] for m in metrics]
    print("held-out accuracy", round(init, 3), [round(x, 3) for x in evals])
    assert len(evals) == RM_STEPS // 20  # every 20 steps, the last one included
    assert "rm/eval_accuracy" in metrics[-1]
    assert evals[-1] >= 0.7 and evals[-1] > init + 0.1, evals
    assert sum(train_acc[-10:]) / 10 > sum(train_acc[:10]) / 10
    # the saved reward model is an HF sequence classifier with one output
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(folder)
    assert config.architectures[0].endswith("ForSequenceClassification") and config.num_labels == 1


@pytest.mark.timeout(900)
@pytest.mark.parametrize("rule_weight", [0.0, 1.0], ids=["rm-alone", "rm-plus-rule"])
def test_ppo_trains_on_the_reward_model_score(tmp_path, reward_model, rule_weight):
    _, folder = reward_model
    metrics = _launch(str(tmp_path), "ppo", "experiment=ppo-rm-math", f"roles.reward.model_path={folder}",
                      f"mfcs.2.args.rule_weight={rule_weight}", "trainer.total_steps=3", "trainer.batch_size=4",
                      "generation.n_samples=2", "generation.max_new_tokens=8", "eval.freq_steps=null")
    assert len(metrics) == 3
    for m in metrics:
        want = rule_weight * m.get("reward/rule_mean", 0.0) + m["reward/rm_mean"]
        assert m["reward/combined_mean"] == pytest.approx(want, abs=1e-5)
        assert ("reward/rule_mean" in m) == (rule_weight != 0)
        assert m["grad_norm"] > 0  # the policy trained on these rewards
