"""Per-step length and throughput metrics, the same names in sync and async runs: gen/response_len
(mean), gen/response_len_max, gen/prompt_len (mean), gen/response_tokens, train/tokens,
perf/gen_tokens_per_s and perf/train_tokens_per_s. They must agree with the data trained on: a
single-turn sequence is its prompt then its response, so the tokens the update ran are the batch's
prompt plus response tokens."""

import json
import os
import subprocess
import sys

import pytest
import torch

from realcore.mfc.generate import length_stats, sequence_lengths
from realcore.trainer.metrics import add_throughput

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LENGTH_KEYS = ("gen/response_len", "gen/response_len_max", "gen/prompt_len", "gen/response_tokens", "train/tokens",
               "perf/gen_tokens_per_s", "perf/train_tokens_per_s")


def test_sequence_lengths_split_prompt_from_trained_tokens():
    masks = [torch.tensor([0, 0, 0, 1, 1]), torch.tensor([0, 1, 1, 0, 1, 1]), torch.tensor([0, 0])]
    assert sequence_lengths(masks) == ([3, 1, 2], [2, 4, 0])
    stats = length_stats([3, 1, 2], [2, 4, 0])
    assert stats == {"gen/response_len": 2.0, "gen/response_len_max": 4.0, "gen/prompt_len": 2.0,
                     "gen/response_tokens": 6}
    assert type(stats["gen/response_tokens"]) is int  # a count: summed over workers, not averaged


def test_throughput_divides_counts_by_their_time():
    m = {"gen/response_tokens": 60, "train/tokens": 200}
    add_throughput(m, gen_s=2.0, train_s=4.0)
    assert m["perf/gen_tokens_per_s"] == 30.0 and m["perf/train_tokens_per_s"] == 50.0
    m = {"train/tokens": 200}
    add_throughput(m, gen_s=0.0, train_s=0.0)  # no generation, no time: no rate rather than a division by 0
    assert "perf/gen_tokens_per_s" not in m and "perf/train_tokens_per_s" not in m


def assert_lengths_agree(metrics, *, max_new_tokens, n_seqs):
    for m in metrics:
        for key in LENGTH_KEYS:
            assert key in m, (key, m)
        assert 0 < m["gen/response_len"] <= m["gen/response_len_max"] <= max_new_tokens, m
        assert m["gen/prompt_len"] > 0, m
        assert m["gen/response_tokens"] == pytest.approx(m["gen/response_len"] * n_seqs), m
        # The update ran every token of the batch's sequences: prompt + response, once (ppo_epochs 1).
        assert m["train/tokens"] == pytest.approx(n_seqs * (m["gen/prompt_len"] + m["gen/response_len"])), m
        assert m["perf/gen_tokens_per_s"] > 0 and m["perf/train_tokens_per_s"] > 0, m


def test_async_run_reports_lengths_and_throughput_every_step(tmp_path):
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "realcore.launch", "experiment=async-ppo-math", "model=tiny", "dataset=tiny-arith",
           "eval.freq_steps=null", "trainer.total_steps=3", "trainer.batch_size=4", "generation.n_samples=2",
           "generation.max_new_tokens=8", f"output_dir={out}", f"model.cache_dir={tmp_path}/cache",
           f"system.name_resolve.root={tmp_path}/nr", "trial_name=run-async-metrics"]
    r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    metrics = [json.loads(x) for x in open(out / "metrics.jsonl")]
    assert [m["step"] for m in metrics] == [1, 2, 3]
    assert_lengths_agree(metrics, max_new_tokens=8, n_seqs=4 * 2)


def test_a_maximum_merges_as_the_largest_worker_value():
    from realcore.transport.columns import merged_stats

    merged = merged_stats([({"gen/response_len_max": 3.0, "gen/response_len": 2.0}, 1),
                           ({"gen/response_len_max": 7.0, "gen/response_len": 4.0}, 1)])
    assert merged == {"gen/response_len_max": 7.0, "gen/response_len": 3.0}
