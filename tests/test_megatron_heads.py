"""Value and score heads on the MegatronEngine, on CPU over gloo.

A single-process engine (TP=PP=1) is the reference: its value head's values match transformers'
AutoModelForTokenClassification loaded from its save_hf folder (and its score head's scores
AutoModelForSequenceClassification's), an MSE fit through train_batch lowers the loss. TP=2 (with
sequence parallel) and PP=2 engines loaded from that folder must give the same values, the same
gradients of the MSE loss and the same loss trajectory; save_state/load_state continues exactly.
"""

import json
import os

import pytest
import torch
import torch.multiprocessing as mp

from conftest import import_unless_ci  # noqa: E402

import_unless_ci("megatron.core", "pip install -e '.[megatron]'")
from safetensors.torch import load_file, save_file  # noqa: E402
from test_megatron_engine import _data, _free_port, _hf_dir  # noqa: E402

pytestmark = [pytest.mark.skipif(torch.cuda.is_available(), reason="CPU compatibility test"), pytest.mark.timeout(300)]

RTOL = 1e-4
STEPS = 6


def _batch(seed: int = 3) -> dict[str, list[torch.Tensor]]:
    """Random sequences with a per-sequence regression target (as a per-token key); no sequence ends
    in token 0 (the saved config's pad token: sequence classification would skip it)."""
    data = _data(seed)
    for ids in data["input_ids"]:
        ids[-1] = ids[-1].clamp_min(1)
    gen = torch.Generator().manual_seed(seed + 1)
    data["returns"] = [torch.full((len(x),), float(r)) for x, r in zip(data["input_ids"], torch.randn(6, generator=gen))]
    del data["advantages"]
    return data


def _mse(out, data):
    """Values regressed on the returns over the loss tokens."""
    assert out.logprobs is None and out.values is not None
    m = data["loss_mask"].float()
    loss = (((out.values - data["returns"]) ** 2) * m).sum() / m.sum()
    return loss, {"loss": loss.detach()}


def _n_tokens(data):
    return float(data["loss_mask"].sum())


def _score_mse(out, data):
    """Scores regressed on the per-sequence target (read at each sequence's last token)."""
    assert out.scores.shape == (out.cu_seqlens.numel() - 1,)
    target = data["returns"][out.cu_seqlens[1:].long() - 1]
    loss = ((out.scores - target) ** 2).mean()
    return loss, {"loss": loss.detach()}


def _n_seqs(data):
    return float(data["cu_seqlens"].numel() - 1)


def _engine(path: str, mesh: str, head: str, trainable: bool = True):
    from realcore.api.alloc import parse_mesh
    from realcore.api.config import OptimizerConfig, RoleConfig
    from realcore.backends.megatron.engine import MegatronEngine

    role = RoleConfig(backend="megatron", trainable=trainable, max_tokens_per_mb=24, dtype="float32", head=head,
                      optimizer=OptimizerConfig(lr=1e-2, warmup_steps=1, max_grad_norm=1.0))
    return MegatronEngine(path, role, parse_mesh(mesh), total_steps=STEPS, seed=7)


def _init(rank: int, world: int, port: int) -> None:
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)


def _assert_close(actual, expected, what):
    err = (actual - expected).norm() / expected.norm().clamp_min(1e-12)
    assert err < RTOL, f"{what}: relative error {err:.2e}"


def _shard(data, engine):
    dp, d = engine.dims.dp, engine.replica
    return {k: v[d::dp] for k, v in data.items()}


def _reference(rank, world, port, lm_path, out):
    """TP=PP=1 from the causal LM: heads freshly initialised, saved, checked against transformers."""
    from transformers import AutoModelForSequenceClassification, AutoModelForTokenClassification

    _init(rank, world, port)
    data = _batch()
    ids = data["input_ids"]
    engine = _engine(lm_path, "d1p1t1", "value")
    with pytest.raises(ValueError, match="head='value'"):
        engine.logprobs(ids)
    values = engine.values(ids)
    assert [v.shape for v in values] == [x.shape for x in ids] and all(float(v[0]) == 0.0 for v in values)
    engine.save_hf(f"{out}/value")
    hf = AutoModelForTokenClassification.from_pretrained(f"{out}/value").eval()
    assert hf.config.num_labels == 1 and hf.config.pad_token_id is not None
    with torch.no_grad():
        for i, (x, v) in enumerate(zip(ids, values)):
            head = hf(input_ids=x[None]).logits[0, :, 0]
            _assert_close(v, torch.cat([head.new_zeros(1), head[:-1]]), f"values[{i}] vs transformers")
    engine.forward_backward(data, _mse, _n_tokens)
    grads = engine.hf_state_dict(grads=True)
    assert set(grads) >= {"score.weight", "score.bias"} and "lm_head.weight" not in grads
    losses = [engine.train_batch(data, _mse, _n_tokens)["loss"] for _ in range(STEPS)]
    assert losses[-1] < 0.5 * losses[0], f"the MSE fit does not learn: {losses}"

    scorer = _engine(lm_path, "d1p1t1", "score")
    scores = scorer.scores(ids)
    assert all(s.shape == () for s in scores) and len(scores) == len(ids)
    scorer.save_hf(f"{out}/score")
    hf = AutoModelForSequenceClassification.from_pretrained(f"{out}/score").eval()
    with torch.no_grad():
        expected = torch.stack([hf(input_ids=x[None]).logits[0, 0] for x in ids])
    _assert_close(torch.stack(scores), expected, "scores vs transformers")
    score_losses = [scorer.train_batch(data, _score_mse, _n_seqs)["loss"] for _ in range(STEPS)]
    assert score_losses[-1] < 0.5 * score_losses[0], f"the score fit does not learn: {score_losses}"

    tensors = {f"v.{i}": v for i, v in enumerate(values)}
    tensors.update({f"grad.{k}": g.contiguous() for k, g in grads.items()})
    tensors["scores"] = torch.stack(scores)
    save_file(tensors, f"{out}/ref.st")
    with open(f"{out}/ref.json", "w") as f:
        json.dump(losses, f)
    torch.distributed.destroy_process_group()


