"""TorchEngine on a tiny random Qwen2: packing, token-weighted micro-batch/DP equivalence, lr, save."""

from __future__ import annotations

import math
import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from realcore.api.config import OptimizerConfig, RoleConfig
from realcore.backends.batching import lr_factor, split_by_budget, split_minibatches
from realcore.backends.torch_engine import TorchEngine

torch.set_num_threads(1)

VOCAB = 128


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=VOCAB, initializer_range=0.1,
    )
    path = str(tmp_path_factory.mktemp("tiny-qwen2"))
    Qwen2ForCausalLM(cfg).save_pretrained(path)
    return path


def make_data(lens: list[int], seed: int) -> dict[str, list[torch.Tensor]]:
    """Random sequences with a random loss mask (never on token 0, at least one token each)."""
    g = torch.Generator().manual_seed(seed)
    ids, mask = [], []
    for n in lens:
        ids.append(torch.randint(0, VOCAB, (n,), generator=g))
        m = (torch.rand(n, generator=g) < 0.6).long()
        m[0], m[-1] = 0, 1
        mask.append(m)
    return {"input_ids": ids, "loss_mask": mask}


def nll_loss(out, data):
    mask = data["loss_mask"].float()
    loss = -(out.logprobs * mask).sum() / mask.sum()
    return loss, {"loss": loss.detach(), "entropy": (out.entropy.detach() * mask).sum() / mask.sum()}


def n_loss_tokens(data) -> float:
    return float(data["loss_mask"].sum())


def trainable_role(budget: int, **opt) -> RoleConfig:
    # Adam's first step is lr * g / (|g| + eps): a large eps keeps that Lipschitz, so float-level
    # differences in the gradients stay float-level in the updated parameters.
    opt = {"lr": 1e-3, "eps": 1e-3, **opt}
    return RoleConfig(trainable=True, max_tokens_per_mb=budget, optimizer=OptimizerConfig(**opt))


def train_once(model_dir, data, budget, n_minibatches=1, group=None):
    """One train_batch; returns (stats, grads per optimizer step as seen by the optimizer, params)."""
    eng = TorchEngine(model_dir, trainable_role(budget), total_steps=10, group=group)
    grads: list[dict[str, torch.Tensor]] = []
    named = list(eng.model.named_parameters())
    eng.optimizer.register_step_pre_hook(lambda *_: grads.append({n: p.grad.clone() for n, p in named}))
    stats = eng.train_batch(data, nll_loss, n_loss_tokens, n_minibatches=n_minibatches, temperature=0.7)
    assert eng.version == n_minibatches
    return stats, grads, {n: p.detach().clone() for n, p in named}


def assert_same_update(a, b):
    (stats_a, grads_a, params_a), (stats_b, grads_b, params_b) = a, b
    for k in ("loss", "entropy", "grad_norm", "lr"):
        assert stats_a[k] == pytest.approx(stats_b[k], rel=1e-5), k
    assert len(grads_a) == len(grads_b)
    for ga, gb in zip(grads_a, grads_b):
        for n in ga:
            # Summation order differs, so tiny entries carry float32 noise of the tensor's scale.
            torch.testing.assert_close(ga[n], gb[n], rtol=1e-5, atol=1e-5 * float(gb[n].abs().max()), msg=n)
    for n in params_a:
        torch.testing.assert_close(params_a[n], params_b[n], rtol=1e-5, atol=1e-7, msg=n)


def test_splits():
    assert split_by_budget([3, 4, 10, 2, 2], 7) == [[0, 1], [2], [3, 4]]
    assert split_by_budget([], 7) == []
    assert [list(r) for r in split_minibatches(5, 2)] == [[0, 1, 2], [3, 4]]
    assert [len(r) for r in split_minibatches(1, 3)] == [1, 0, 0]


def test_packed_logprobs_match_unpacked(model_dir):
    data = make_data([7, 12, 3, 20, 9, 1, 15], seed=1)
    eng = TorchEngine(model_dir, RoleConfig(trainable=False, max_tokens_per_mb=25), total_steps=1)
    assert len(split_by_budget([len(x) for x in data["input_ids"]], 25)) >= 3  # several packed micro-batches
    lps = eng.logprobs(data["input_ids"], temperature=0.7)
    for x, lp in zip(data["input_ids"], lps):
        with torch.no_grad():
            logits = eng.model(input_ids=x[None]).logits[0]  # (L, V), unpacked, no mask
        ref = torch.cat([torch.zeros(1), F.log_softmax(logits[:-1] / 0.7, -1).gather(-1, x[1:, None])[:, 0]])
        assert lp.dtype == torch.float32 and lp.shape == x.shape
        torch.testing.assert_close(lp, ref, atol=1e-5, rtol=0)


