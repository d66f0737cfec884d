"""LoRA (actor.lora, PEFT): only the adapters train; checkpoints hold the adapter (plus a merged HF
export on request) and reload exactly; the built-in server applies an adapter through SGLang's
/load_lora_adapter and then generates as a server of the merged weights; an async run with LoRA
ends with its servers at the trainer's version."""

from __future__ import annotations

import asyncio
import json
import os
import re
import socket
import subprocess
import sys

import pytest
import torch

from realcore.api.config import LoraConfig, OptimizerConfig, RoleConfig
from realcore.backends import lora
from realcore.backends.clients.sglang_api import GenClient
from realcore.backends.torch_engine import TorchEngine
from test_torch_engine import make_data, n_loss_tokens, nll_loss
from test_weight_broadcast import GREEDY, PROMPT, Servers, call, greedy

pytestmark = pytest.mark.timeout(300)
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
torch.set_num_threads(1)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    from test_gen_server import _make_model

    root = tmp_path_factory.mktemp("lora")
    return _make_model(root / "cache", root / "base", 0)  # tiny qwen2 with a tokenizer, spread weights


def lora_role(**lora_kw) -> RoleConfig:
    return RoleConfig(trainable=True, optimizer=OptimizerConfig(lr=1e-2, eps=1e-3),
                      lora=LoraConfig(rank=4, alpha=8.0, **lora_kw))


