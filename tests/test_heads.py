"""Value and score heads on the torch and fsdp engines: alignment, training through train_batch,
HF export, checkpoints, per-sequence keys, and the refusals (RoleConfig.head)."""

from __future__ import annotations

import os
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from realcore.api.config import OptimizerConfig, RoleConfig
from realcore.api.engine import HeadOutput
from realcore.backends.batching import check_train_data
from realcore.backends.torch_engine import TorchEngine
from tests.test_torch_engine import VOCAB, _free_port

torch.set_num_threads(1)


@pytest.fixture(scope="module", params=["qwen2", "llama"])
def model_dir(request, tmp_path_factory) -> str:
    """A tiny causal LM checkpoint (the value/score head is not in it); llama with tied embeddings
    as the tiny experiment model builds it. pad = eos = VOCAB - 1, a token the tests never draw."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    cls_cfg, cls = {"qwen2": (Qwen2Config, Qwen2ForCausalLM), "llama": (LlamaConfig, LlamaForCausalLM)}[request.param]
    torch.manual_seed(0)
    cfg = cls_cfg(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=VOCAB, initializer_range=0.1, tie_word_embeddings=True,
                  pad_token_id=VOCAB - 1, eos_token_id=VOCAB - 1)
    path = str(tmp_path_factory.mktemp(f"tiny-{request.param}"))
    cls(cfg).save_pretrained(path)
    return path


def _role(head: str, trainable: bool = False, lr: float = 1e-2, **kw) -> RoleConfig:
    return RoleConfig(head=head, trainable=trainable, dtype="float32", max_tokens_per_mb=kw.pop("budget", 4096),
                      optimizer=OptimizerConfig(lr=lr, lr_scheduler="constant", warmup_steps=0), **kw)


def _seqs(lens: list[int], seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB - 1, (n,), generator=g) for n in lens]  # never the pad token


def _mse(out: HeadOutput, data):
    mask = data["loss_mask"].float()
    loss = ((out.values - data["target"]) ** 2 * mask).sum() / mask.sum()
    return loss, {"loss": loss.detach()}


def _n_tokens(data) -> float:
    return float(data["loss_mask"].sum())


def _bradley_terry(out: HeadOutput, data):
    """-log sigmoid(s_chosen - s_rejected) over consecutive pairs; `chosen` is per-sequence (n_seqs,)."""
    assert out.scores.shape == data["chosen"].shape == (len(out.cu_seqlens) - 1,)
    s = out.scores.view(-1, 2)
    first_chosen = data["chosen"].view(-1, 2)[:, 0].bool()
    margin = torch.where(first_chosen, s[:, 0] - s[:, 1], s[:, 1] - s[:, 0])
    loss = -F.logsigmoid(margin).mean()
    return loss, {"loss": loss.detach()}


def test_values_are_aligned_with_the_state_before_each_token(model_dir):
    eng = TorchEngine(model_dir, _role("value", budget=24), total_steps=1)
    xs = _seqs([9, 13, 5, 17], seed=1)
    vals = eng.values(xs)
    assert [v.shape for v in vals] == [x.shape for x in xs] and all(v.dtype == torch.float32 for v in vals)
    for x, v in zip(xs, vals):
        assert v[0] == 0
        with torch.no_grad():  # unpacked, each alone: the head after reading x[:t + 1]
            h = eng.model(input_ids=x[None]).logits[0, :, 0]
        torch.testing.assert_close(v[1:], h[:-1], atol=1e-5, rtol=0)
        assert v[1:].abs().min() > 0  # the fresh head is not all zero: the checks below can see changes
    x, k = xs[1], 6
    y = x.clone()
    y[k] = (x[k] + 1) % (VOCAB - 1)  # change token k only
    vx, vy = eng.values([x])[0], eng.values([y])[0]
    torch.testing.assert_close(vx[: k + 1], vy[: k + 1], atol=1e-6, rtol=0)  # V(x[:t]) for t <= k: unchanged
    assert (vx[k + 1] - vy[k + 1]).abs() > 1e-4  # V(x[:k + 1]) reads token k


def test_value_head_fits_targets_with_mse_through_train_batch(model_dir):
    eng = TorchEngine(model_dir, _role("value", trainable=True, lr=3e-3), total_steps=100)
    xs = _seqs([8, 11, 6], seed=2)
    g = torch.Generator().manual_seed(3)
    targets = [torch.randn(len(x), generator=g) for x in xs]
    mask = [torch.cat([torch.zeros(1), torch.ones(len(x) - 1)]) for x in xs]
    data = {"input_ids": xs, "target": targets, "loss_mask": mask}
    losses = [eng.train_batch(data, _mse, _n_tokens)["loss"] for _ in range(60)]
    assert losses[-1] < 0.1 * losses[0], losses[::10]
    # values() agrees with what the loss saw (the same forward in eval mode: no dropout anywhere)
    got = torch.cat([v[1:] for v in eng.values(xs)])
    want = torch.cat([t[1:] for t in targets])
    assert float(((got - want) ** 2).mean()) == pytest.approx(eng.train_batch(data, _mse, _n_tokens)["loss"], rel=0.2)


@pytest.mark.parametrize("chosen_first", [True, False])
def test_score_head_trained_with_bradley_terry_ranks_the_pair_as_trained(model_dir, chosen_first):
    eng = TorchEngine(model_dir, _role("score", trainable=True, lr=3e-3), total_steps=100)
    a, b = _seqs([7, 10], seed=4)
    data = {"input_ids": [a, b], "chosen": [torch.tensor([int(chosen_first)]), torch.tensor([int(not chosen_first)])]}
    for _ in range(30):
        eng.train_batch(data, _bradley_terry, lambda d: float(len(d["cu_seqlens"]) - 1), group_sizes=[2])
    sa, sb = eng.scores([a, b])
    assert sa.shape == () and sa.dtype == torch.float32
    assert (sa - sb if chosen_first else sb - sa) > 1.0


def test_save_hf_loads_as_token_and_sequence_classification_with_the_same_outputs(model_dir, tmp_path):
    from transformers import AutoConfig, AutoModelForSequenceClassification, AutoModelForTokenClassification

    xs = _seqs([9, 6, 12], seed=5)
    value = TorchEngine(model_dir, _role("value", trainable=True), total_steps=10)
    value.train_batch({"input_ids": xs, "target": [torch.ones(len(x)) for x in xs],
                       "loss_mask": [torch.ones(len(x)) for x in xs]}, _mse, _n_tokens)  # a trained head
    value.save_hf(str(tmp_path / "value"))
    cfg = AutoConfig.from_pretrained(tmp_path / "value")
    assert cfg.architectures[0].endswith("ForTokenClassification") and cfg.num_labels == 1
    hf = AutoModelForTokenClassification.from_pretrained(tmp_path / "value").eval()
    for x, v in zip(xs, value.values(xs)):
        with torch.no_grad():
            h = hf(input_ids=x[None]).logits[0, :, 0]
        torch.testing.assert_close(v[1:], h[:-1], atol=1e-5, rtol=0)

    score = TorchEngine(model_dir, _role("score"), total_steps=1, seed=3)
    score.save_hf(str(tmp_path / "score"))
    cfg = AutoConfig.from_pretrained(tmp_path / "score")
    assert cfg.architectures[0].endswith("ForSequenceClassification") and cfg.pad_token_id == VOCAB - 1
    hf = AutoModelForSequenceClassification.from_pretrained(tmp_path / "score").eval()
    # A right-padded batch, as a user of the exported reward model scores with it.
    batch = torch.full((len(xs), max(len(x) for x in xs)), VOCAB - 1)
    for i, x in enumerate(xs):
        batch[i, : len(x)] = x
    with torch.no_grad():
        got = hf(input_ids=batch, attention_mask=(batch != VOCAB - 1).long()).logits[:, 0]
    torch.testing.assert_close(got, torch.stack(score.scores(xs)), atol=1e-5, rtol=0)
    # ... and the folder builds a score engine again, with the same head
    again = TorchEngine(str(tmp_path / "score"), _role("score"), total_steps=1, seed=99)
    torch.testing.assert_close(torch.stack(again.scores(xs)), torch.stack(score.scores(xs)), atol=1e-6, rtol=0)


def test_value_state_round_trips(model_dir, tmp_path):
    xs = _seqs([5, 8], seed=6)
    data = {"input_ids": xs, "target": [torch.randn(len(x)) for x in xs], "loss_mask": [torch.ones(len(x)) for x in xs]}
    a = TorchEngine(model_dir, _role("value", trainable=True), total_steps=10)
    a.train_batch(data, _mse, _n_tokens)
    a.save_state(str(tmp_path))
    b = TorchEngine(model_dir, _role("value", trainable=True), total_steps=10, seed=1)  # another fresh head
    b.load_state(str(tmp_path))
    assert b.version == 1
    torch.testing.assert_close(torch.cat(b.values(xs)), torch.cat(a.values(xs)), atol=0, rtol=0)
    sa, sb = a.train_batch(data, _mse, _n_tokens), b.train_batch(data, _mse, _n_tokens)
    assert sa["loss"] == sb["loss"]


def test_fresh_heads_are_seeded(model_dir):
    xs = _seqs([6], seed=7)
    same = [TorchEngine(model_dir, _role("value"), total_steps=1, seed=5).values(xs)[0] for _ in range(2)]
    other = TorchEngine(model_dir, _role("value"), total_steps=1, seed=6).values(xs)[0]
    torch.testing.assert_close(same[0], same[1], atol=0, rtol=0)
    assert not torch.allclose(same[0], other)


def test_a_head_answers_only_its_own_calls(model_dir):
    value = TorchEngine(model_dir, _role("value"), total_steps=1)
    with pytest.raises(ValueError, match="generate: a value head does not sample"):
        value.generate([[1, 2]], None)
    with pytest.raises(ValueError, match="logprobs: needs a role with head: policy"):
        value.logprobs(_seqs([4], 0))
    with pytest.raises(ValueError, match="scores: needs a role with head: score"):
        value.scores(_seqs([4], 0))
    policy = TorchEngine(model_dir, _role("policy"), total_steps=1)
    with pytest.raises(ValueError, match="values: needs a role with head: value .this role's head is policy"):
        policy.values(_seqs([4], 0))
    from realcore.api.config import LoraConfig

    with pytest.raises(ValueError, match="lora: a value head trains every weight"):
        TorchEngine(model_dir, _role("value", trainable=True, lora=LoraConfig()), total_steps=1)


def test_per_sequence_keys_are_packed_as_one_value_per_sequence():
    ids = [torch.arange(5), torch.arange(3)]
    assert check_train_data({"input_ids": ids, "label": [torch.tensor([1.0]), torch.tensor([0.0])]}) == [5, 3]
    with pytest.raises(ValueError, match="key 'label' is neither per-token"):
        check_train_data({"input_ids": ids, "label": [torch.ones(2), torch.ones(1)]})
    with pytest.raises(ValueError, match="key 'label' has 1 sequences"):
        check_train_data({"input_ids": ids, "label": [torch.ones(5)]})


def _fsdp_worker(rank: int, port: int, model_dir: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=120))
    from realcore.backends.fsdp_engine import FSDPEngine

    try:
        xs = _seqs([7, 12, 5] if rank == 0 else [9, 4], seed=10 + rank)  # uneven micro-batch counts
        data = {"input_ids": xs, "target": [torch.randn(len(x), generator=torch.Generator().manual_seed(len(x)))
                                            for x in xs], "loss_mask": [torch.ones(len(x)) for x in xs]}
        res = {}
        for kind, cls in (("torch", TorchEngine), ("fsdp", FSDPEngine)):
            eng = cls(model_dir, _role("value", trainable=True, budget=12), total_steps=10)
            res[f"{kind}/before"] = eng.values(xs)
            res[f"{kind}/stats"] = eng.train_batch(data, _mse, _n_tokens)
            res[f"{kind}/after"] = eng.values(xs)
            if kind == "fsdp":
                eng.save_hf(os.path.join(out, "fsdp-value"))  # collective: rank 0 writes the gathered model
        torch.save(res, os.path.join(out, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_fsdp_value_head_equals_the_replicated_engine(tmp_path):
    from tests.test_fsdp import save_tiny_qwen2

    model_dir = save_tiny_qwen2(str(tmp_path / "model"))
    mp.spawn(_fsdp_worker, args=(_free_port(), model_dir, str(tmp_path)), nprocs=2, join=True)
    for r in (0, 1):
        res = torch.load(tmp_path / f"rank{r}.pt", weights_only=True)
        for when in ("before", "after"):
            torch.testing.assert_close(torch.cat(res[f"fsdp/{when}"]), torch.cat(res[f"torch/{when}"]),
                                       atol=1e-5, rtol=1e-5)
        assert res["fsdp/stats"]["loss"] == pytest.approx(res["torch/stats"]["loss"], rel=1e-5)
        assert res["torch/after"][0][1:].sub(res["torch/before"][0][1:]).abs().max() > 1e-4  # the step moved it
    from transformers import AutoModelForTokenClassification

    hf = AutoModelForTokenClassification.from_pretrained(tmp_path / "fsdp-value").eval()
    res = torch.load(tmp_path / "rank0.pt", weights_only=True)
    for x, v in zip(_seqs([7, 12, 5], seed=10), res["fsdp/after"]):
        with torch.no_grad():
            h = hf(input_ids=x[None]).logits[0, :, 0]
        torch.testing.assert_close(v[1:], h[:-1], atol=1e-5, rtol=0)


def test_the_validator_refuses_lora_on_a_value_head():
    from realcore.api.config import LoraConfig
    from realcore.launch.config_loader import ConfigError, load_config
    from realcore.launch.validate import validate

    cfg = load_config(["experiment=ppo-math", "model=tiny", "output_dir=/tmp/heads-unused"])
    ref = cfg.ref.model_copy(update={"head": "value", "trainable": True, "lora": LoraConfig()})
    with pytest.raises(ConfigError, match="ref.lora: a value head trains every weight"):
        validate(cfg.model_copy(update={"ref": ref}))
