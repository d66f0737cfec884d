"""End-to-end with the Megatron backend: `ppo-math` on a TP=2 x PP=2 mesh of 4 model workers,
generation on a built-in server that receives the trained weights after every step.

Also: the launcher refuses Megatron layouts that cannot work here or that Megatron gets wrong,
with one line and exit code 2, before any worker starts.
"""

import json
import os
import subprocess
import sys

import pytest

from conftest import import_unless_ci  # noqa: E402

import_unless_ci("megatron.core", "pip install -e '.[megatron]'")

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MEGATRON = ["experiment=ppo-math", "model=tiny", "actor.backend=megatron"]


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return str(tmp_path_factory.mktemp("model-cache"))


# The random tiny model never solves a problem; a reward that varies gives non-zero advantages.
PARITY_REWARD = """
from realcore.api.registry import register_reward


@register_reward("odd-length")
def odd_length(prompt, completion, prompt_ids, completion_ids, **data):
    return float(len(completion) % 2)
"""


def launch(out, *overrides, cache, timeout=600, cwd=REPO):
    cmd = [sys.executable, "-m", "realcore.launch", *MEGATRON, f"output_dir={out}", f"model.cache_dir={cache}",
           f"system.name_resolve.root={out}/nr", *overrides]
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout)


def test_ppo_math_on_tp2_pp2_mesh(tmp_path, cache):
    out = str(tmp_path / "run")
    (tmp_path / "parity_reward.py").write_text(PARITY_REWARD)
    # A large learning rate makes each step move the weights a lot: stale server weights would show.
    r = launch(out, "allocation_mode=local.d1p1t1+d1p2t2", "trainer.total_steps=3", "actor.optimizer.lr=1e-2",
               "imports=[parity_reward]", "reward.type=odd-length", cache=cache, cwd=str(tmp_path))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "model_worker/3" in r.stdout and "gen_server/0" in r.stdout
    rows = [json.loads(x) for x in open(os.path.join(out, "metrics.jsonl"))]
    assert [m["version"] for m in rows] == [1, 2, 3]
    for m in rows:
        # The server's behaviour log-probs equal the mesh's recomputed ones: the server samples
        # with exactly the weights that were trained (pushed after each step).
        assert abs(m["ppo/ratio_max"] - 1.0) < 1e-3, m
    assert all(m["grad_norm"] > 0 for m in rows), rows
    assert rows[-1]["ppo/kl"] > 1e-4, rows  # the actor moved away from the reference
    ckpt = os.path.join(out, "checkpoints", "step_3")
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(ckpt)  # a plain HF checkpoint


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["allocation_mode=d1p2t1"], "actor.backend=megatron samples on generation servers"),
        (["allocation_mode=local.d1+d1p1t1c2"], "context parallel (c2) needs TransformerEngine"),
        (["allocation_mode=local.d1+d1p2t1", "actor.megatron.virtual_pipeline_stages=2"],
         "actor.megatron.batch_p2p_comm: with virtual pipeline stages at PP=2"),
        (["allocation_mode=local.d1+d2p1t1e2"], "expert parallel (e2) needs an MoE model"),
        (["allocation_mode=local.d1+d1p2t1", "ref.backend=torch"], "ref.backend=torch supports data parallel only"),
        (["allocation_mode=local.d1+d1p1t8"], "num_attention_heads=4 is not divisible by tp=8"),
        (["allocation_mode=local.d1+d1p4t1"], "num_hidden_layers=2 is not divisible by pp=4"),
    ],
)
def test_bad_megatron_layout_exits_2_with_one_line(tmp_path, cache, overrides, message):
    r = launch(str(tmp_path), *overrides, cache=cache, timeout=120)
    assert r.returncode == 2, r.stderr[-2000:]
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], r.stderr


def test_killed_rank_recovers_from_megatron_checkpoint(tmp_path, cache):
    """recover_mode=auto on a TP=2 mesh: a rank is SIGKILLed after step 2; the run restarts from
    its recover checkpoint (model and distributed-optimizer state through megatron-core's own
    checkpointing) and finishes. After the restart the server samples with the restored weights
    (its behaviour log-probs equal the mesh's), so what was restored is what was trained."""
    import signal
    import time

    from realcore.trainer.ledger import audit

    out = str(tmp_path / "run")
    (tmp_path / "parity_reward.py").write_text(PARITY_REWARD)
    cmd = [sys.executable, "-m", "realcore.launch", *MEGATRON, f"output_dir={out}", f"model.cache_dir={cache}",
           f"system.name_resolve.root={out}/nr", "allocation_mode=local.d1p1t1+d1p1t2", "trainer.total_steps=4",
           "actor.optimizer.lr=1e-2", "imports=[parity_reward]", "reward.type=odd-length", "recover_mode=auto",
           "trainer.recover_freq_steps=1", "recover_delay_s=0"]
    proc = subprocess.Popen(cmd, cwd=str(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 600
        while time.time() < deadline and proc.poll() is None:
            if os.path.exists(os.path.join(out, "metrics.jsonl")) and len(open(os.path.join(out, "metrics.jsonl")).readlines()) >= 2:
                os.kill(json.load(open(os.path.join(out, "pids.json")))["model_worker/1"], signal.SIGKILL)
                break
            time.sleep(0.2)
        stdout, stderr = proc.communicate(timeout=900)
    finally:
        proc.kill()
    assert proc.returncode == 0, stdout[-3000:] + stderr[-3000:]
    assert "resuming from step" in stdout
    rows = [json.loads(x) for x in open(os.path.join(out, "metrics.jsonl"))]
    assert [m["version"] for m in rows] == [1, 2, 3, 4]
    assert all(abs(m["ppo/ratio_max"] - 1.0) < 1e-3 for m in rows), rows
    a = audit(out, batch_size=8)
    assert a.steps == 4 and a.duplicated == 0 and a.short_steps == []
