"""Packed rows reach attention as sequence boundaries (cu_seqlens), never as a dense mask; the loss
function sees the boundaries; groups stay in one micro-batch when asked; one train_batch serves
the torch and Megatron engines."""

from __future__ import annotations

import pytest
import torch
from test_torch_engine import VOCAB, make_data, n_loss_tokens, nll_loss

from realcore.api.config import OptimizerConfig, RoleConfig
from realcore.backends import varlen_attention
from realcore.backends.torch_engine import TorchEngine


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=VOCAB, initializer_range=0.1)
    path = str(tmp_path_factory.mktemp("tiny-qwen2"))
    Qwen2ForCausalLM(cfg).save_pretrained(path)
    return path


def _role(**kw) -> RoleConfig:
    return RoleConfig(backend="torch", trainable=True, max_tokens_per_mb=40,
                      optimizer=OptimizerConfig(lr=1e-2, warmup_steps=1), **kw)


def test_packed_logprobs_equal_one_forward_per_sequence_and_no_mask_is_built(model_dir, monkeypatch):
    seen = []
    real = varlen_attention.varlen_attention

    def spy(module, query, key, value, attention_mask, **kwargs):
        seen.append((attention_mask, kwargs.get("cu_seq_lens_q")))
        return real(module, query, key, value, attention_mask, **kwargs)

    monkeypatch.setattr(varlen_attention, "varlen_attention", spy)
    engine = TorchEngine(model_dir, _role(), total_steps=1)
    data = make_data([7, 12, 5, 16, 9], seed=1)
    packed = engine.logprobs(data["input_ids"])
    assert seen and all(mask is None and cu is not None for mask, cu in seen)  # boundaries, never a (T, T) mask
    assert seen[0][1].tolist() == [0, 7, 19, 24, 40]  # the first micro-batch: 7 + 12 + 5 + 16 tokens within 40
    for ids, lp in zip(data["input_ids"], packed):
        alone = engine.logprobs([ids])[0]  # one sequence per row
        assert torch.allclose(lp, alone, atol=1e-5), (lp - alone).abs().max()


def test_recomputed_layers_attend_by_the_same_boundaries(model_dir):
    """Gradient checkpointing recomputes each layer in backward, outside the forward call: the
    gradients must equal those without it (a recompute that attended across sequences would not)."""
    data = make_data([7, 12, 5, 16, 9, 11], seed=2)
    grads = []
    for ckpt in (False, True):
        engine = TorchEngine(model_dir, _role(gradient_checkpointing=ckpt), total_steps=1)
        engine.train_batch(data, nll_loss, n_loss_tokens)
        grads.append(torch.cat([p.detach().reshape(-1) for p in engine.model.parameters()]))
    assert torch.allclose(grads[0], grads[1], atol=1e-6)


def test_generation_still_uses_padding_masks_and_the_cache(tmp_path):
    from realcore.api.config import GenerationConfig, ModelConfig
    from realcore.backends.models import prepare_model

    engine = TorchEngine(prepare_model(ModelConfig(name="tiny", cache_dir=str(tmp_path)), seed=0), _role(),
                         total_steps=1)
    g = GenerationConfig(max_new_tokens=6, greedy=True)
    together = engine.generate([[1, 2, 3], [4, 5, 6, 7, 8, 9, 10]], g)
    alone = engine.generate([[1, 2, 3]], g)
    assert together[0].output_ids == alone[0].output_ids  # padded batch == alone: masks work in generation
    assert engine.model.config._attn_implementation == varlen_attention.NAME  # back to varlen after


def test_loss_sees_sequence_boundaries_and_groups_stay_together(model_dir):
    lens = [7, 12, 5, 20, 9, 11, 4, 8]
    data = make_data(lens, seed=3)
    rows = []

    def sequence_loss(logprobs, entropy, packed):
        """A sequence-level loss (GSPO-like: each sequence's mean masked log-prob, averaged)."""
        cu = packed["cu_seqlens"].tolist()
        rows.append([b - a for a, b in zip(cu[:-1], cu[1:])])
        assert cu[-1] == logprobs.numel()
        mask = packed["loss_mask"].float()
        per_seq = [(logprobs[a:b] * mask[a:b]).sum() / mask[a:b].sum() for a, b in zip(cu[:-1], cu[1:])]
        loss = -torch.stack(per_seq).mean()
        return loss, {"loss": loss.detach()}

    engine = TorchEngine(model_dir, _role(), total_steps=2)
    engine.train_batch(data, sequence_loss, lambda d: float(len(d["cu_seqlens"]) - 1))
    assert rows == [[7, 12, 5], [20, 9, 11], [4, 8]]  # greedy packing cuts the pair (5, 20)
    rows.clear()
    groups = [2, 2, 2, 2]  # pairs (DPO-style): each pair in one micro-batch
    engine.train_batch(data, sequence_loss, lambda d: float(len(d["cu_seqlens"]) - 1), group_sizes=groups)
    assert rows == [[7, 12], [5, 20], [9, 11, 4, 8]], rows
    rows.clear()
    engine.train_batch(data, sequence_loss, lambda d: float(len(d["cu_seqlens"]) - 1), group_sizes=[3, 3, 2],
                       n_minibatches=2)
    assert rows == [[7, 12, 5], [20, 9, 11], [4, 8]], rows  # minibatches of whole groups: 6 and 2 sequences


def test_one_train_batch_for_every_engine():
    import inspect

    from realcore.backends.fsdp_engine import FSDPEngine
    from realcore.backends.megatron.engine import MegatronEngine

    for engine in (TorchEngine, FSDPEngine, MegatronEngine):
        assert "return train_batch(self, data, loss_fn" in inspect.getsource(engine.train_batch), engine


def test_untrainable_role_refuses_train_batch(model_dir):
    engine = TorchEngine(model_dir, RoleConfig(backend="torch"), total_steps=1)
    with pytest.raises(ValueError, match="not trainable"):
        engine.train_batch(make_data([5], seed=0), nll_loss, n_loss_tokens)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="flash-attn's varlen kernel needs CUDA; the CPU path is tested above")
def test_flash_varlen_on_gpu_equals_one_forward_per_sequence(model_dir):
    pytest.importorskip("flash_attn", reason="flash-attn is not installed")
    engine = TorchEngine(model_dir, _role(dtype="bfloat16"), total_steps=1)
    assert varlen_attention._flash_varlen() is not None
    data = make_data([7, 12, 5, 16, 9], seed=1)
    for ids, lp in zip(data["input_ids"], engine.logprobs(data["input_ids"])):
        assert torch.allclose(lp, engine.logprobs([ids])[0], atol=2e-2)
