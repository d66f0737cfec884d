"""A researcher's own reward and MFC, from one Python file and their own experiment YAML (the files in
examples/, which the README shows verbatim), run end to end through the launcher without touching
realcore: the MFC's output is what the PPO update trains on."""

import json
import os
import re
import shutil
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(REPO, "examples")
FILES = ("my_mfcs.py", os.path.join("my_experiments", "experiment", "mine.yaml"))


def test_the_readme_shows_the_example_files_verbatim():
    blocks = re.findall(r"```(?:python|yaml)\n(.*?)```", open(os.path.join(REPO, "README.md")).read(), re.DOTALL)
    for name in FILES:
        text = open(os.path.join(EXAMPLES, name)).read()
        assert f"# examples/{name}\n" + text in blocks, f"README does not show examples/{name} as it is"


def test_user_mfc_from_own_file_and_yaml(tmp_path):
    for name in FILES:  # the user's folder: their two files, nothing else
        os.makedirs(os.path.dirname(tmp_path / name), exist_ok=True)
        shutil.copy(os.path.join(EXAMPLES, name), tmp_path / name)
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "realcore.launch", f"hydra.searchpath=[file://{tmp_path}/my_experiments]", "experiment=mine",
           "model=tiny", "trainer.total_steps=2", "trainer.batch_size=4", "generation.n_samples=2", "generation.max_new_tokens=6",
           "mfcs.2.args.coef=0.5", f"output_dir={out}", f"model.cache_dir={tmp_path}/cache",
           f"system.name_resolve.root={tmp_path}/nr"]
    r = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=600,
                       env={**os.environ, "PYTHONPATH": ""})
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    # every output is read: the reward's (renamed task_rewards) by the penalty, the penalty's rewards by the update
    assert "reward [reward on -]: input_ids, loss_mask, answer -> task_rewards" in r.stdout
    assert "penalty [length_penalty on -]: task_rewards, loss_mask -> rewards" in r.stdout
    assert "actor_train [ppo_update on actor]: input_ids, loss_mask, behav_logprobs, rewards, ref_logprobs" in r.stdout
    metrics = [json.loads(x) for x in open(out / "metrics.jsonl")]
    assert len(metrics) == 2 and all("time/penalty_s" in m and m["penalty/mean_len"] > 0 for m in metrics)
    for m in metrics:  # rewards = the exact reward - coef x length, with the coef given on the command line
        assert abs(m["penalty/shaped_mean"] - (m["reward/mean"] - 0.5 * m["penalty/mean_len"])) < 1e-5, m
    for override, message in (("mfcs.2.args.coef=lots", "mfcs[2] (penalty).args.coef: Input should be a valid number"),
                              ("+mfcs.2.args.coeff=1", "mfcs[2] (penalty).args.coeff: Extra inputs are not permitted"),
                              ("+mfcs.1.args.coef=1", "mfcs[1] (reward).args: MFC type 'reward' declares no Args model")):
        r = subprocess.run(cmd + [override], cwd=tmp_path, capture_output=True, text=True, timeout=600,
                           env={**os.environ, "PYTHONPATH": ""})
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 2 and len(lines) == 1 and message in lines[0], r.stderr[-2000:]
