"""LoRA on the FSDP engine (backend=fsdp + actor.lora) against LoRA on the replicated TorchEngine,
DP=2 over gloo in real processes: the same adapter gradients and a 5-step loss trajectory, base
weights bit-identical, the same adapter folder and merged export from save_hf, the adapter alone
gathered for weight updates, and an exact resume from save_state (adapter shards only). The
async end-to-end run with backend=fsdp + LoRA is tests/test_lora.py's memory-update run."""

from __future__ import annotations

import os
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from safetensors.torch import load_file

from realcore.api.config import LoraConfig
from tests.test_fsdp import REL, STEPS, _close, _full, _role, _validate, save_tiny_qwen2
from tests.test_torch_engine import _free_port, make_data, n_loss_tokens, nll_loss

torch.set_num_threads(1)

LORA = LoraConfig(rank=4, alpha=8.0, target_modules=["q_proj", "v_proj", "down_proj"], export_merged=True)
N_LAYERS = 3  # of test_fsdp's model (save_tiny_qwen2)


def _lora_role(**kw):
    return _role(lora=LORA, **kw)


def _named(eng) -> dict[str, torch.Tensor]:
    """Full parameters by the wrapped model's names (collective for FSDP; AC's prefix removed)."""
    return {n.replace("_checkpoint_wrapped_module.", ""): _full(p.detach()) for n, p in eng.model.named_parameters()}


def _train(eng, data):
    """One train_batch; returns (stats, the full adapter gradients the optimizer step saw)."""
    grads = []
    hook = eng.optimizer.register_step_pre_hook(lambda *_: grads.append(
        {n.replace("_checkpoint_wrapped_module.", ""): _full(p.grad)
         for n, p in eng.model.named_parameters() if p.requires_grad}))
    stats = eng.train_batch(data, nll_loss, n_loss_tokens, temperature=0.7)
    hook.remove()
    return stats, grads[0]


