"""Weight updates that provably land: after each update, a server's behaviour log-probs equal the
trainer's recomputation.

One real trainer per method (a float32 TorchEngine on the tiny model, trained with a learning rate
that moves its log-probs on the prompts below by 0.2-0.7 per step, measured and asserted), and one
real built-in server process (float32, bearer token, in-memory weights socket) shared by the
methods; each test first puts the server back on the base weights. Each method runs as a run
publishes (realcore.trainer.model_worker): `disk` (save_hf, then /update_weights_from_disk),
`memory` (push_weights over the authenticated wire), `nccl` (WeightSender's protocol over gloo:
NCCL itself needs GPUs), and LoRA's: the adapter folder alone (/load_lora_adapter through the
client's disk update), the adapter's tensors alone pushed in memory, and nccl's merged weights.

Each round: train one step -> update -> the server samples (temperature 1, return_logprob) a few
fixed prompts -> the trainer recomputes the same tokens' log-probs (engine.logprobs of prompt +
output, temperature 1) -> max |server - trainer| <= 1e-3. The trainer's recomputation with the
previous weights must differ from the server's by far more (mean > 0.05), so a server that kept
its old weights fails. The same check holds for a run's server SIGKILLed mid-run and restarted in
place: against the checkpoint of the version it reports, and not the initial weights.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from realcore.api.config import LoraConfig, OptimizerConfig, RoleConfig
from realcore.backends import lora, weight_group
from realcore.backends.clients.sglang_api import push_weights
from realcore.backends.torch_engine import TorchEngine
from realcore.weights.broadcast import WeightSender
from test_weight_broadcast import TOKEN, call  # `fn(client)` in a fresh event loop, with the same token

pytestmark = pytest.mark.timeout(120)
torch.set_num_threads(1)
SECRET = b"w" * 32
TOLERANCE = 1e-3  # server vs trainer, float32 on both sides (observed: ~1e-5)
MIN_MOVE = 0.05  # mean |log-prob change| per training step, over the generated tokens
ROUNDS = 2
PROMPTS = [[5, 17, 42, 9, 100], [300, 7, 88, 1], [64, 65, 66, 67, 68, 69]]
SAMPLED = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "max_new_tokens": 12, "ignore_eos": True}
SERVER = """
import json, os, sys
from realcore.backends.genserver.http import run_server
run_server(sys.argv[1], seed=3, max_batch_size=8, token=sys.argv[2], secret=bytes.fromhex(os.environ["SECRET_HEX"]),
           dtype="float32", on_ready=lambda a: print(json.dumps(a), flush=True))