def test_microbatch_split_does_not_change_update(model_dir):
    data = make_data([7, 12, 3, 20, 9, 1, 15], seed=2)
    big = train_once(model_dir, data, budget=10_000)
    tiny = train_once(model_dir, data, budget=8)
    assert_same_update(big, tiny)
    # The loss stat is the token-level mean over the whole batch.
    eng = TorchEngine(model_dir, RoleConfig(trainable=False), total_steps=1)
    lps = eng.logprobs(data["input_ids"], temperature=0.7)
    mask = torch.cat(data["loss_mask"]).float()
    assert big[0]["loss"] == pytest.approx(float(-(torch.cat(lps) * mask).sum() / mask.sum()), rel=1e-5)


def test_minibatches_step_once_each(model_dir):
    data = make_data([5, 6, 7, 8, 9], seed=3)
    stats, grads, _ = train_once(model_dir, data, budget=10, n_minibatches=3)
    assert len(grads) == 3 and all(math.isfinite(stats[k]) for k in ("loss", "grad_norm", "lr"))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# DP scenarios: (global sequence lengths, indices on rank 0, indices on rank 1, n_minibatches).
# Single-process order = rank0 chunk 1, rank1 chunk 1, rank0 chunk 2, ... so minibatches coincide.
DP_CASES = {
    "uneven": ([30, 25, 4, 3, 6], [0, 1], [2, 3, 4], 1),
    # rank 1's second minibatch is empty: it still joins the collectives with zero gradients.
    "empty_minibatch": ([8, 9, 5, 10, 7], [0, 1, 3, 4], [2], 2),
}


def _dp_worker(rank: int, port: int, model_dir: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        for name, (lens, idx0, idx1, n_mb) in DP_CASES.items():
            data = make_data(lens, seed=4)
            mine = idx0 if rank == 0 else idx1
            local = {k: [v[i] for i in mine] for k, v in data.items()}
            stats, grads, params = train_once(model_dir, local, budget=12, n_minibatches=n_mb)
            tensors = {f"param.{n}": p for n, p in params.items()}
            tensors.update({f"grad{i}.{n}": g for i, gs in enumerate(grads) for n, g in gs.items()})
            tensors.update({f"stat.{k}": torch.tensor(v, dtype=torch.float64) for k, v in stats.items()})
            save_file(tensors, os.path.join(out_dir, f"{name}-rank{rank}.safetensors"))
    finally:
        dist.destroy_process_group()


def _unpack(tensors, n_steps):
    stats = {k[5:]: float(v) for k, v in tensors.items() if k.startswith("stat.")}
    grads = [{k[len(f"grad{i}."):]: v for k, v in tensors.items() if k.startswith(f"grad{i}.")} for i in range(n_steps)]
    params = {k[6:]: v for k, v in tensors.items() if k.startswith("param.")}
    return stats, grads, params


def test_data_parallel_matches_single_process(model_dir, tmp_path):
    mp.spawn(_dp_worker, args=(_free_port(), model_dir, str(tmp_path)), nprocs=2, join=True)
    for name, (lens, idx0, idx1, n_mb) in DP_CASES.items():
        data = make_data(lens, seed=4)
        c0, c1 = split_minibatches(len(idx0), n_mb), split_minibatches(len(idx1), n_mb)
        order = [i for a, b in zip(c0, c1) for i in [idx0[j] for j in a] + [idx1[j] for j in b]]
        single = train_once(model_dir, {k: [v[i] for i in order] for k, v in data.items()}, 10_000, n_mb)
        for rank in (0, 1):
            dp = _unpack(load_file(str(tmp_path / f"{name}-rank{rank}.safetensors")), n_mb)
            assert_same_update(single, dp)


def test_lr_schedule(model_dir):
    opt = OptimizerConfig(lr=1.0, warmup_steps=2, min_lr_ratio=0.1)
    cos = lambda p: 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * p))  # noqa: E731
    expected = [0.5, 1.0, cos(0 / 8), cos(1 / 8), cos(4 / 8), cos(8 / 8), cos(1.0)]
    assert [lr_factor(s, opt, 10) for s in (0, 1, 2, 3, 6, 10, 12)] == pytest.approx(expected)
    const = opt.model_copy(update={"lr_scheduler": "constant"})
    assert [lr_factor(s, const, 10) for s in (0, 1, 5, 50)] == pytest.approx([0.5, 1.0, 1.0, 1.0])
    # Through the engine: the reported lr is the one each optimizer step used.
    role = trainable_role(10_000, warmup_steps=2, min_lr_ratio=0.1)
    eng = TorchEngine(model_dir, role, total_steps=4)
    data = make_data([6, 5], seed=5)
    lrs = [eng.train_batch(data, nll_loss, n_loss_tokens)["lr"] for _ in range(5)]
    assert lrs == pytest.approx([1e-3 * f for f in (0.5, 1.0, cos(0), cos(0.5), cos(1.0))])


