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

    def sequence_loss(out, packed):
        """A sequence-level loss (GSPO-like: each sequence's mean masked log-prob, averaged)."""
        logprobs = out.logprobs
        cu = packed["cu_seqlens"].tolist()
        assert out.cu_seqlens.tolist() == cu
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


# ---- the fused GPU kernels, their inputs checked by stand-ins on the CPU ----

LENS = [7, 12, 5, 16, 9]


def _reference(q, k, v, lens, scale):
    """Causal attention per sequence in float32: (T, H, D) from q (T, H, D), k/v (T, Hkv, D)."""
    out, start = [], 0
    for n in lens:
        sl = slice(start, start + n)
        qs, ks, vs = (t[sl].float().transpose(0, 1) for t in (q, k, v))  # (H, n, D)
        out.append(torch.nn.functional.scaled_dot_product_attention(
            qs, ks, vs, is_causal=True, scale=scale, enable_gqa=qs.shape[0] != ks.shape[0]).transpose(0, 1))
        start += n
    return torch.cat(out)


class StandIn:
    """Mocks a GPU-only kernel (flash-attn's `flash_attn_varlen_func`, or torch's `varlen_attn`, both
    CUDA-only) on the CPU: checks what it receives and computes the reference from it."""

    def __init__(self, kind: str):
        self.kind, self.calls = kind, []

    def __call__(self, q, k, v, cu_q, cu_k, max_q, max_k, **kw):
        self.calls.append({"dtypes": {q.dtype, k.dtype, v.dtype}, "cu": (cu_q.dtype, cu_q.device),
                           "same_cu": cu_q is cu_k, "max": (type(max_q), max_q, max_k), "kw": kw})
        lens = (cu_q[1:] - cu_q[:-1]).tolist()
        scale = kw["softmax_scale"] if self.kind == "flash" else kw["scale"]
        return _reference(q, k, v, lens, scale).to(q.dtype)


def _packed_qkv(seed: int = 0):
    """q (T, 4, 16) and k (T, 2, 16) in float32 and v in bf16, as HF's rotary leaves them under
    autocast, with their boundaries."""
    g = torch.Generator().manual_seed(seed)
    t = sum(LENS)
    q, k = torch.randn(t, 4, 16, generator=g), torch.randn(t, 2, 16, generator=g)
    v = torch.randn(t, 2, 16, generator=g).to(torch.bfloat16)
    return q, k, v, torch.tensor([0, *torch.tensor(LENS).cumsum(0).tolist()], dtype=torch.int32)


@pytest.fixture
def gpu_kernels(monkeypatch):
    """Pretend the CPU tensors are on a GPU where a fused kernel runs; which one: set by the test."""
    monkeypatch.setattr(varlen_attention, "_on_gpu", lambda t: True)
    monkeypatch.setattr(varlen_attention, "_logged", set())
    kernels = {"flash": StandIn("flash"), "torch": StandIn("torch")}
    monkeypatch.setattr(varlen_attention, "_flash_attn", lambda: kernels["flash"])
    monkeypatch.setattr(varlen_attention, "_torch_varlen", lambda: kernels["torch"])
    monkeypatch.setattr(varlen_attention, "_torch_varlen_runs_on", lambda index: True)
    return kernels, monkeypatch


@pytest.mark.parametrize("kind", ["flash", "torch"])
def test_fused_kernel_gets_compute_dtype_int32_bounds_a_host_max_and_causal(gpu_kernels, kind, caplog):
    """Under bf16 autocast, q and k in float32 beside a bf16 v (HF's rotary): the kernel gets all
    three in bf16, int32 boundaries on their device, the longest sequence as a host int, a causal
    mask, and its output (autocast's dtype) equals causal attention per sequence."""
    kernels, monkeypatch = gpu_kernels
    if kind == "torch":
        monkeypatch.setattr(varlen_attention, "_flash_attn", lambda: None)
    q, k, v, cu = _packed_qkv()
    caplog.set_level("INFO", logger="realcore.varlen_attention")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        for _ in range(3):  # three layers: the path is logged once
            out = varlen_attention.packed_causal_attention(q, k, v, cu, scale=0.25, max_len=max(LENS))
    calls = kernels[kind].calls
    assert len(calls) == 3 and not kernels["torch" if kind == "flash" else "flash"].calls
    c = calls[0]
    assert c["dtypes"] == {torch.bfloat16} and c["cu"] == (torch.int32, q.device) and c["same_cu"]
    assert c["max"] == (int, 16, 16)
    if kind == "flash":
        assert c["kw"] == {"dropout_p": 0.0, "softmax_scale": 0.25, "causal": True}
    else:  # torch's kernel: causal is the window (-1, 0); GQA (2 key/value heads for 4) natively
        assert c["kw"] == {"scale": 0.25, "window_size": (-1, 0), "enable_gqa": True}
    assert out.dtype == torch.bfloat16 and out.shape == q.shape
    ref = _reference(q.bfloat16(), k.bfloat16(), v, LENS, 0.25)
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=0)
    path = "flash_attn" if kind == "flash" else "torch_varlen"
    assert [r.getMessage() for r in caplog.records] == [f"packed attention: {path}"]


def test_fused_kernel_returns_the_query_dtype_without_autocast(gpu_kernels):
    """A bf16 model (no autocast): bf16 in, bf16 out; the longest sequence read from the
    boundaries when no caller gave it."""
    kernels, _ = gpu_kernels
    q, k, v, cu = _packed_qkv()
    out = varlen_attention.packed_causal_attention(q.bfloat16(), k.bfloat16(), v, cu, scale=None)
    assert out.dtype == torch.bfloat16 and kernels["flash"].calls[0]["max"] == (int, 16, 16)


