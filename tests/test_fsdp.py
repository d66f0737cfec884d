"""FSDPEngine (backend=fsdp) against the replicated TorchEngine, DP=2 over gloo in real processes:
the same gradients and updates, a 5-step loss trajectory, 1/DP of the parameter + optimizer bytes
per rank, an exact resume from save_state, a save_hf that transformers loads, bf16 on a CPU with
bf16 instructions; and the launcher's checks and one end-to-end sync run with actor.backend=fsdp."""

from __future__ import annotations

import json
import os
import subprocess
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from realcore.api.config import RoleConfig
from realcore.backends.batching import split_by_budget
from realcore.backends.precision import cpu_has_bf16
from tests.test_torch_engine import _free_port, make_data, n_loss_tokens, nll_loss, trainable_role

torch.set_num_threads(1)

BUDGET = 12
# Per-rank sequence lengths of each of the 5 trajectory steps: the ranks' micro-batch counts differ
# (rank 0 runs more passes), so the other rank's idle passes are exercised in every step.
STEPS = [([7, 12, 3], [20, 9]), ([5, 6], [11, 4, 8, 2]), ([9], [3, 3, 3, 3, 5, 5]), ([14, 2, 6], [7]), ([4, 4], [10, 10])]
# DP cases as in test_torch_engine: (lens on rank 0, lens on rank 1, n_minibatches); rank 1's second
# minibatch is empty in the second, so it runs idle passes only.
DP_CASES = {"uneven": ([30, 25], [4, 3, 6], 1), "empty_minibatch": ([8, 9, 10, 7], [5], 2)}
REL = 1e-4  # the bound on the relative error of the loss trajectory


def _role(**kw) -> RoleConfig:
    # float32 unless a test says otherwise: "auto" would be bf16 on GPUs, and the replicated engine
    # (autocast) and FSDP (bf16 gathers) differ in bf16 by more than these exact comparisons allow.
    return trainable_role(BUDGET).model_copy(update={"dtype": "float32", **kw})


