"""No reference model when nothing reads its log-probs: with ppo.kl_coef=0 (and no kl_in_reward)
ppo-math runs no ref_inf and builds no ref role; `ref=null` is valid then, and a one-line config
error while the KL term still needs the reference."""

import json
import os
import subprocess
import sys

import pytest

from realcore.dfg.graph import GraphError, build_graph
from realcore.dfg.prune import drop_unread_mfcs
from realcore.launch.config_loader import load_config
from realcore.api.registry import source_keys
import realcore.mfc  # noqa: F401  (the built-in MFCs register on import)

from test_run_metrics import assert_lengths_agree

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def pruned(*overrides):
    cfg = load_config(list(overrides))
    lines = drop_unread_mfcs(cfg)
    return cfg, build_graph(cfg, source_keys(cfg)), lines


def test_kl_coef_0_drops_ref_inf_and_the_ref_role():
    cfg, dfg, lines = pruned("experiment=ppo-math", "ppo.kl_coef=0")
    assert list(dfg.nodes) == ["actor_gen", "actor_train"]
    assert "ref_logprobs" not in dfg.nodes["actor_train"].inputs
    assert cfg.ref is None and "ref" not in cfg.roles()
    assert any(line.startswith("ref_inf is not run") for line in lines)
    assert any(line.startswith("model role ref is not built") for line in lines)
    assert drop_unread_mfcs(cfg) == []  # what a worker reading config.json sees: nothing more to drop


def test_ref_null_is_valid_without_a_kl_term():
    cfg, dfg, _ = pruned("experiment=ppo-math", "ppo.kl_coef=0", "ref=null")
    assert list(dfg.nodes) == ["actor_gen", "actor_train"] and cfg.ref is None


def test_ref_null_with_a_kl_term_is_a_one_line_error():
    cfg = load_config(["experiment=ppo-math", "ref=null"])
    with pytest.raises(GraphError) as e:
        drop_unread_mfcs(cfg)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("ref: null (with ppo.kl_coef=0.01)") and "ppo.kl_coef=0" in msg, msg


def test_a_kl_term_keeps_the_reference():
    for overrides in (["experiment=ppo-math"], ["experiment=ppo-critic-math"], ["experiment=reinforce-pp-math"],
                      ["experiment=async-ppo-critic-math"]):
        # ppo-critic-math and reinforce-pp-math: kl_coef 0, but the KL is in the reward (kl_in_reward)
        cfg, dfg, lines = pruned(*overrides)
        assert "ref_inf" in dfg.nodes and cfg.ref is not None and lines == [], overrides


def test_a_ref_mesh_with_nothing_to_run_is_an_error():
    cfg = load_config(["experiment=ppo-math", "ppo.kl_coef=0", "allocation_mode=actor:d1p1t1,ref:d1p1t1"])
    with pytest.raises(GraphError, match="allocation_mode: places role 'ref', but no MFC runs on it"):
        drop_unread_mfcs(cfg)


def test_ppo_math_with_kl_coef_0_builds_and_runs_no_reference(tmp_path):
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "realcore.launch", "experiment=ppo-math", "model=tiny", "ppo.kl_coef=0",
           "trainer.total_steps=2", "trainer.batch_size=4", "generation.n_samples=2", "generation.max_new_tokens=8",
           f"output_dir={out}", f"model.cache_dir={tmp_path}/cache", f"system.name_resolve.root={tmp_path}/nr",
           "trial_name=run-no-ref"]
    r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "realcore: ref_inf is not run" in r.stdout and "realcore: model role ref is not built" in r.stdout
    # The tiny model is a base model: the launcher's auto rule keeps plain prompts, says so, and records it.
    assert "realcore: model.use_chat_template: false (auto: a base model" in r.stdout
    saved = json.load(open(out / "config.json"))
    assert saved["model"]["use_chat_template"] is False
    assert saved["ref"] is None and [m["name"] for m in saved["mfcs"]] == ["actor_gen", "actor_train"]
    metrics = [json.loads(x) for x in open(out / "metrics.jsonl")]
    assert [m["step"] for m in metrics] == [1, 2]
    assert not any(k.startswith("time/ref_inf") for m in metrics for k in m)
    # The same length and throughput metrics as async runs (test_run_metrics), here from 2 workers.
    assert_lengths_agree(metrics, max_new_tokens=8, n_seqs=4 * 2)