def test_float32_dropout_and_the_cpu_take_sdpa(gpu_kernels, monkeypatch):
    """The fused kernels take fp16/bf16 only: a float32 role on a GPU attends with SDPA per sequence;
    torch's kernel has no dropout (flash-attn has); a CPU never calls a kernel."""
    kernels, _ = gpu_kernels
    q, k, v, cu = _packed_qkv()
    out = varlen_attention.packed_causal_attention(q, k, v.float(), cu, scale=0.25, max_len=16)
    assert not kernels["flash"].calls and not kernels["torch"].calls
    torch.testing.assert_close(out, _reference(q, k, v.float(), LENS, 0.25), atol=1e-5, rtol=0)
    monkeypatch.setattr(varlen_attention, "_flash_attn", lambda: None)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        varlen_attention.packed_causal_attention(q, k, v, cu, scale=0.25, dropout=0.1, max_len=16)
    assert not kernels["torch"].calls
    monkeypatch.setattr(varlen_attention, "_on_gpu", lambda t: t.is_cuda)  # the real check: a CPU tensor
    with torch.autocast("cpu", dtype=torch.bfloat16):
        varlen_attention.packed_causal_attention(q, k, v, cu, scale=0.25, max_len=16)
    assert not kernels["torch"].calls and not kernels["flash"].calls


def test_the_engine_hands_the_longest_sequence_as_a_host_int(model_dir, monkeypatch):
    """transformers passes packed_kwargs' max_length_q down to every layer: the fused kernels get
    the longest sequence of the micro-batch from the host, never read from the device."""
    seen = []
    real = varlen_attention.packed_causal_attention

    def spy(*args, max_len=None, **kwargs):
        seen.append(max_len)
        return real(*args, max_len=max_len, **kwargs)

    monkeypatch.setattr(varlen_attention, "packed_causal_attention", spy)
    engine = TorchEngine(model_dir, _role(), total_steps=1)
    engine.logprobs(make_data(LENS, seed=1)["input_ids"])
    assert seen and all(type(m) is int for m in seen)
    assert seen == [16, 16, 9, 9]  # 2 layers x micro-batches of <= 40 tokens: [7, 12, 5, 16], [9]


# ---- on a GPU ----

GPU = "needs 1 GPU (the fused varlen kernels are CUDA-only; the CPU path and their stand-ins run above)"


def _fused_path() -> str | None:
    if varlen_attention._flash_attn() is not None:
        return "flash_attn"
    if varlen_attention._torch_varlen() is not None and varlen_attention._torch_varlen_runs_on(
            torch.cuda.current_device()):
        return "torch_varlen"
    return None


@pytest.mark.gpu(1)
@pytest.mark.skipif(not torch.cuda.is_available(), reason=GPU)
def test_fused_kernel_on_a_gpu_matches_per_sequence_attention_without_a_host_sync():
    """The real kernel (flash-attn's where installed, else torch's): fp32 q/k and a bf16 v under
    autocast, as HF's rotary leaves them; no host sync in the call (CUDA's sync debug mode raises on
    one); its gradients are finite. On a GPU with neither kernel (flash-attn absent, compute
    capability < 8.0) the same call takes the per-sequence SDPA path (which reads the boundaries on
    the host) and must give the same numbers."""
    fused = _fused_path() is not None
    q, k, v, cu = (t.cuda() for t in _packed_qkv())
    q.requires_grad_(True)
    torch.cuda.synchronize()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        torch.cuda.set_sync_debug_mode("error" if fused else 0)
        try:
            out = varlen_attention.packed_causal_attention(q, k, v, cu, scale=0.25, max_len=max(LENS))
        finally:
            torch.cuda.set_sync_debug_mode(0)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), _reference(q.detach().bfloat16(), k.bfloat16(), v, LENS, 0.25),
                               atol=2e-2, rtol=0)
    out.float().square().sum().backward()
    assert q.grad is not None and torch.isfinite(q.grad).all()


@pytest.mark.gpu(1)
@pytest.mark.skipif(not torch.cuda.is_available(), reason=GPU)
def test_bf16_packed_logprobs_on_a_gpu_equal_one_forward_per_sequence(model_dir, monkeypatch, caplog):
    """dtype auto is bf16 on a GPU: packed rows through the fused kernel (named once in the log)
    give each sequence's log-probs alone, and a training step runs."""
    monkeypatch.setattr(varlen_attention, "_logged", set())
    caplog.set_level("INFO", logger="realcore.varlen_attention")
    engine = TorchEngine(model_dir, _role(), total_steps=1)
    assert engine.device.type == "cuda" and engine.dtype == torch.bfloat16
    data = make_data(LENS, seed=1)
    for ids, lp in zip(data["input_ids"], engine.logprobs(data["input_ids"])):
        assert lp.dtype == torch.float32 and lp.device.type == "cpu"
        torch.testing.assert_close(lp, engine.logprobs([ids])[0], atol=5e-2, rtol=0)
    stats = engine.train_batch(data, nll_loss, n_loss_tokens)
    assert all(torch.isfinite(torch.tensor(stats[k])) for k in ("loss", "grad_norm"))
    path = _fused_path() or "sdpa"
    assert f"packed attention: {path}" in [r.getMessage() for r in caplog.records]
