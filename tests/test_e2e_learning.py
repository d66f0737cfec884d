"""PPO learns: a tiny random model on a task it can learn in a few steps (emit even token ids; the
reward is the fraction of generated tokens that are even, about 0.5 by chance) must raise its reward,
in sync and in async mode. This fails when the update stops improving the policy (e.g. with the
advantage's sign flipped, the reward falls instead)."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = 12

REWARD = textwrap.dedent('''
    from realcore.api.registry import register_reward

    @register_reward("even-tokens")
    def even_tokens(prompt, completion, prompt_ids, completion_ids, **data):
        return sum(t % 2 == 0 for t in completion_ids) / max(len(completion_ids), 1)
''')

COMMON = ["model=tiny", "dataset=tiny-arith", "imports=[learn_reward]", "reward.type=even-tokens", f"trainer.total_steps={STEPS}",
          "trainer.batch_size=8", "generation.n_samples=4", "generation.max_new_tokens=8", "generation.temperature=1.0",
          "ppo.kl_coef=0.0", "actor.optimizer.lr=0.01", "actor.optimizer.lr_scheduler=constant", "eval.freq_steps=null"]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("experiment", ["ppo-math", "async-ppo-math"])
def test_ppo_raises_a_learnable_reward(tmp_path, experiment):
    (tmp_path / "learn_reward.py").write_text(REWARD)
    out = str(tmp_path / "run")
    extra = ["rollout.max_head_offpolicyness=1"] if experiment.startswith("async") else []
    cmd = [sys.executable, "-m", "realcore.launch", f"experiment={experiment}", *COMMON, *extra, f"output_dir={out}",
           f"model.cache_dir={tmp_path}/cache", f"system.name_resolve.root={out}-nr"]
    r = subprocess.run(cmd, cwd=str(tmp_path), capture_output=True, text=True, timeout=500, env={**os.environ, "PYTHONPATH": ""})
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rewards = [json.loads(x)["reward/mean"] for x in open(os.path.join(out, "metrics.jsonl"))]
    first, last = sum(rewards[:3]) / 3, sum(rewards[-3:]) / 3
    print(experiment, [round(x, 3) for x in rewards])
    assert last > first + 0.15, rewards
    assert os.path.exists(os.path.join(out, "curves.png"))  # the run's picture (realcore.plot)