def _full(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's full value (collective), or the tensor itself; on the CPU."""
    return (t.full_tensor() if hasattr(t, "full_tensor") else t.detach()).cpu().clone()


def _named(eng) -> dict[str, torch.Tensor]:
    """Full parameters by HF name (collective for FSDP; AC's wrapper prefix removed)."""
    return {n.replace("_checkpoint_wrapped_module.", ""): _full(p.detach()) for n, p in eng.model.named_parameters()}


def _bytes(eng) -> int:
    """This rank's bytes of parameters plus optimizer state (shards only, for FSDP)."""
    def local(t):
        return t.to_local() if hasattr(t, "to_local") else t
    n = sum(local(p).numel() * p.element_size() for p in eng.model.parameters())
    for state in eng.optimizer.state.values():
        n += sum(local(t).numel() * t.element_size() for t in state.values() if torch.is_tensor(t) and t.dim() > 0)
    return n


def _train(eng, data, **kw):
    """One train_batch; returns (stats, the full gradients each optimizer step saw)."""
    grads = []
    hook = eng.optimizer.register_step_pre_hook(
        lambda *_: grads.append({n.replace("_checkpoint_wrapped_module.", ""): _full(p.grad)
                                 for n, p in eng.model.named_parameters()}))
    stats = eng.train_batch(data, nll_loss, n_loss_tokens, temperature=0.7, **kw)
    hook.remove()
    return stats, grads


def _worker(rank: int, port: int, model_dir: str, out: str, bf16: bool, backend: str = "gloo") -> None:
    torch.set_num_threads(1)
    device = {}
    if backend == "nccl":
        device = {"device_id": torch.device("cuda", rank)}
        torch.cuda.set_device(rank)  # each rank its own GPU, before its group: the engines use the current one
        # The resume check compares losses exactly: deterministic kernels (cuBLAS workspace, sort-based
        # embedding backward, SDPA's math kernel), as the CPU's are.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.backends.cuda.enable_flash_sdp(False)
        torch.backends.cuda.enable_mem_efficient_sdp(False)
        torch.backends.cuda.enable_cudnn_sdp(False)
    # A deadline: ranks whose collectives do not match fail instead of hanging the test.
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=120), **device)
    from realcore.backends.fsdp_engine import FSDPEngine
    from realcore.backends.torch_engine import TorchEngine

    res: dict = {}
    try:
        # Gradients and updates of one step, per DP case.
        for name, (lens0, lens1, n_mb) in DP_CASES.items():
            data = make_data(lens0 if rank == 0 else lens1, seed=10 + rank)
            for kind, cls in (("torch", TorchEngine), ("fsdp", FSDPEngine)):
                eng = cls(model_dir, _role(), total_steps=10)
                stats, grads = _train(eng, data, n_minibatches=n_mb)
                res[f"{name}/{kind}"] = (stats, grads, _named(eng))

        # 5 steps: replicated, FSDP, FSDP with activation checkpointing; the FSDP engine saves its
        # state after step 2 and a fresh one resumes from it.
        engines = {"torch": TorchEngine(model_dir, _role(), total_steps=5),
                   "fsdp": FSDPEngine(model_dir, _role(), total_steps=5),
                   "fsdp_ac": FSDPEngine(model_dir, _role(gradient_checkpointing=True), total_steps=5)}
        state_dir = os.path.join(out, f"state-{rank}")
        os.makedirs(state_dir)
        for step, lens in enumerate(STEPS):
            data = make_data(lens[rank], seed=100 * step + rank)
            for kind, eng in engines.items():
                res.setdefault(f"traj/{kind}", []).append(_train(eng, data)[0])
            if step == 1:
                engines["fsdp"].save_state(state_dir)
        for kind, eng in engines.items():
            res[f"traj/{kind}/params"] = _named(eng)
            res[f"bytes/{kind}"] = _bytes(eng)
        resumed = FSDPEngine(model_dir, _role(), total_steps=5)
        resumed.load_state(state_dir)
        res["resumed/version"] = resumed.version
        res["resumed"] = [_train(resumed, make_data(lens[rank], seed=100 * step + rank))[0]
                          for step, lens in enumerate(STEPS) if step >= 2]
        res["resumed/params"] = _named(resumed)

        # save_hf of the checkpointed engine (its parameter names carry the wrapper's prefix).
        engines["fsdp_ac"].save_hf(os.path.join(out, "hf"))

        # Log-probs with a micro-batch count that differs by rank (rank 1 has no sequence at all).
        seqs = make_data([7, 12, 3, 20, 9], seed=7)["input_ids"] if rank == 0 else []
        res["logprobs"] = {kind: eng.logprobs(seqs, temperature=0.7) for kind, eng in engines.items()}

        if bf16:  # one step of the same batch in fp32 and bf16 on each engine
            data = make_data(STEPS[0][rank], seed=3)
            for kind, cls in (("torch", TorchEngine), ("fsdp", FSDPEngine)):
                for dtype in ("float32", "bfloat16"):
                    eng = cls(model_dir, _role(dtype=dtype), total_steps=5)
                    stats = _train(eng, data)[0]
                    res[f"bf16/{kind}/{dtype}"] = {
                        "loss": stats["loss"], "grad_norm": stats["grad_norm"],
                        "param_dtypes": sorted({str(p.dtype) for p in eng.model.parameters()}),
                        "state_dtypes": sorted({str(t.dtype) for s in eng.optimizer.state.values()
                                                for t in s.values() if t.dim() > 0}),
                        "logprob_dtype": str(eng.logprobs(data["input_ids"])[0].dtype)}
        torch.save(res, os.path.join(out, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def save_tiny_qwen2(path: str) -> str:
    """The FSDP tests' model in `path`: 3 layers and odd sizes, so shards are of uneven length (FSDP
    pads dim 0) and a block is kept after forward."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from tests.test_torch_engine import VOCAB

    torch.manual_seed(0)
    cfg = Qwen2Config(hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=VOCAB + 1, initializer_range=0.1)
    Qwen2ForCausalLM(cfg).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return save_tiny_qwen2(str(tmp_path_factory.mktemp("tiny-qwen2-fsdp")))


@pytest.fixture(scope="module")
def results(model_dir, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("fsdp-out"))
    mp.spawn(_worker, args=(_free_port(), model_dir, out, cpu_has_bf16()), nprocs=2, join=True)
    return out, [torch.load(os.path.join(out, f"rank{r}.pt"), weights_only=True) for r in (0, 1)]


def _close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], rtol=1e-5) -> None:
    assert a.keys() == b.keys()
    for n in a:
        # Summation order differs, so tiny entries carry float32 noise of the tensor's scale.
        torch.testing.assert_close(a[n], b[n], rtol=rtol, atol=rtol * float(b[n].abs().max()), msg=n)


def test_the_micro_batch_counts_differ_by_rank():
    """Guards the scenarios: otherwise no rank would run an idle pass."""
    for lens0, lens1 in STEPS:
        assert len(split_by_budget(lens0, BUDGET)) != len(split_by_budget(lens1, BUDGET))


@pytest.mark.parametrize("case", sorted(DP_CASES))
def test_gradients_and_update_equal_the_replicated_engine(results, case):
    for res in results[1]:
        (s_t, g_t, p_t), (s_f, g_f, p_f) = res[f"{case}/torch"], res[f"{case}/fsdp"]
        for k in ("loss", "entropy", "grad_norm", "lr"):
            assert s_f[k] == pytest.approx(s_t[k], rel=1e-5), k
        assert len(g_f) == len(g_t) == DP_CASES[case][2]
        for a, b in zip(g_f, g_t):
            _close(a, b)
        _close(p_f, p_t)


def test_five_step_loss_trajectory_equals_the_replicated_engine(results):
    for res in results[1]:
        torch_losses = [s["loss"] for s in res["traj/torch"]]
        for kind in ("fsdp", "fsdp_ac"):
            losses = [s["loss"] for s in res[f"traj/{kind}"]]
            assert len(losses) == 5
            assert max(abs(a - b) / abs(b) for a, b in zip(losses, torch_losses)) < REL, (kind, losses, torch_losses)
            norms = [s["grad_norm"] for s in res[f"traj/{kind}"]]
            assert norms == pytest.approx([s["grad_norm"] for s in res["traj/torch"]], rel=REL)
            _close(res[f"traj/{kind}/params"], res["traj/torch/params"], rtol=REL)
        assert torch_losses[-1] != torch_losses[0]  # the steps did move the model


def test_parameter_and_optimizer_bytes_per_rank_fall_as_one_over_dp(results):
    for res in results[1]:
        ratio = res["bytes/fsdp"] / res["bytes/torch"]
        # FSDP pads a tensor's dim 0 to a multiple of DP; the last rank's shard may be shorter.
        assert 0.45 < ratio <= 0.52, ratio
    assert results[1][0]["bytes/fsdp"] + results[1][1]["bytes/fsdp"] == results[1][0]["bytes/torch"]


def test_resume_from_save_state_equals_the_uninterrupted_run(results):
    for res in results[1]:
        assert res["resumed/version"] == 2
        assert [s["loss"] for s in res["resumed"]] == [s["loss"] for s in res["traj/fsdp"][2:]]
        assert [s["lr"] for s in res["resumed"]] == [s["lr"] for s in res["traj/fsdp"][2:]]
        for n, p in res["traj/fsdp/params"].items():
            assert torch.equal(res["resumed/params"][n], p), n


def test_save_hf_loads_in_transformers_and_equals_the_gathered_weights(results):
    from transformers import AutoModelForCausalLM

    out, res = results
    loaded = AutoModelForCausalLM.from_pretrained(os.path.join(out, "hf"), dtype=torch.float32)
    gathered = res[0]["traj/fsdp_ac/params"]
    assert dict(loaded.named_parameters()).keys() == gathered.keys()
    for n, p in loaded.named_parameters():
        assert torch.equal(p, gathered[n]), n
    assert sorted(os.listdir(out)) == ["hf", "rank0.pt", "rank1.pt", "state-0", "state-1"]  # no tmp dirs


def test_logprobs_with_uneven_micro_batches_match(results):
    lp = results[1][0]["logprobs"]
    assert len(lp["torch"]) == 5 and results[1][1]["logprobs"]["fsdp"] == []
    for kind in ("fsdp", "fsdp_ac"):
        for a, b in zip(lp[kind], lp["torch"]):
            assert a.dtype == torch.float32
            torch.testing.assert_close(a, b, atol=1e-5, rtol=0)


@pytest.mark.skipif(not cpu_has_bf16(), reason="this CPU has no bf16 instructions (avx512_bf16 / amx_bf16)")
def test_bf16_step_runs_near_fp32_with_fp32_master_state(results):
    for res in results[1]:
        for kind in ("torch", "fsdp"):
            fp32, bf16 = res[f"bf16/{kind}/float32"], res[f"bf16/{kind}/bfloat16"]
            assert bf16["loss"] == pytest.approx(fp32["loss"], rel=2e-2), kind
            assert bf16["grad_norm"] == pytest.approx(fp32["grad_norm"], rel=0.1), kind
            assert bf16["loss"] != fp32["loss"]  # bf16 really computed
            assert bf16["param_dtypes"] == bf16["state_dtypes"] == ["torch.float32"], kind
            assert bf16["logprob_dtype"] == "torch.float32"


# ---- precision and the launcher's checks (one process) ----


def test_cpu_bf16_flags(tmp_path):
    from realcore.backends.precision import bf16_unsupported, compute_dtype

    yes, no = tmp_path / "yes", tmp_path / "no"
    yes.write_text("processor\t: 0\nflags\t\t: fpu sse avx512f avx512_bf16\n")
    no.write_text("processor\t: 0\nflags\t\t: fpu sse avx512f avx2\n")
    assert cpu_has_bf16(str(yes)) and not cpu_has_bf16(str(no)) and not cpu_has_bf16(str(tmp_path / "missing"))
    assert bf16_unsupported("cpu", str(yes)) is None
    assert "no bf16 instructions" in bf16_unsupported("cpu", str(no))
    assert compute_dtype("float32", torch.device("cpu")) == torch.float32


def _validate(*overrides):
    from realcore.launch.config_loader import load_config
    from realcore.launch.validate import validate

    if not any(o.startswith("experiment=") for o in overrides):
        overrides = ("experiment=ppo-math", *overrides)
    return validate(load_config(["model=tiny", *overrides]))


@pytest.mark.parametrize("overrides, message", [
    (["actor.backend=fsdp"], "mfcs (actor_gen): actor.backend=fsdp samples on generation servers"),
    (["actor.backend=fsdp", "allocation_mode=local.d1+d1p2t1"], "actor.backend=fsdp supports data parallel only"),
    (["experiment=sft-math", "actor.backend=fsdp", "eval.freq_steps=2"],
     "eval.freq_steps: actor.backend=fsdp evaluates on generation servers"),
])
def test_validator_refuses(overrides, message):
    from realcore.launch.config_loader import ConfigError

    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        _validate(*overrides)


def test_validator_accepts_fsdp_with_servers_and_a_ref_on_another_backend():
    _validate("actor.backend=fsdp", "allocation_mode=local.d1+d2", "ref.backend=torch")
    _validate("actor.backend=fsdp", "allocation_mode=local.d1+d2")  # the ref follows: fsdp, frozen


def test_validator_refuses_bf16_on_a_cpu_without_it(monkeypatch):
    from realcore.backends import precision
    from realcore.launch.config_loader import ConfigError

    monkeypatch.setattr(precision, "cpu_has_bf16", lambda cpuinfo="/proc/cpuinfo": False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match="actor.dtype=bfloat16: this CPU has no bf16 instructions") as e:
        _validate("actor.dtype=bfloat16")
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="no bf16 instructions"):
        precision.compute_dtype("bfloat16", torch.device("cpu"))
    monkeypatch.setattr(precision, "cpu_has_bf16", lambda cpuinfo="/proc/cpuinfo": True)
    _validate("actor.dtype=bfloat16")


# ---- end to end ----


def test_sync_ppo_run_with_fsdp_actor_and_ref(tmp_path):
    """ppo-math (generate on a built-in server, ref log-probs, PPO update) with the actor and the
    frozen ref sharded over DP=2; weights reach the server by disk each step, each step writes a
    recover checkpoint (every rank its shards), and the step-2 checkpoint is a whole HF model."""
    from tests.test_e2e_sync import REPO, assert_all_gone, assert_clean_logs, launch_cmd

    out = str(tmp_path / "run")
    cmd = launch_cmd(out, "trainer.total_steps=2", "actor.backend=fsdp", "allocation_mode=local.d1+d2p1t1",
                     "trainer.recover_freq_steps=1", cache=str(tmp_path / "cache"))
    r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    lines = [json.loads(x) for x in open(os.path.join(out, "metrics.jsonl"))]
    assert [m["step"] for m in lines] == [1, 2] and lines[-1]["version"] == 2
    assert all("loss" in m and "time/ref_inf_s" in m for m in lines)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(os.path.join(out, "checkpoints", "step_2"))
    embed = model.get_input_embeddings().weight
    for i in (0, 1):  # each worker's recover state holds its own half of the actor
        state = torch.load(os.path.join(out, "recover", "step_2", f"model_worker-{i}", "actor", "engine.pt"),
                           weights_only=True)
        assert state["dp"] == [i, 2] and state["version"] == 2
        shard = state["model"]["model.embed_tokens.weight"]
        torch.testing.assert_close(shard, embed.detach().chunk(2)[i], rtol=0, atol=0)
    assert_all_gone(out)
    assert_clean_logs(out, r.stdout, r.stderr)


def test_async_run_with_fsdp_actor_pushes_weights_in_memory(tmp_path):
    """Async mode: every rank takes part in gathering the actor for each in-memory weight update
    (hf_state_dict), rank 0 pushes it to the server."""
    from tests.test_e2e_async import run_async

    out, metrics = run_async(tmp_path, "actor.backend=fsdp", "rollout.weight_update=memory",
                             "allocation_mode=local.d1p1t1+d2p1t1", "rollout.max_head_offpolicyness=0", steps=3)
    assert metrics[-1]["version"] == 3 and not os.path.exists(out / "weights")
    # Staleness 0: each batch was generated by the version that trains on it, so every push arrived.
    assert all(m["staleness/head"] == 0 for m in metrics)


@pytest.mark.gpu(2)
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs (FSDP over NCCL, one rank per GPU); the CPU "
                    "tests above run the same code over gloo")
def test_the_same_checks_on_two_gpus_over_nccl(model_dir, tmp_path):
    """Every check above on cuda:0 and cuda:1 over NCCL, in float32 (bf16 in the bf16 check)."""
    out = str(tmp_path)
    mp.spawn(_worker, args=(_free_port(), model_dir, out, torch.cuda.is_bf16_supported(), "nccl"), nprocs=2, join=True)
    results = out, [torch.load(os.path.join(out, f"rank{r}.pt"), weights_only=True) for r in (0, 1)]
    for case in sorted(DP_CASES):
        test_gradients_and_update_equal_the_replicated_engine(results, case)
    test_five_step_loss_trajectory_equals_the_replicated_engine(results)
    test_parameter_and_optimizer_bytes_per_rank_fall_as_one_over_dp(results)
    test_resume_from_save_state_equals_the_uninterrupted_run(results)
    test_save_hf_loads_in_transformers_and_equals_the_gathered_weights(results)
    test_logprobs_with_uneven_micro_batches_match(results)
    if torch.cuda.is_bf16_supported():
        test_bf16_step_runs_near_fp32_with_fp32_master_state(results)