def test_save_hf_roundtrip_and_frozen_role(model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    eng = TorchEngine(model_dir, trainable_role(10_000), total_steps=2)
    out = tmp_path / "ckpt"
    eng.save_hf(str(out))
    eng.train_batch(make_data([6, 9], seed=6), nll_loss, n_loss_tokens)
    eng.save_hf(str(out))  # overwrites an existing checkpoint
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]  # no temporary directories left behind
    loaded = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).state_dict()
    mine = eng.model.state_dict()
    assert loaded.keys() == mine.keys()
    for k in mine:
        assert torch.equal(loaded[k], mine[k]), k

    frozen = TorchEngine(str(out), RoleConfig(trainable=False), total_steps=1)
    assert frozen.tokenizer is None and frozen.optimizer is None
    assert not any(p.requires_grad for p in frozen.model.parameters()) and not frozen.model.training
    with pytest.raises(ValueError, match="not trainable"):
        frozen.train_batch(make_data([4], seed=7), nll_loss, n_loss_tokens)


def _count_forwards(module: torch.nn.Module) -> list[int]:
    """Tokens of every forward call of `module` (HF passes input_ids as a keyword)."""
    calls: list[int] = []
    module.register_forward_hook(lambda mod, args, kwargs, out: calls.append(int(kwargs["input_ids"].shape[1])),
                                 with_kwargs=True)
    return calls


def _mfc(mfc_type: str, budget: int | None):
    """An MFC object as the model worker builds it: (ExperimentConfig, its MFCConfig)."""
    from realcore.api.config import ExperimentConfig, MFCConfig
    from realcore.api.registry import lookup

    m = MFCConfig(name=f"{mfc_type}-{budget}", type=mfc_type, model="actor", max_tokens_per_mb=budget)
    cfg = ExperimentConfig(experiment_name="t", output_dir="/tmp/unused", mfcs=[m])
    return lookup("mfc", mfc_type)(cfg, m)


def test_mfc_max_tokens_per_mb_overrides_the_role_for_that_mfc_only(model_dir):
    import realcore.mfc  # noqa: F401  (registers the built-in MFCs)
    from realcore.api.data import SequenceSample

    lens = [7, 12, 3, 20, 9, 1, 15]  # 67 tokens: one micro-batch under the role's budget, three under 25
    assert split_by_budget(lens, 25) == [[0, 1, 2], [3], [4, 5, 6]]
    data = make_data(lens, seed=8)
    g = torch.Generator().manual_seed(8)
    data["behav_logprobs"] = [-torch.rand(n, generator=g) for n in lens]
    data["rewards"] = [torch.tensor([float(i % 2)]) for i in range(len(lens))]
    batch = SequenceSample.from_flat([0, 1], [3, 4], data)  # two prompts, groups of 3 and 4

    # inference: two MFCs on one engine, only the one with the key micro-batches differently.
    eng = TorchEngine(model_dir, trainable_role(10_000), total_steps=10)
    calls = _count_forwards(eng.model)
    small = _mfc("inference", 25).run(eng, batch).flat("logprobs")
    assert calls == [22, 20, 25]
    calls.clear()
    default = _mfc("inference", None).run(eng, batch).flat("logprobs")
    assert calls == [67] and eng.role.max_tokens_per_mb == 10_000
    for a, b in zip(small, default):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)

    # ppo_update and sft_update: the same split in training; the update itself does not change.
    for mfc_type in ("ppo_update", "sft_update"):
        results = {}
        for budget, expected in ((25, [22, 20, 25]), (None, [67])):
            eng = TorchEngine(model_dir, trainable_role(10_000), total_steps=10)
            calls = _count_forwards(eng.model)
            stats = _mfc(mfc_type, budget).run(eng, batch)
            assert calls == expected, (mfc_type, budget)
            results[budget] = (stats, {n: p.detach().clone() for n, p in eng.model.named_parameters()})
        (s25, p25), (sdef, pdef) = results[25], results[None]
        for k in ("loss", "grad_norm"):
            assert s25[k] == pytest.approx(sdef[k], rel=1e-5), (mfc_type, k)
        for n in pdef:
            torch.testing.assert_close(p25[n], pdef[n], rtol=1e-5, atol=1e-7, msg=n)