def _mesh_worker(rank, world, port, out, mesh):
    """A mesh loading the reference's saved heads: same values, grads, trajectory; exact restart."""
    _init(rank, world, port)
    ref = load_file(f"{out}/ref.st")
    with open(f"{out}/ref.json") as f:
        expected = json.load(f)
    data = _batch()
    ids = data["input_ids"]
    engine = _engine(f"{out}/value", mesh, "value")
    for i, v in enumerate(engine.values(ids)):
        _assert_close(v, ref[f"v.{i}"], f"{mesh} values[{i}]")
    engine.forward_backward(_shard(data, engine), _mse, _n_tokens)
    grads = engine.hf_state_dict(grads=True)
    if rank == 0:
        assert grads.keys() == {k[5:] for k in ref if k.startswith("grad.")}
        for name, g in grads.items():
            _assert_close(g, ref[f"grad.{name}"], f"{mesh} grad {name}")
    half = STEPS // 2
    losses = [engine.train_batch(_shard(data, engine), _mse, _n_tokens)["loss"] for _ in range(half)]
    ckpt = f"{out}/ckpt-{mesh}"
    if rank == 0:
        os.makedirs(ckpt)
    torch.distributed.barrier()
    engine.save_state(ckpt)
    losses += [engine.train_batch(_shard(data, engine), _mse, _n_tokens)["loss"] for _ in range(STEPS - half)]
    for step, (a, b) in enumerate(zip(losses, expected)):
        assert abs(a - b) <= RTOL * abs(b), f"{mesh} step {step}: loss {a} vs reference {b} ({losses} vs {expected})"
    final = engine.values(ids)

    restarted = _engine(f"{out}/value", mesh, "value")
    restarted.load_state(ckpt)
    again = [restarted.train_batch(_shard(data, restarted), _mse, _n_tokens)["loss"] for _ in range(STEPS - half)]
    assert max(abs(a - b) for a, b in zip(again, losses[half:])) <= 1e-6, f"{mesh} after load_state: {again} vs {losses[half:]}"
    for a, b in zip(restarted.values(ids), final):
        assert (a - b).abs().max() <= 1e-6, f"{mesh}: values after load_state differ"

    scorer = _engine(f"{out}/score", mesh, "score", trainable=False)
    _assert_close(torch.stack(scorer.scores(ids)), ref["scores"], f"{mesh} scores")
    torch.distributed.destroy_process_group()


def _spawn(fn, world: int, *args):
    os.environ["OMP_NUM_THREADS"] = "1"
    mp.spawn(fn, args=(world, _free_port(), *args), nprocs=world, join=True)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("megatron_heads"))
    lm_path = _hf_dir(root, "tied")  # tied embeddings: the head must not tie to them
    out = os.path.join(root, "ref")
    os.makedirs(out)
    _spawn(_reference, 1, lm_path, out)
    return out


def test_reference_heads_match_transformers_and_learn(reference):
    assert os.path.exists(f"{reference}/ref.json")


@pytest.mark.parametrize("mesh", ["d1p1t2", "d1p2t1"])
def test_meshes_match_the_reference(reference, mesh):
    _spawn(_mesh_worker, 2, reference, mesh)


def test_token_values_alignment():
    """values[t] = V(x[:t]) is the head at row t - 1; 0 at each sequence's first token."""
    from realcore.backends.megatron.heads import token_values

    per_row = torch.tensor([10.0, 11.0, 12.0, 20.0, 21.0, 99.0])  # sequences of 3 and 2, then padding
    starts = torch.tensor([True, False, False, True, False, True])
    assert token_values(per_row, starts).tolist() == [0.0, 10.0, 11.0, 0.0, 20.0, 0.0]


def test_saved_config_names_the_classification_class_and_a_pad_token():
    from transformers import LlamaConfig

    from realcore.backends.megatron.heads import head_hf_config

    lm = LlamaConfig(hidden_size=64, num_attention_heads=4, num_hidden_layers=2, vocab_size=128, eos_token_id=[5, 6],
                     tie_word_embeddings=True)
    value = head_hf_config(lm, "value", None)
    assert value.architectures == ["LlamaForTokenClassification"] and value.num_labels == 1
    assert value.pad_token_id == 5 and not value.tie_word_embeddings
    score = head_hf_config(lm, "score", 3)  # the tokenizer's pad token where the config has none
    assert score.architectures == ["LlamaForSequenceClassification"] and score.pad_token_id == 3
    assert lm.architectures is None and lm.num_labels == 2  # the engine's own config is left alone