"""
METHODS = ["disk", "memory", "nccl", "lora-disk", "lora-memory", "lora-nccl"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    from test_gen_server import _make_model

    root = tmp_path_factory.mktemp("wupd")
    return _make_model(root / "cache", root / "base", 0)  # tiny qwen2, weights spread (varied sampling)


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    """{"http", "weights"}: the addresses of a built-in server of `model_dir`."""
    log = open(tmp_path_factory.mktemp("log") / "server.log", "w+")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "SECRET_HEX": SECRET.hex()}
    proc = subprocess.Popen([sys.executable, "-c", SERVER, model_dir, TOKEN], stdout=subprocess.PIPE, stderr=log,
                            env=env, text=True)
    try:
        line = proc.stdout.readline()  # on_ready's JSON, or "" if the server died
        if not line:
            log.seek(0)
            pytest.fail(f"server did not start:\n{log.read()[-3000:]}")
        yield json.loads(line)
    finally:
        proc.terminate()  # SIGTERM: run_server returns, the process exits 0
        assert proc.wait(timeout=30) == 0


def trainer(model_dir: str, with_lora: bool) -> TorchEngine:
    """Float32 compute (the role's "auto" is bf16 on a GPU). Constant learning rates that move the
    log-probs of the sampled tokens by 0.2-0.7 per step on average (measured), far above MIN_MOVE."""
    lr = 3e-2 if with_lora else 5e-3
    cfg = LoraConfig(rank=4, alpha=8.0) if with_lora else None
    role = RoleConfig(trainable=True, dtype="float32", optimizer=OptimizerConfig(lr=lr, lr_scheduler="constant"),
                      lora=cfg)
    return TorchEngine(model_dir, role, total_steps=ROUNDS)


def train_step(engine: TorchEngine) -> None:
    """Maximise the log-prob of fixed target tokens after each prompt (one optimizer step)."""
    g = torch.Generator().manual_seed(7)
    targets = [torch.randint(0, 512, (8,), generator=g).tolist() for _ in PROMPTS]
    data = {"input_ids": [torch.tensor(p + t) for p, t in zip(PROMPTS, targets)],
            "loss_mask": [torch.tensor([0] * len(p) + [1] * len(t)) for p, t in zip(PROMPTS, targets)]}

    def nll(out, mb):
        mask = mb["loss_mask"].float()
        loss = -(out.logprobs * mask).sum() / mask.sum()
        return loss, {"loss": loss.detach()}

    engine.train_batch(data, nll, lambda mb: float(mb["loss_mask"].sum()))


def publish(method: str, engine: TorchEngine, server: dict, version: int, folder, sender: WeightSender | None) -> None:
    """Hand the trainer's weights to the server as a run's model worker does for `method`."""
    if method in ("disk", "lora-disk"):
        path = str(folder / f"v{version}")
        engine.save_hf(path, merged=False)  # LoRA: the adapter folder alone, as model_worker writes it
        call(server["http"], lambda c: c.update_weights_from_disk(path, version))  # LoRA: /load_lora_adapter
    elif method == "memory":
        push_weights(server["weights"], SECRET, str(version), engine.hf_state_dict(), 30)
    elif method == "lora-memory":
        header = {"name": lora.LORA_NAME, "config": lora.adapter_config(engine.role.lora)}
        push_weights(server["weights"], SECRET, str(version), engine.adapter_state(), 30, lora=header)
    else:  # nccl, lora-nccl: the (merged) full weights in buckets over the weight-update group
        assert sender.send(engine.hf_state_dict(), version, [server["http"]]) == []


def sample(server: dict) -> list:
    """The server's sampled continuations of PROMPTS, with their behaviour log-probs."""

    async def fn(client):
        return await asyncio.gather(*(client.generate(p, SAMPLED, rid=os.urandom(6).hex(), return_logprob=True)
                                      for p in PROMPTS))

    return call(server["http"], fn)


def served(replies) -> torch.Tensor:
    """The server's behaviour log-probs of every generated token, concatenated as recompute's."""
    return torch.tensor([x for r in replies for x in r.output_logprobs])


def recompute(engine: TorchEngine, replies, params: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
    """The trainer's log-probs (temperature 1) of every generated token, concatenated; with `params`
    (trainable parameters by name) in place of the current ones for this call."""
    live = dict(engine.model.named_parameters())
    current = {n: live[n].detach().clone() for n in params or {}}
    with torch.no_grad():
        for n, t in (params or {}).items():
            live[n].copy_(t)
    try:
        seqs = [torch.tensor(p + r.output_ids) for p, r in zip(PROMPTS, replies)]
        return torch.cat([lp[len(p):] for lp, p in zip(engine.logprobs(seqs, 1.0), PROMPTS)])
    finally:
        with torch.no_grad():
            for n, t in current.items():
                live[n].copy_(t)


def trainable(engine: TorchEngine) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in engine.model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("method", METHODS)
def test_server_logprobs_equal_the_trainers_after_each_update(method, model_dir, server, tmp_path, monkeypatch):
    engine = trainer(model_dir, method.startswith("lora"))
    sender = None
    if method.endswith("nccl"):
        monkeypatch.setattr(weight_group, "default_backend", lambda: "gloo")  # the CPU server's, on a GPU host too
        cfg = SimpleNamespace(
            system=SimpleNamespace(host="127.0.0.1", startup_timeout_s=30.0, request_timeout_s=30.0),
            rollout=SimpleNamespace(server_token=TOKEN, request_timeout_s=30.0, weight_bucket_mb=0.05))
        sender = WeightSender(cfg, engine="local", tp=1)  # gloo on CPU; 0.05 MB: several buckets
    # The shared server back on the base weights (a full update also drops a merged LoRA adapter).
    call(server["http"], lambda c: c.update_weights_from_disk(model_dir, "0"))
    replies = sample(server)
    assert [r.weight_version for r in replies] == ["0"] * len(PROMPTS)
    err = float((served(replies) - recompute(engine, replies)).abs().max())
    assert err <= TOLERANCE, f"before any update the server already disagrees: {err:.2e}"
    seen = []
    try:
        for version in range(1, ROUNDS + 1):
            previous = trainable(engine)
            train_step(engine)
            publish(method, engine, server, version, tmp_path, sender)
            replies = sample(server)
            assert [r.weight_version for r in replies] == [str(version)] * len(PROMPTS)
            behaviour = served(replies)
            now, before = recompute(engine, replies), recompute(engine, replies, previous)
            err, moved, stale = ((behaviour - now).abs().max().item(), (now - before).abs().mean().item(),
                                 (behaviour - before).abs().mean().item())
            seen.append((version, err, moved))
            assert moved > MIN_MOVE, f"v{version}: the step barely moved the policy (mean {moved:.3f})"
            assert err <= TOLERANCE, (f"v{version} by {method}: max |server - trainer| = {err:.2e} > {TOLERANCE:g} "
                                      f"(the step moved log-probs by {moved:.3f} on average)")
            assert stale > MIN_MOVE, f"v{version}: the server still looks like the previous weights ({stale:.3f})"
    finally:
        if sender is not None and sender.group is not None:
            weight_group.close_group(sender.group)
            call(server["http"], lambda c: c.destroy_weights_update_group(sender.group_name))
        print(f"\n{method}: " + ", ".join(f"v{v} max|diff| {e:.1e} mean move {m:.3f}" for v, e, m in seen))


@pytest.mark.timeout(600)
def test_a_restarted_servers_logprobs_are_the_trainers(tmp_path):
    """A run's only generation server is SIGKILLed mid-run and restarted in place (disk update):
    its log-probs of its own samples then equal the trainer's recomputation with the weights of the
    version it reports (that step's checkpoint), and not the initial weights'."""
    import time

    from realcore.api.config import ExperimentConfig
    from realcore.backends.clients.sglang_api import GenClient
    from realcore.backends.server_launch import server_token
    from realcore.transport import keys, wire
    from realcore.transport.name_resolve import make_name_resolver
    from test_e2e_sync import assert_all_gone, wait_for_metrics
    from test_recovery import ASYNC, REPO, cmd, kill_when

    out, cache = str(tmp_path / "run"), str(tmp_path / "cache")
    # The tiny model's rewards are all 0 at first: the entropy bonus is what moves its weights.
    proc = subprocess.Popen(cmd(out, "recover_mode=auto", "rollout.weight_update=disk", "trainer.total_steps=1000",
                                "trainer.save_freq_steps=1", "ppo.entropy_coef=0.05", "actor.optimizer.lr=1e-2",
                                cache=cache, base=ASYNC),
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        killed = kill_when(proc, out, "gen_server/0", 3)
        cfg = ExperimentConfig.model_validate_json(open(os.path.join(out, "config.json")).read())
        secret = wire.load_secret(os.path.join(out, ".secret"))
        token = server_token(secret, cfg.rollout.server_token)
        resolver, deadline = make_name_resolver(cfg.system.name_resolve, secret), time.monotonic() + 120
        while json.load(open(os.path.join(out, "pids.json")))["gen_server/0"] == killed:  # restarted in place
            assert proc.poll() is None and time.monotonic() < deadline, "gen_server/0 was not restarted"
            time.sleep(0.2)
        wait_for_metrics(out, len(open(os.path.join(out, "metrics.jsonl")).readlines()) + 2, proc)  # it serves again

        async def sample_at_one_version():
            url = json.loads(resolver.get(keys.gen_server(cfg, 0)))["http"]
            client = GenClient(url, token=token, timeout_s=30)
            try:
                while True:  # the version before and after the samples: the same one throughout
                    before = (await client.server_info())["weight_version"]
                    replies = await asyncio.gather(*(client.generate(p, SAMPLED, rid=os.urandom(6).hex(), return_logprob=True)
                                                     for p in PROMPTS))
                    if (await client.server_info())["weight_version"] == before:
                        return int(before), replies
            finally:
                await client.close()

        version, replies = asyncio.run(asyncio.wait_for(sample_at_one_version(), 120))
        checkpoint = os.path.join(out, "checkpoints", f"step_{version}")
        while not os.path.exists(os.path.join(checkpoint, "model.safetensors")):  # saved after its publication
            assert proc.poll() is None and time.monotonic() < deadline + 120, checkpoint
            time.sleep(0.2)
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.communicate(timeout=60)
        finally:
            proc.kill()
    assert version > 3
    err = (served(replies) - recompute(trainer(checkpoint, False), replies)).abs()
    assert err.max() <= TOLERANCE, err.max()
    (initial,) = [os.path.join(cache, d) for d in os.listdir(cache) if d.startswith("tiny-")]
    assert (served(replies) - recompute(trainer(initial, False), replies)).abs().mean() > MIN_MOVE
    assert_all_gone(out)