def _counted(fn, calls: list):
    def wrapper(*args, **kwargs):
        calls.append(1)
        return fn(*args, **kwargs)
    return wrapper


def test_gradient_checkpointing_recomputes_layers_same_update(model_dir):
    data = make_data([7, 12, 3, 20], seed=9)
    results = {}
    for ckpt in (False, True):
        role = trainable_role(10_000).model_copy(update={"gradient_checkpointing": ckpt})
        eng = TorchEngine(model_dir, role, total_steps=10)
        layer_calls = []
        for layer in eng.model.model.layers:  # count MLP forwards (module hooks do not run in the recompute)
            layer.mlp.forward = _counted(layer.mlp.forward, layer_calls)
        stats = eng.train_batch(data, nll_loss, n_loss_tokens)
        results[ckpt] = (stats, len(layer_calls), {n: p.detach().clone() for n, p in eng.model.named_parameters()})
    (s0, n0, p0), (s1, n1, p1) = results[False], results[True]
    assert n0 == 2 and n1 == 4  # 2 layers, one micro-batch: each layer runs again in backward
    assert s1["loss"] == pytest.approx(s0["loss"], rel=1e-6)
    assert s1["grad_norm"] == pytest.approx(s0["grad_norm"], rel=1e-5)
    for n in p0:
        torch.testing.assert_close(p1[n], p0[n], rtol=1e-5, atol=1e-7, msg=n)


def test_the_lr_schedule_ends_at_the_runs_last_optimizer_step():
    """A ppo_update step makes ppo_n_minibatches x ppo_epochs optimizer steps: the cosine decay must
    span all of them, not end a third of the way through the run."""
    from realcore.launch.config_loader import load_config
    from realcore.trainer.model_worker import optimizer_steps

    cfg = load_config(["experiment=ppo-math", "model=tiny", "trainer.total_steps=7", "ppo.ppo_n_minibatches=2",
                       "ppo.ppo_epochs=3"])
    assert optimizer_steps(cfg, "actor") == 42
    assert optimizer_steps(load_config(["experiment=sft-math", "model=tiny", "trainer.total_steps=7"]), "actor") == 7


# ---- devices, precision, resume ----


def test_auto_dtype_is_float32_on_a_cpu(model_dir):
    """RoleConfig.dtype's default "auto" keeps a CPU user's float32, trainable or not."""
    for trainable in (True, False):
        eng = TorchEngine(model_dir, RoleConfig(trainable=trainable), total_steps=1)
        assert eng.device == torch.device("cpu") and eng.dtype == torch.float32
        assert {p.dtype for p in eng.model.parameters()} == {torch.float32}


def test_resume_restores_the_random_state(model_dir, tmp_path):
    eng = TorchEngine(model_dir, trainable_role(10_000), total_steps=5)
    eng.train_batch(make_data([6, 9], seed=11), nll_loss, n_loss_tokens)
    eng.save_state(str(tmp_path))
    expected = torch.rand(8)
    torch.rand(100)  # the generator moves on
    resumed = TorchEngine(model_dir, trainable_role(10_000), total_steps=5)
    resumed.load_state(str(tmp_path))
    assert resumed.version == 1 and torch.equal(torch.rand(8), expected)