def spread_adapter(engine: TorchEngine, seed: int) -> None:
    """PEFT starts B at zero (the adapter changes nothing); a large random B makes the merged
    model's greedy tokens differ from the base model's, so the comparisons below are not vacuous."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in engine.model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.3, generator=g)


def test_only_adapters_train_and_base_weights_stay_bit_identical(model_dir):
    eng = TorchEngine(model_dir, lora_role(target_modules=["q_proj", "v_proj", "down_proj"]), total_steps=10)
    names = [n for n, p in eng.model.named_parameters() if p.requires_grad]
    assert names and all("lora_A" in n or "lora_B" in n for n in names)
    assert {id(p) for g in eng.optimizer.param_groups for p in g["params"]} == {id(p) for p in eng.params}
    assert len(eng.params) == len(names) == 2 * 2 * 3  # A and B, 2 layers, 3 target modules
    before = {n: p.detach().clone() for n, p in eng.model.named_parameters()}
    # Every data-parallel rank builds the same adapter (PEFT's random A is drawn from the seed).
    torch.manual_seed(123)  # whatever the global random state
    twin = TorchEngine(model_dir, lora_role(target_modules=["q_proj", "v_proj", "down_proj"]), total_steps=10)
    assert all(torch.equal(p, before[n]) for n, p in twin.model.named_parameters())
    eng.train_batch(make_data([7, 5, 9], seed=1), nll_loss, n_loss_tokens)
    eng.train_batch(make_data([6, 8], seed=2), nll_loss, n_loss_tokens)
    after = dict(eng.model.named_parameters())
    for n, p in after.items():
        if n in names:
            assert not torch.equal(p, before[n]), f"adapter {n} did not change"
        else:
            assert torch.equal(p, before[n]), f"base weight {n} changed"


def test_adapter_checkpoint_and_merged_export(model_dir, tmp_path):
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    role = lora_role(export_merged=True)
    eng = TorchEngine(model_dir, role, total_steps=10)
    spread_adapter(eng, 0)
    eng.train_batch(make_data([7, 5, 9], seed=1), nll_loss, n_loss_tokens)
    eng.save_hf(str(tmp_path / "ckpt"))
    files = set(os.listdir(tmp_path / "ckpt"))
    assert {"adapter_model.safetensors", "adapter_config.json", "merged"} <= files and "model.safetensors" not in files
    saved = load_file(str(tmp_path / "ckpt" / "adapter_model.safetensors"))
    assert saved and all(".lora_A." in k or ".lora_B." in k for k in saved)

    seqs = make_data([9, 4, 12], seed=3)["input_ids"]
    want = eng.logprobs(seqs)

    def plain_logprobs(model):
        out = []
        with torch.no_grad():
            for s in seqs:
                logits = model(input_ids=s[None]).logits[0].float()
                out.append(torch.cat([torch.zeros(1), logits[:-1].log_softmax(-1).gather(1, s[1:, None])[:, 0]]))
        return out

    # The adapter folder on the plain base model (PEFT's own loader) gives the same log-probs.
    base = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="sdpa", dtype=torch.float32)
    reloaded = PeftModel.from_pretrained(base, str(tmp_path / "ckpt")).eval()
    for a, b in zip(plain_logprobs(reloaded), want):
        torch.testing.assert_close(a[1:], b[1:], rtol=0, atol=1e-5)
    # The merged export loads in transformers alone, and matches.
    merged = AutoModelForCausalLM.from_pretrained(str(tmp_path / "ckpt" / "merged"), dtype=torch.float32).eval()
    assert not hasattr(merged, "peft_config")
    for a, b in zip(plain_logprobs(merged), want):
        torch.testing.assert_close(a[1:], b[1:], rtol=0, atol=1e-5)
    # merge_adapter (the server's, no PEFT) agrees with PEFT's merge.
    cfg, tensors = lora.read_adapter(str(tmp_path / "ckpt"))
    plain_state = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).state_dict()
    by_server = lora.merge_adapter(plain_state, cfg, tensors)
    by_peft = lora.merged_state(eng.model)
    assert len(by_server) == 2 * 4
    for n, t in by_server.items():
        assert torch.equal(t, by_peft[n]), n


def test_recover_state_round_trips(model_dir, tmp_path):
    eng = TorchEngine(model_dir, lora_role(), total_steps=10)
    eng.train_batch(make_data([7, 5], seed=1), nll_loss, n_loss_tokens)
    eng.save_state(str(tmp_path))
    saved = torch.load(tmp_path / "engine.pt", weights_only=True)["model"]
    assert saved and all("lora_" in n for n in saved)  # the frozen base is not saved again
    data = make_data([6, 9], seed=2)
    stats_a = eng.train_batch(data, nll_loss, n_loss_tokens)

    again = TorchEngine(model_dir, lora_role(), total_steps=10)
    again.load_state(str(tmp_path))
    assert again.version == 1
    stats_b = again.train_batch(data, nll_loss, n_loss_tokens)
    assert stats_a == stats_b
    for (n, p), (_, q) in zip(eng.model.named_parameters(), again.model.named_parameters()):
        assert torch.equal(p, q), n


def test_lora_config_is_checked():
    with pytest.raises(ValueError, match="lora: only a trainable role"):
        RoleConfig(lora=LoraConfig())
    with pytest.raises(ValueError, match="backend=megatron"):
        RoleConfig(trainable=True, backend="megatron", lora=LoraConfig())
    with pytest.raises(ValueError, match="lora:"):
        lora.apply_lora(torch.nn.Sequential(torch.nn.Linear(2, 2)), LoraConfig(target_modules=["q_proj"]), seed=0)


def test_builtin_server_applies_an_adapter_like_the_merged_export(model_dir, tmp_path):
    """Server 1 serves the base model and loads the adapter (SGLang's /load_lora_adapter); server 2
    serves the merged export. Same greedy tokens (and log-probs); different from the base model's;
    after /unload_lora_adapter server 1 is the base model again."""
    eng = TorchEngine(model_dir, lora_role(export_merged=True), total_steps=10)
    spread_adapter(eng, 1)
    eng.save_hf(str(tmp_path / "ckpt"))
    servers = Servers(model_dir, tmp_path)
    try:
        base_url = servers.start()
        servers.model = str(tmp_path / "ckpt" / "merged")
        merged_url = servers.start()
        base = greedy(base_url)
        call(base_url, lambda c: c.load_lora_adapter("actor", str(tmp_path / "ckpt"), version=7))
        adapted, want = greedy(base_url), greedy(merged_url)
        assert adapted.output_ids == want.output_ids != base.output_ids
        torch.testing.assert_close(adapted.output_logprobs, want.output_logprobs, rtol=0, atol=1e-4)
        assert adapted.weight_version == "7"

        async def named(c):  # SGLang's per-request adapter name: the loaded one is accepted
            return await c.generate(PROMPT, GREEDY, rid="named", return_logprob=True)

        async def with_name(client: GenClient):
            client.lora_name = "actor"
            return await named(client)

        assert call(base_url, with_name).output_ids == want.output_ids

        async def wrong_name(client: GenClient):
            client.lora_name = "other"
            return await named(client)

        with pytest.raises(RuntimeError, match="not the loaded adapter"):
            call(base_url, wrong_name)

        async def during_swap(client: GenClient):
            # The SGLang-style update: pause, unload, (a request naming the adapter arrives), load, continue.
            # The request waits for the new adapter rather than being refused in between.
            await client.pause("abort")
            await client._request("POST", "/unload_lora_adapter", {"lora_name": "actor"}, 30)
            waiting = asyncio.ensure_future(with_name(client))
            await asyncio.sleep(0.3)
            assert not waiting.done()
            await client._request("POST", "/load_lora_adapter", body, 30)
            await client.resume()
            return await waiting

        body = {"lora_name": "actor", "lora_path": str(tmp_path / "ckpt")}
        assert call(base_url, during_swap).output_ids == want.output_ids
        # A folder of full weights goes to /update_weights_from_disk, an adapter folder to /load_lora_adapter.
        call(base_url, lambda c: c.update_weights_from_disk(str(tmp_path / "ckpt"), 8))
        assert greedy(base_url).output_ids == want.output_ids
        # Loading again without unloading replaces the adapter (merged onto the base, not onto itself).
        call(base_url, lambda c: c._request("POST", "/load_lora_adapter", body, 30))
        again = greedy(base_url)
        assert again.output_ids == want.output_ids
        torch.testing.assert_close(again.output_logprobs, want.output_logprobs, rtol=0, atol=1e-4)
        call(base_url, lambda c: c.unload_lora_adapter("actor"))
        assert greedy(base_url).output_ids == base.output_ids
        with pytest.raises(RuntimeError, match="is not loaded"):
            call(base_url, lambda c: c.unload_lora_adapter("actor"))
    finally:
        servers.stop_all()


def test_async_run_with_lora(tmp_path):
    """A tiny async PPO run that trains LoRA adapters: servers load each version's adapter folder
    (disk update -> /load_lora_adapter) and end at the trainer's version; checkpoints are adapters."""
    from test_e2e_async import run_async

    out, metrics = run_async(tmp_path, "actor.lora={rank:4,alpha:8,export_merged:true}",
                             "rollout.max_head_offpolicyness=1", steps=3)
    assert metrics[-1]["version"] == 3
    assert sorted(f for f in os.listdir(out / "weights" / "v3") if f.endswith(".safetensors")) == [
        "adapter_model.safetensors"] and not (out / "weights" / "v3" / "merged").exists()
    # Every update reached the servers as an adapter (not as full weights), and each server that got
    # one ends at the trainer's version, as its own log says. A server still starting at the last
    # update is caught up by the manager, from the adapter folder too, unless the run (3 steps of a
    # tiny model) has ended first: the processes now exit within ~2 s of the last step.
    held = {}
    for i in (0, 1):
        server_log = open(out / "logs" / f"gen_server-{i}.log").read()
        held[i] = re.findall(r"now at weight version (\d+)", server_log)
        if held[i]:
            assert "LoRA adapter 'actor' merged into" in server_log, server_log[-2000:]
            assert held[i][-1] == "3", server_log[-2000:]
    assert {"1", "2", "3"} <= set(held[0]) | set(held[1])
    ckpt = out / "checkpoints" / "step_3"
    assert (ckpt / "adapter_model.safetensors").exists() and not (ckpt / "model.safetensors").exists()
    assert (ckpt / "merged" / "model.safetensors").exists()


def test_sglang_command_serves_the_adapter_from_the_start(model_dir, tmp_path, monkeypatch):
    """SGLang's launch line of a LoRA run (--enable-lora, --max-lora-rank, --lora-target-modules,
    --lora-paths actor=<all-zero adapter>), run by the built-in server standing in for SGLang
    (the test switch REALCORE_TEST_ENGINE_BUILTIN=1): requests name the adapter from version 0 on,
    and the base model's tokens are unchanged by the zero adapter; an adapter above the rank bound
    is refused, an updated adapter is loaded under the same name."""
    from realcore.backends.clients.registry import client_for, server_command

    cfg = LoraConfig(rank=4, alpha=8.0, target_modules=["q_proj", "v_proj"])
    argv, env = server_command("sglang", model_path=model_dir, host="127.0.0.1", port=1, tp=1, seed=3,
                               max_batch_size=8, cuda=True, lora=cfg, private_dir=str(tmp_path))
    assert argv[argv.index("--lora-paths") + 1] == f"actor={tmp_path}/lora-init"
    assert argv[argv.index("--max-lora-rank") + 1] == "4" and "--enable-lora" in argv
    monkeypatch.setenv("REALCORE_TEST_ENGINE_BUILTIN", "1")
    servers = Servers(model_dir, tmp_path)
    try:
        base = greedy(servers.start())
        port = _free_port()
        argv, env = server_command("sglang", model_path=model_dir, host="127.0.0.1", port=port, tp=1, seed=3,
                                   max_batch_size=8, lora=cfg, api_key="test-token", private_dir=str(tmp_path))
        assert "realcore.serve" in argv
        proc = subprocess.Popen(argv, env={**os.environ, **env, "OMP_NUM_THREADS": "1"},
                                stdout=subprocess.DEVNULL, stderr=open(tmp_path / "sglang.log", "w"))
        servers.procs[f"http://127.0.0.1:{port}"] = proc
        url = f"http://127.0.0.1:{port}"

        async def as_run(fn):  # the client a LoRA run's rollout worker makes for SGLang
            client = client_for("sglang", url, token="test-token", timeout_s=30, lora=True)
            try:
                await client.wait_ready(60)
                return await fn(client)
            finally:
                await client.close()

        first = asyncio.run(as_run(lambda c: c.generate(PROMPT, GREEDY, rid="v0", return_logprob=True)))
        assert first.output_ids == base.output_ids
        info = asyncio.run(as_run(lambda c: c.server_info()))
        assert info["lora_adapter"] == "actor"

        eng = TorchEngine(model_dir, lora_role(target_modules=["q_proj", "v_proj"], export_merged=True), total_steps=1)
        spread_adapter(eng, 2)
        eng.save_hf(str(tmp_path / "v1"))
        asyncio.run(as_run(lambda c: c.update_weights_from_disk(str(tmp_path / "v1"), 1)))
        after = asyncio.run(as_run(lambda c: c.generate(PROMPT, GREEDY, rid="v1", return_logprob=True)))
        assert after.weight_version == "1" and after.output_ids != base.output_ids

        big = TorchEngine(model_dir, RoleConfig(trainable=True, lora=LoraConfig(rank=8, target_modules=["q_proj"])),
                          total_steps=1)
        big.save_hf(str(tmp_path / "big"))
        with pytest.raises(RuntimeError, match="above --max-lora-rank 4"):
            asyncio.run(as_run(lambda c: c.load_lora_adapter("actor", str(tmp_path / "big"))))
    finally:
        servers.stop_all()



def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("how", ["sglang", "memory"])
def test_async_run_with_lora_other_paths(tmp_path, monkeypatch, how):
    """sglang: SGLang's launch line and API (the built-in server standing in, REALCORE_TEST_ENGINE_BUILTIN=1):
    servers start with the zero adapter, every request names it, each update loads the new one.
    memory, on an FSDP actor (DP=2, backend=fsdp): both ranks gather the sharded adapter for each
    update, rank 0 pushes it alone over the wire; the final checkpoint is an adapter folder."""
    from test_e2e_async import run_async

    if how == "sglang":
        monkeypatch.setenv("REALCORE_TEST_ENGINE_BUILTIN", "1")
        extra = ["allocation_mode=sglang.d2p1t1+d2p1t1"]
    else:
        extra = ["rollout.weight_update=memory", "actor.backend=fsdp"]
    out, metrics = run_async(tmp_path, "actor.lora={rank:4,alpha:8}", "rollout.max_head_offpolicyness=1", *extra,
                             steps=3)
    assert metrics[-1]["version"] == 3
    # Every server that got an update ends at the trainer's version, as its own log says. A server
    # still starting when the manager began may get none: the manager adds it at its next health
    # check, and this tiny run's 3 steps can be over in a second.
    held = {}
    for i in (0, 1):  # every update reached the servers as an adapter (not as full weights)
        server_log = open(out / "logs" / f"gen_server-{i}.log").read()
        assert "LoRA adapter 'actor' merged into" in server_log, server_log[-2000:]
        held[i] = re.findall(r"now at weight version (\d+)", server_log)
        if held[i]:
            assert held[i][-1] == "3", server_log[-2000:]
    assert {"1", "2", "3"} <= set(held[0]) | set(held[1])
    if how == "memory":
        ckpt = out / "checkpoints" / "step_3"
        assert (ckpt / "adapter_model.safetensors").exists() and not (ckpt / "model.safetensors").exists()


def test_in_memory_push_of_the_adapter_alone(model_dir, tmp_path):
    """rollout.weight_update=memory with LoRA: the trainer pushes the adapter's tensors alone with
    its config over the authenticated wire; the server applies them as /load_lora_adapter would."""
    from realcore.backends.clients.sglang_api import push_weights
    from test_gen_server import MAX_BODY, SECRET, SERVER, TOKEN

    eng = TorchEngine(model_dir, lora_role(), total_steps=1)
    spread_adapter(eng, 3)
    eng.save_hf(str(tmp_path / "ckpt"))
    log = open(tmp_path / "server.log", "w+")
    proc = subprocess.Popen([sys.executable, "-c", SERVER, model_dir, TOKEN, str(MAX_BODY)], stdout=subprocess.PIPE,
                            stderr=log, env={**os.environ, "OMP_NUM_THREADS": "1", "SECRET_HEX": SECRET.hex()}, text=True)
    try:
        addrs = json.loads(proc.stdout.readline())
        url = addrs["http"]
        base = greedy(url)
        state = lora.adapter_state(eng.model)
        assert all(".lora_A." in n or ".lora_B." in n for n in state)
        header = {"name": "actor", "config": lora.adapter_config(eng.role.lora)}
        push_weights(addrs["weights"], SECRET, "5", state, 30, lora=header)
        pushed = greedy(url)
        assert pushed.weight_version == "5" and pushed.output_ids != base.output_ids
        assert call(url, lambda c: c.server_info())["lora_adapter"] == "actor"
        call(url, lambda c: c.unload_lora_adapter("actor"))
        assert greedy(url).output_ids == base.output_ids
        call(url, lambda c: c.load_lora_adapter("actor", str(tmp_path / "ckpt")))
        from_disk = greedy(url)
        assert from_disk.output_ids == pushed.output_ids
        torch.testing.assert_close(from_disk.output_logprobs, pushed.output_logprobs, rtol=0, atol=0)
        with pytest.raises(RuntimeError, match="lora_alpha"):
            push_weights(addrs["weights"], SECRET, "6", state, 30, lora={"name": "actor", "config": {"r": 4}})
        assert greedy(url).output_ids == pushed.output_ids  # a refused push changes nothing
    finally:
        proc.terminate()
        assert proc.wait(timeout=30) == 0


def test_sync_recovery_with_lora_is_exact(tmp_path, lora_env):
    """A sync LoRA run on two data-parallel ranks (the adapters' gradients all-reduced like full
    weights) whose model worker 1 is killed at step 3 restarts from its recover checkpoint
    (adapters, adapter-only optimizer state) and ends with the adapter, metrics and ledger of a
    run never interrupted."""
    from safetensors.torch import load_file

    from test_recovery import cmd, kill_when, metrics

    env, cache = lora_env
    lora_cfg = "actor.lora={rank:4,alpha:8}"
    ref = str(tmp_path / "straight")
    r = subprocess.run(cmd(ref, lora_cfg, cache=cache), cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    out = str(tmp_path / "run")
    proc = subprocess.Popen(cmd(out, lora_cfg, "recover_mode=auto", "trainer.recover_freq_steps=2", "recover_delay_s=0",
                                cache=cache), cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        kill_when(proc, out, "model_worker/1", 3)
        stdout, stderr = proc.communicate(timeout=300)
    finally:
        proc.kill()
    assert proc.returncode == 0, stderr[-3000:]
    assert re.search(r"resuming from step [246] ", stdout), stdout[-2000:]
    a, b = (load_file(os.path.join(d, "checkpoints", "step_6", "adapter_model.safetensors")) for d in (out, ref))
    assert a.keys() == b.keys() and max(float((a[k] - b[k]).abs().max()) for k in a) <= 1e-6
    keys = ("step", "loss", "reward/mean")
    assert [[m[k] for k in keys] for m in metrics(out)] == [[m[k] for k in keys] for m in metrics(ref)]
    assert open(os.path.join(out, "ledger.jsonl")).read() == open(os.path.join(ref, "ledger.jsonl")).read()


@pytest.fixture
def lora_env(tmp_path):
    from test_recovery import PLUGIN

    (tmp_path / "rc_test_plugin.py").write_text(PLUGIN)
    return {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{REPO}", "OMP_NUM_THREADS": "1"}, str(tmp_path / "cache")