def _worker(rank: int, port: int, model_dir: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=120))  # mismatched collectives fail, not hang
    from torch.distributed.fsdp import FSDPModule

    from realcore.backends.fsdp_engine import FSDPEngine
    from realcore.backends.torch_engine import TorchEngine

    res: dict = {}
    try:
        # 5 steps: replicated LoRA (gradients all-reduced), FSDP LoRA with activation checkpointing,
        # plain FSDP LoRA, which saves its state after step 2; a fresh one resumes from it.
        engines = {"torch": TorchEngine(model_dir, _lora_role(), total_steps=5),
                   "fsdp_ac": FSDPEngine(model_dir, _lora_role(gradient_checkpointing=True), total_steps=5),
                   "fsdp": FSDPEngine(model_dir, _lora_role(), total_steps=5)}
        # fully_shard found the blocks through the PEFT wrapper: one unit per block, and the root.
        res["fsdp_units"] = sum(isinstance(m, FSDPModule) for m in engines["fsdp"].model.modules())
        res["trainable"] = {k: sorted(n.replace("_checkpoint_wrapped_module.", "")
                                      for n, p in e.model.named_parameters() if p.requires_grad)
                            for k, e in engines.items()}
        res["initial"] = _named(engines["fsdp_ac"])
        state_dir = os.path.join(out, f"state-{rank}")
        os.makedirs(state_dir)
        for step, lens in enumerate(STEPS):
            data = make_data(lens[rank], seed=100 * step + rank)
            for kind, eng in engines.items():
                stats, grads = _train(eng, data)
                res.setdefault(f"traj/{kind}", []).append(stats)
                res.setdefault(f"grads/{kind}", []).append(grads)
            if step == 1:
                engines["fsdp"].save_state(state_dir)
                res["params/fsdp@2"] = _named(engines["fsdp"])
        for kind, eng in engines.items():
            res[f"params/{kind}"] = _named(eng)
        resumed = FSDPEngine(model_dir, _lora_role(), total_steps=5)
        resumed.load_state(state_dir)
        res["resumed/version"] = resumed.version
        res["resumed"] = [_train(resumed, make_data(lens[rank], seed=100 * step + rank))[0]
                          for step, lens in enumerate(STEPS) if step >= 2]
        res["resumed/params"] = _named(resumed)
        other = FSDPEngine(model_dir, _role(lora=LORA.model_copy(update={"target_modules": ["q_proj"]})), total_steps=5)
        try:  # adapters on other modules: refused, with the names
            other.load_state(state_dir)
        except ValueError as e:
            res["refused"] = str(e)

        # Weights out of the same trajectory: the torch engine's (rank 0 writes) and the fsdp_ac
        # engine's (collective), with the merged export and without (a disk weight update's).
        engines["torch"].save_hf(os.path.join(out, "torch"))
        engines["fsdp_ac"].save_hf(os.path.join(out, "fsdp"))
        engines["fsdp_ac"].save_hf(os.path.join(out, "fsdp-adapter"), merged=False)
        res["adapter_state"] = engines["fsdp_ac"].adapter_state()  # in-memory update: rank 0 only
        res["hf_state_dict"] = engines["fsdp_ac"].hf_state_dict()  # nccl update: base + adapter merged
        torch.save(res, os.path.join(out, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return save_tiny_qwen2(str(tmp_path_factory.mktemp("tiny-qwen2-fsdp-lora")))


@pytest.fixture(scope="module")
def results(model_dir, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("fsdp-lora-out"))
    mp.spawn(_worker, args=(_free_port(), model_dir, out), nprocs=2, join=True)
    return out, [torch.load(os.path.join(out, f"rank{r}.pt"), weights_only=True) for r in (0, 1)]


def _is_adapter(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


def test_blocks_are_sharded_through_the_peft_wrapper_and_only_adapters_train(results):
    for res in results[1]:
        assert res["fsdp_units"] == N_LAYERS + 1
        names = res["trainable"]["torch"]
        assert len(names) == 2 * 3 * N_LAYERS and all(_is_adapter(n) for n in names)  # A, B x 3 modules x 3 layers
        assert res["trainable"]["fsdp"] == res["trainable"]["fsdp_ac"] == names


def test_adapter_gradients_and_trajectory_equal_the_replicated_engine(results):
    for res in results[1]:
        torch_losses = [s["loss"] for s in res["traj/torch"]]
        assert torch_losses[-1] != torch_losses[0]  # the adapters did move the model
        for kind in ("fsdp", "fsdp_ac"):
            losses = [s["loss"] for s in res[f"traj/{kind}"]]
            assert len(losses) == 5
            assert max(abs(a - b) / abs(b) for a, b in zip(losses, torch_losses)) < REL, (kind, losses, torch_losses)
            norms = [s["grad_norm"] for s in res[f"traj/{kind}"]]
            assert norms == pytest.approx([s["grad_norm"] for s in res["traj/torch"]], rel=REL)
            for a, b in zip(res[f"grads/{kind}"], res["grads/torch"]):
                _close(a, b, rtol=REL)
            _close(res[f"params/{kind}"], res["params/torch"], rtol=REL)
        # B starts at zero, so A's first gradient is zero; later ones are not (the check is not vacuous).
        assert any(float(g.abs().max()) > 0 for n, g in res["grads/torch"][-1].items() if ".lora_A." in n)


def test_base_weights_stay_bit_identical(results, model_dir):
    from transformers import AutoModelForCausalLM

    hf = {f"base_model.model.{n}": p.detach() for n, p in
          AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).named_parameters()}
    for r in results[1]:
        for kind in ("torch", "fsdp", "fsdp_ac"):
            params = r[f"params/{kind}"]
            base = {n.replace(".base_layer.", "."): p for n, p in params.items() if not _is_adapter(n)}
            assert base.keys() == hf.keys(), kind
            assert all(torch.equal(p, hf[n]) for n, p in base.items()), kind
            assert all(not torch.equal(p, r["initial"][n]) for n, p in params.items() if ".lora_B." in n), kind


def test_save_hf_equals_the_torch_engines_on_the_same_trajectory(results):
    from realcore.backends import lora

    out, res = results
    files = {k: sorted(os.listdir(os.path.join(out, k))) for k in ("torch", "fsdp", "fsdp-adapter")}
    assert files["fsdp"] == files["torch"] and "merged" in files["fsdp"] and "model.safetensors" not in files["fsdp"]
    assert files["fsdp-adapter"] == [f for f in files["fsdp"] if f != "merged"]  # merged=False: no export
    adapters = {k: load_file(os.path.join(out, k, "adapter_model.safetensors")) for k in files}
    assert adapters["fsdp"].keys() == adapters["torch"].keys() and all(_is_adapter(n) for n in adapters["fsdp"])
    _close(adapters["fsdp"], adapters["torch"], rtol=REL)
    merged = {k: load_file(os.path.join(out, k, "merged", "model.safetensors")) for k in ("torch", "fsdp")}
    _close(merged["fsdp"], merged["torch"], rtol=REL)
    # Exact within the fsdp engine: the files hold its gathered adapters, merged onto the untouched base.
    gathered = res[0]["params/fsdp_ac"]
    for n, t in adapters["fsdp"].items():
        live = n.replace(".lora_A.", ".lora_A.default.").replace(".lora_B.", ".lora_B.default.")
        assert torch.equal(t, gathered[live]), n
        assert torch.equal(adapters["fsdp-adapter"][n], t) and torch.equal(res[0]["adapter_state"][n], t), n
    cfg, tensors = lora.read_adapter(os.path.join(out, "fsdp"))
    base = {n.removeprefix("base_model.model.").replace(".base_layer.", "."): p
            for n, p in res[0]["initial"].items() if not _is_adapter(n)}
    want = {**base, **lora.merge_adapter(base, cfg, tensors)}
    assert merged["fsdp"].keys() == want.keys() == res[0]["hf_state_dict"].keys()
    for n, t in want.items():
        assert torch.equal(merged["fsdp"][n], t) and torch.equal(res[0]["hf_state_dict"][n], t), n
    assert res[1]["adapter_state"] is None and res[1]["hf_state_dict"] is None  # gathered to rank 0 only
    assert not [f for f in os.listdir(out) if ".tmp-" in f or ".old-" in f]


def test_resume_from_save_state_is_exact_and_holds_adapter_shards_only(results):
    out, res = results
    for rank, r in enumerate(res):
        assert r["resumed/version"] == 2
        assert [s["loss"] for s in r["resumed"]] == [s["loss"] for s in r["traj/fsdp"][2:]]
        assert [s["lr"] for s in r["resumed"]] == [s["lr"] for s in r["traj/fsdp"][2:]]
        for n, p in r["params/fsdp"].items():
            assert torch.equal(r["resumed/params"][n], p), n
        saved = torch.load(os.path.join(out, f"state-{rank}", "engine.pt"), weights_only=True)
        adapters = sorted(n for n in r["params/fsdp"] if _is_adapter(n))
        assert sorted(saved["model"]) == sorted(saved["optimizer"]["state"]) == adapters  # no base weight
        for n in adapters:  # this rank's dim-0 shard of each
            assert torch.equal(saved["model"][n], r["params/fsdp@2"][n].chunk(2)[rank]), n
        assert "does not fit this model's adapters (unexpected ['base_model.model.model.layers.0.mlp.down_proj" in r["refused"]


def test_validator_accepts_fsdp_with_lora():
    _validate("actor.backend=fsdp", "allocation_mode=local.d1+d2", "actor.lora={rank:4,alpha:8}")


def test_merge_of_a_gathered_state_dict_equals_peft_on_the_live_model():
    """One process: what FSDPEngine computes from a gathered state dict (names without
    activation checkpointing's wrapper prefix; tied embeddings under both names) equals PEFT's
    adapter_state and merged_state of the same model, bit for bit."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from realcore.backends import lora
    from realcore.backends.fsdp import apply_ac

    torch.manual_seed(0)
    cfg = Qwen2Config(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=40, tie_word_embeddings=True)
    model = lora.apply_lora(Qwen2ForCausalLM(cfg), LORA, seed=0)
    with torch.no_grad():  # B is zero at start: make the merge change the weights
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0.0, 0.3)
    want_adapter, want_merged = lora.adapter_state(model), lora.merged_state(model)
    apply_ac(model)
    state = get_model_state_dict(model)
    adapter, merged = lora.gathered_adapter(state), lora.merge_state(state, LORA)
    assert adapter.keys() == want_adapter.keys() and len(adapter) == 2 * 3 * 2
    assert all(torch.equal(adapter[n], t) for n, t in want_adapter.items())
    assert merged.keys() == want_merged.keys() and "lm_head.weight" in merged
    assert all(torch.equal(merged[n], t) for n, t in want_merged.items())
    q = "model.layers.0.self_attn.q_proj"
    assert not torch.equal(merged[f"{q}.weight"], state[f"base_model.model.{q}.base_layer.weight"])