def test_resume_on_a_gpu_reads_the_states_on_the_host_and_restores_the_gpu_generator(model_dir, tmp_path, monkeypatch):
    """Mocks CUDA, which a CPU cannot run: the engine believes it computes on cuda:0 and torch.cuda's
    generator functions are stand-ins. The file must load on the host (loading it onto the GPU
    handed torch.set_rng_state a CUDA tensor), and the GPU generator is saved and restored."""
    eng = TorchEngine(model_dir, trainable_role(10_000), total_steps=5)
    gpu = {"state": torch.arange(16, dtype=torch.uint8)}
    restored = []
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda device="cuda": gpu["state"].clone())
    monkeypatch.setattr(torch.cuda, "set_rng_state",
                        lambda state, device="cuda": restored.append((state.clone(), state.device, device)))
    eng.device = torch.device("cuda", 0)
    eng.save_state(str(tmp_path))
    expected = torch.rand(4)
    gpu["state"] = torch.zeros(16, dtype=torch.uint8)
    eng.load_state(str(tmp_path))
    assert torch.equal(torch.rand(4), expected)
    (state, where, device), = restored
    assert torch.equal(state, torch.arange(16, dtype=torch.uint8)) and where.type == "cpu"
    assert device == torch.device("cuda", 0)


class _ReadOnHost(torch.Tensor):
    """A loss statistic that fails when the host reads it (float(), .item()): on a GPU each read
    waits for the device."""

    def __float__(self):
        raise AssertionError("a loss statistic read on the host per micro-batch")

    def item(self):
        raise AssertionError("a loss statistic read on the host per micro-batch")


def test_loss_statistics_stay_on_the_device_until_the_minibatch_ends(model_dir):
    """_train_minibatch sums each statistic on the device over micro-batches, and reduce_weighted
    reads them all in one copy: none is read per micro-batch, and the numbers are those of floats."""
    def device_only(out, data):
        loss, stats = nll_loss(out, data)
        return loss, {k: v.as_subclass(_ReadOnHost) for k, v in stats.items()}

    data = make_data([7, 12, 3, 20, 9], seed=2)
    got = TorchEngine(model_dir, trainable_role(8), total_steps=2).train_batch(data, device_only, n_loss_tokens)
    want = TorchEngine(model_dir, trainable_role(8), total_steps=2).train_batch(data, nll_loss, n_loss_tokens)
    assert len(split_by_budget([len(x) for x in data["input_ids"]], 8)) == 5 and got == want


@pytest.mark.gpu(1)
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs 1 GPU (the CPU route runs the same code above)")
def test_on_a_gpu_auto_is_bf16_a_frozen_role_holds_bf16_and_resume_restores_both_generators(model_dir, tmp_path):
    actor = TorchEngine(model_dir, trainable_role(10_000), total_steps=5)
    ref = TorchEngine(model_dir, RoleConfig(trainable=False), total_steps=1)
    assert actor.device == ref.device == torch.device("cuda", torch.cuda.current_device())
    assert actor.dtype == ref.dtype == torch.bfloat16
    assert {p.dtype for p in actor.model.parameters()} == {torch.float32}  # AdamW's master copy
    assert {p.dtype for p in ref.model.parameters()} == {torch.bfloat16}  # inference only: bf16 weights
    data = make_data([7, 12, 3, 20], seed=12)
    for a, b in zip(actor.logprobs(data["input_ids"]), ref.logprobs(data["input_ids"])):
        torch.testing.assert_close(a, b, atol=5e-2, rtol=0)
    stats = actor.train_batch(data, nll_loss, n_loss_tokens)
    assert math.isfinite(stats["loss"]) and math.isfinite(stats["grad_norm"])
    actor.save_state(str(tmp_path))
    expected = torch.rand(4), torch.rand(4, device=actor.device)
    resumed = TorchEngine(model_dir, trainable_role(10_000), total_steps=5)
    resumed.load_state(str(tmp_path))
    assert torch.equal(torch.rand(4), expected[0]) and torch.equal(torch.rand(4, device=actor.device), expected[1])
    for n, p in resumed.model.named_parameters():
        assert p.device == actor.device and torch.equal(p, dict(actor.model.named_parameters())[n]), n
