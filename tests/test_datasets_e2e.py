"""Data as users have it, end to end: a parquet file with mapped keys (sync PPO) and an HF
`datasets` folder of splits (async PPO) each train a tiny run, and the user's reward sees each row's
extra field: it pays 1.0 only when `difficulty` is the one written in that row (10 x its answer),
so a run whose reward/mean is 1.0 at every step proves the field reached the reward with its row."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

REWARD = textwrap.dedent('''
    from realcore.api.registry import register_reward

    @register_reward("sees-difficulty")
    def sees_difficulty(prompt, completion, prompt_ids, completion_ids, *, answer, **data):
        return 1.0 if data.get("difficulty") == 10 * int(answer) else 0.0
''')

ROWS = [{"problem": f"What is {i} + 2?", "solution": str(i + 2), "difficulty": 10 * (i + 2)} for i in range(16)]


def _write_parquet(path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(ROWS), str(path))


def _write_hf_splits(path):
    import datasets

    other = [{**r, "difficulty": -1} for r in ROWS]  # the wrong split would pay 0
    datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS),
                          "test": datasets.Dataset.from_list(other)}).save_to_disk(str(path))


@pytest.mark.timeout(600)
@pytest.mark.parametrize("kind", ["parquet", "hf"])
def test_a_users_file_trains_and_its_fields_reach_the_reward(tmp_path, kind):
    (tmp_path / "my_reward.py").write_text(REWARD)
    if kind == "parquet":
        experiment, data = "ppo-math", tmp_path / "data.parquet"
        _write_parquet(data)
        dataset = f"dataset={{type: parquet, path: {data}, prompt_key: problem, answer_key: solution}}"
    else:
        experiment, data = "async-ppo-math", tmp_path / "data_hf"
        _write_hf_splits(data)
        dataset = f"dataset={{type: hf, path: {data}, split: train, prompt_key: problem, answer_key: solution}}"
    out = str(tmp_path / "run")
    cmd = [sys.executable, "-m", "realcore.launch", f"experiment={experiment}", "model=tiny", dataset,
           "imports=[my_reward]", "reward.type=sees-difficulty", "trainer.total_steps=2", "trainer.batch_size=4",
           "generation.n_samples=2", "generation.max_new_tokens=4", "eval.freq_steps=null", f"output_dir={out}",
           f"trial_name=data-{kind}", f"model.cache_dir={tmp_path}/cache", f"system.name_resolve.root={out}-nr"]
    # cwd: the user's reward module is imported from there; PYTHONPATH: this checkout's realcore.
    r = subprocess.run(cmd, cwd=str(tmp_path), capture_output=True, text=True, timeout=560,
                       env={**os.environ, "PYTHONPATH": REPO})
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    metrics = [json.loads(x) for x in open(os.path.join(out, "metrics.jsonl"))]
    assert [m["step"] for m in metrics] == [1, 2]
    assert [m["reward/mean"] for m in metrics] == [1.0, 1.0], metrics


def test_a_key_no_row_has_is_refused_before_any_worker(tmp_path):
    """A mapping mistake is one line and exit 2 from the launcher's input checks: no worker starts."""
    data = tmp_path / "data.parquet"
    _write_parquet(data)
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "realcore.launch", "experiment=ppo-math", "model=tiny",
           f"dataset={{type: parquet, path: {data}, prompt_key: question, answer_key: solution}}",
           f"output_dir={out}", "trial_name=data-refused", f"model.cache_dir={tmp_path}/cache",
           f"system.name_resolve.root={out}-nr"]
    r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": REPO})
    assert r.returncode == 2, r.stdout[-2000:] + r.stderr[-2000:]
    assert r.stderr.splitlines() == [f"realcore: config error: dataset: {data} row 1: no key 'question' in any row "
                                     "(keys: difficulty, problem, solution); set dataset.prompt_key"], r.stderr
    if out.is_dir():
        assert not {"logs", "pids.json", "config.json"} & set(os.listdir(out)), os.listdir(out)
