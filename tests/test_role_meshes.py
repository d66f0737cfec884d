"""Every role on its own mesh, end to end: actor and ref on two meshes (allocation_mode
actor:d1p1t1,ref:d1p1t1) give the same first-step reference log-probs as the colocated run (same
seed), MFCs on the two meshes run at the same time (on one mesh, one after another), and only the
policy's training counts a version (a second trainable role's does not)."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

PROBE = textwrap.dedent('''
    import torch
    from realcore.api.registry import MFCSpec, register_mfc

    @register_mfc("roles_probe")
    class Probe:
        """Model-free: what the two inference MFCs computed, as stats."""
        needs_model = False
        spec = MFCSpec(needs_model=False)
        def __init__(self, cfg, mfc):
            pass
        def run(self, model, batch):
            ref = torch.cat([t.float().flatten() for t in batch.flat("ref_logprobs")])
            act = torch.cat([t.float().flatten() for t in batch.flat("actor_logprobs")])
            return {"probe/ref_lp_sum": float(ref.sum()), "probe/actor_lp_sum": float(act.sum()), "probe/n": int(ref.numel())}
''')

EXPERIMENT = textwrap.dedent('''
    # @package _global_
    defaults:
      - ppo-math
    experiment_name: role-meshes
    imports: [roles_probe]
    roles: {side: {trainable: true, optimizer: {lr: 1.0e-3}}}
    mfcs:
      - {name: actor_gen, type: generate, model: actor, inputs: [prompt_ids, answer], outputs: [input_ids, loss_mask, behav_logprobs, rewards]}
      - {name: ref_inf, type: inference, model: ref, inputs: [input_ids], outputs: [logprobs], output_remap: {logprobs: ref_logprobs}}
      - {name: actor_inf, type: inference, model: actor, inputs: [input_ids], outputs: [logprobs], output_remap: {logprobs: actor_logprobs}}
      - {name: probe, type: roles_probe, inputs: [ref_logprobs, actor_logprobs]}
      - {name: side_train, type: sft_update, model: side, inputs: [input_ids, loss_mask]}
      - {name: actor_train, type: ppo_update, model: actor, inputs: [input_ids, loss_mask, behav_logprobs, rewards, ref_logprobs]}
''')

STEPS = 3


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The same experiment colocated (d1p1t1: one worker) and on two meshes (two workers)."""
    tmp = tmp_path_factory.mktemp("role-meshes")
    (tmp / "roles_probe.py").write_text(PROBE)
    (tmp / "exps" / "experiment").mkdir(parents=True)
    (tmp / "exps" / "experiment" / "role-meshes.yaml").write_text(EXPERIMENT)
    out = {}
    for name, mode in (("colocated", "d1p1t1"), ("meshes", "actor:d1p1t1,ref:d1p1t1")):
        run = tmp / name
        cmd = [sys.executable, "-m", "realcore.launch", f"hydra.searchpath=[file://{tmp}/exps]", "experiment=role-meshes",
               "model=tiny", f"trainer.total_steps={STEPS}", "trainer.batch_size=4", "generation.n_samples=2",
               "generation.max_new_tokens=8", "ppo.entropy_coef=0.01", "actor.optimizer.lr=1e-3",
               f"allocation_mode={mode}", f"output_dir={run}", f"model.cache_dir={tmp}/cache",
               f"system.name_resolve.root={run}/nr", f"trial_name=roles-{name}"]
        r = subprocess.run(cmd, cwd=tmp, capture_output=True, text=True, timeout=600,
                           env={**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp), os.environ.get("PYTHONPATH", "")])})
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        out[name] = (r.stdout, [json.loads(x) for x in open(run / "metrics.jsonl")], run)
    return out


def test_two_meshes_start_two_workers_and_train(runs):
    stdout, metrics, run = runs["meshes"]
    assert "master, model_worker/0, model_worker/1;" in stdout
    assert "master, model_worker/0;" in runs["colocated"][0]
    assert len(metrics) == STEPS
    # Only the policy's training makes a new version: side_train trains every step too.
    assert [m["version"] for m in metrics] == list(range(1, STEPS + 1))
    assert all("time/side_train_s" in m for m in metrics)
    # The policy trained (its log-probs moved away from the frozen reference's) ...
    assert abs(metrics[-1]["probe/actor_lp_sum"] - metrics[-1]["probe/ref_lp_sum"]) > 1e-3
    # ... and both trainable roles were saved, the policy at the checkpoint itself.
    ckpt = run / "checkpoints" / f"step_{STEPS}"
    assert (ckpt / "config.json").exists() and (ckpt / "side" / "config.json").exists()


def test_reference_on_its_own_mesh_computes_what_it_did_colocated(runs):
    one, two = runs["colocated"][1][0], runs["meshes"][1][0]
    assert one["probe/n"] == two["probe/n"] > 0
    # Same seed, same samples, same initial weights: the same reference log-probs (and the policy's,
    # untrained at step 1, equal to them).
    assert two["probe/ref_lp_sum"] == pytest.approx(one["probe/ref_lp_sum"], rel=1e-5, abs=1e-4)
    assert two["probe/ref_lp_sum"] == pytest.approx(two["probe/actor_lp_sum"], rel=1e-5, abs=1e-4)


def _span(m: dict, name: str) -> tuple[float, float]:
    return m[f"timeline/{name}_start_s"], m[f"timeline/{name}_end_s"]


def test_mfcs_on_two_meshes_overlap_and_on_one_mesh_queue(runs):
    # ref_inf (ref's mesh) and actor_inf (the actor's) wait only for actor_gen: with two meshes they
    # are sent together and run at the same time; colocated, one waits for the other.
    for m in runs["meshes"][1]:
        (a0, a1), (b0, b1) = _span(m, "ref_inf"), _span(m, "actor_inf")
        assert a0 < b1 and b0 < a1, m
        assert _span(m, "actor_gen")[1] <= min(a0, b0)
    for m in runs["colocated"][1]:
        (a0, a1), (b0, b1) = _span(m, "ref_inf"), _span(m, "actor_inf")
        assert a1 <= b0 or b1 <= a0, m


@pytest.mark.timeout(300)
def test_concurrency_bench_quick_prints_its_table():
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    r = subprocess.run([sys.executable, os.path.join(repo, "bench", "concurrency.py"), "--quick"], cwd=repo,
                       capture_output=True, text=True, timeout=280)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    rows = {line.split("|")[1].strip(): line.split("|")[2].strip() for line in r.stdout.splitlines()
            if line.startswith("| ") and not line.startswith("| |")}
    assert {"ref_inf alone", "ref2_inf alone", "ref3_inf alone", "sum of the three", "longest of the three",
            "step, colocated", "step, three meshes"} <= set(rows), r.stdout
    assert any(k.startswith("inference span, three meshes") for k in rows), r.stdout
    # Seconds to 3 decimals: the quick run's tiny-model MFC can take under 0.5 ms and print 0.000 (CI, 2026-11-30).
    assert all(float(v) >= 0 for v in rows.values()), rows
