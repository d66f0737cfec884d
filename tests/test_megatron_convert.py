"""HF <-> Megatron-core GPTModel weight conversion (realcore/backends/megatron/convert.py).

Round trips over TP=2 x PP=2 are exact; the TP=1/PP=1 conversion is checked against a real
megatron GPTModel (key set, shapes, and logits equal to the HF model's).
"""

import contextlib
import socket

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from realcore.backends.megatron.convert import hf_to_mcore, mcore_config_from_hf, mcore_to_hf, rope_base

torch.set_num_threads(1)

FAMILIES = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM)}
CASES = [(fam, tied) for fam in FAMILIES for tied in (True, False)]


def _hf_config(family: str, tied: bool):
    cfg_cls, _ = FAMILIES[family]
    return cfg_cls(
        hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
        num_hidden_layers=4, vocab_size=128, tie_word_embeddings=tied, rms_norm_eps=1e-6,
        max_position_embeddings=64,
    )


def _hf_model(family: str, tied: bool):
    """Tiny HF model with every parameter random (default init leaves biases 0 and norms 1)."""
    cfg = _hf_config(family, tied)
    torch.manual_seed(0)
    model = FAMILIES[family][1](cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.1 + (1.0 if p.ndim == 1 and p.shape[0] == 64 else 0.0))
    return cfg, model


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def mcore():
    """Single-process gloo group + Megatron parallel state (TP=1, PP=1)."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    own = not dist.is_initialized()
    if own:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)
    yield
    parallel_state.destroy_model_parallel()
    if own:
        dist.destroy_process_group()


def _gpt_model(cfg, tied: bool):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    return GPTModel(
        config=mcore_config_from_hf(cfg), transformer_layer_spec=get_gpt_layer_local_spec(),
        vocab_size=cfg.vocab_size, max_sequence_length=cfg.max_position_embeddings,
        position_embedding_type="rope", rotary_base=rope_base(cfg), share_embeddings_and_output_weights=tied,
    ).eval()


def _real_shapes(model) -> dict[str, tuple]:
    return {k: tuple(v.shape) for k, v in model.state_dict().items() if not k.endswith("._extra_state")}


@pytest.mark.parametrize("family,tied", CASES)
def test_round_trip_tp2_pp2_exact(family, tied):
    cfg, model = _hf_model(family, tied)
    hf = model.state_dict()
    shards = {(t, p): hf_to_mcore(hf, cfg, tp=2, pp=2, tp_rank=t, pp_rank=p) for t in range(2) for p in range(2)}
    back = mcore_to_hf(shards, cfg, tp=2, pp=2)
    assert set(back) == set(hf)
    for k in hf:
        assert torch.equal(back[k], hf[k]), k


@pytest.mark.parametrize("head", ["value", "score"])
def test_head_round_trip_tp2_pp2_exact(head):
    """A classification model's `score.*` is the last stage's output layer, whole on every TP rank."""
    from transformers import Qwen2ForSequenceClassification, Qwen2ForTokenClassification

    cfg = _hf_config("qwen2", True)
    cfg.num_labels = 1
    torch.manual_seed(0)
    hf = (Qwen2ForTokenClassification if head == "value" else Qwen2ForSequenceClassification)(cfg).state_dict()
    assert ("score.bias" in hf) == (head == "value")  # token classification has a bias by default
    shards = {(t, p): hf_to_mcore(hf, cfg, tp=2, pp=2, tp_rank=t, pp_rank=p, head=head) for t in range(2) for p in range(2)}
    for t in range(2):
        assert torch.equal(shards[(t, 1)]["output_layer.weight"], hf["score.weight"])
        assert "output_layer.weight" not in shards[(t, 0)]
    back = mcore_to_hf(shards, cfg, tp=2, pp=2, head=head)
    assert set(back) == set(hf)
    for k in hf:
        assert torch.equal(back[k], hf[k]), k


def test_head_from_a_causal_lm_has_no_output_layer():
    """A causal LM has no score: the engine initialises the head (its lm_head is not read)."""
    cfg, model = _hf_model("qwen2", False)
    shard = hf_to_mcore(model.state_dict(), cfg, tp=1, pp=1, tp_rank=0, pp_rank=0, head="value")
    assert "output_layer.weight" not in shard and "decoder.final_layernorm.weight" in shard


@pytest.mark.parametrize("family,tied", CASES)
def test_shard_keys_and_shapes_match_real_gptmodel(mcore, family, tied):
    cfg, model = _hf_model(family, tied)
    real = _real_shapes(_gpt_model(cfg, tied))
    conv = hf_to_mcore(model.state_dict(), cfg, tp=1, pp=1, tp_rank=0, pp_rank=0)
    assert {k: tuple(v.shape) for k, v in conv.items()} == real

    # TP=2 x PP=2: each stage holds 2 local layers; split dims are halved.
    col = ("word_embeddings", "linear_qkv", "linear_fc1", "output_layer")
    row = ("linear_proj", "linear_fc2")
    for p in range(2):
        for t in range(2):
            shard = hf_to_mcore(model.state_dict(), cfg, tp=2, pp=2, tp_rank=t, pp_rank=p)
            expect = {}
            for k, shape in real.items():
                if k.startswith("decoder.layers."):
                    if int(k.split(".")[2]) >= 2:
                        continue
                elif k.startswith("embedding.") and p != 0:
                    continue
                elif (k.startswith("decoder.final") or k.startswith("output_layer")) and p != 1:
                    continue
                shape = list(shape)
                if any(c in k for c in col):
                    shape[0] //= 2
                if any(r in k for r in row):
                    shape[1] //= 2
                expect[k] = tuple(shape)
            if tied and p == 1:  # Megatron's last stage keeps a synced copy of the embedding
                expect["output_layer.weight"] = (64, 64)
            assert {k: tuple(v.shape) for k, v in shard.items()} == expect, (t, p)


def test_qkv_and_fc1_tp_layout():
    """Rank r holds whole query groups [q heads of g; k_g; v_g] and [gate_r; up_r]."""
    cfg = _hf_config("qwen2", False)
    _, model = _hf_model("qwen2", False)
    hf = model.state_dict()
    hd = 16
    for name in ("q", "k", "v"):  # tag each output row with (proj, row index)
        w = hf[f"model.layers.0.self_attn.{name}_proj.weight"]
        tag = {"q": 1000, "k": 2000, "v": 3000}[name]
        w.copy_((tag + torch.arange(w.shape[0], dtype=w.dtype)).unsqueeze(1).expand_as(w))
    for name, tag in (("gate", 1000), ("up", 2000)):
        w = hf[f"model.layers.0.mlp.{name}_proj.weight"]
        w.copy_((tag + torch.arange(w.shape[0], dtype=w.dtype)).unsqueeze(1).expand_as(w))
    for r in range(2):  # 2 groups of 2 q heads; TP=2 -> one group per rank
        shard = hf_to_mcore(hf, cfg, tp=2, pp=1, tp_rank=r, pp_rank=0)
        rows = shard["decoder.layers.0.self_attention.linear_qkv.weight"][:, 0]
        expect = torch.cat([
            1000 + torch.arange(r * 2 * hd, (r + 1) * 2 * hd),  # q heads 2r, 2r+1
            2000 + torch.arange(r * hd, (r + 1) * hd),  # k of group r
            3000 + torch.arange(r * hd, (r + 1) * hd),  # v of group r
        ]).float()
        assert torch.equal(rows, expect)
        fc1 = shard["decoder.layers.0.mlp.linear_fc1.weight"][:, 0]
        expect = torch.cat([1000 + torch.arange(r * 48, (r + 1) * 48), 2000 + torch.arange(r * 48, (r + 1) * 48)])
        assert torch.equal(fc1, expect.float())


@pytest.mark.parametrize("family,tied", CASES)
def test_logits_match_hf(mcore, family, tied):
    """The TP=1/PP=1 conversion loaded into a real GPTModel gives the HF model's logits."""
    from megatron.core import tensor_parallel

    cfg, model = _hf_model(family, tied)
    gpt = _gpt_model(cfg, tied)
    conv = hf_to_mcore(model.state_dict(), cfg, tp=1, pp=1, tp_rank=0, pp_rank=0)
    gpt.load_state_dict(conv, strict=False)  # strict=False: `_extra_state` keys are not produced
    for k, v in gpt.state_dict().items():
        if not k.endswith("._extra_state"):
            assert torch.equal(v, conv[k]), k
    torch.manual_seed(1)
    ids = torch.randint(0, cfg.vocab_size, (2, 16))
    pos = torch.arange(16).unsqueeze(0).expand(2, -1)
    causal = torch.triu(torch.ones(1, 1, 16, 16, dtype=torch.bool), diagonal=1)  # True = masked
    # Minimal CUDA shims for a CPU forward (rotary moves inv_freq to current_device; attention
    # dropout forks the CUDA RNG tracker -- dropout is 0 in eval, so RNG does not matter).
    with pytest.MonkeyPatch.context() as mp, torch.no_grad():
        mp.setattr(torch.cuda, "current_device", lambda: torch.device("cpu"))
        mp.setattr(tensor_parallel.get_cuda_rng_tracker(), "fork", lambda name=None: contextlib.nullcontext())
        logits = gpt(ids, pos, causal)  # (b, s, vocab)
        ref = model(ids).logits
    assert logits.shape == ref.shape
    torch.testing.assert_close(logits, ref, atol=1e-4, rtol=0)


def test_local_spec_norms_are_torch_rmsnorm_even_where_apex_is_installed(mcore, monkeypatch):
    """Where apex is installed (GPU images) megatron-core's default norm is apex's FusedLayerNorm,
    which asserts on RMSNorm: every norm of realcore's local spec, the decoder's final one included,
    must be torch's RMSNorm whatever megatron-core's default is (mocked here: no apex on CPU)."""
    from megatron.core.models import backends
    from megatron.core.models.gpt import GPTModel, gpt_layer_specs
    from megatron.core.transformer import transformer_block
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    from realcore.backends.megatron.convert import block_spec, layer_spec

    class ApexNorm(torch.nn.Module):
        def __init__(self, *args, **kwargs):
            raise AssertionError("apex's FusedLayerNorm: RMSNorm is not supported")

    for module, name in ((backends, "LNImpl"), (gpt_layer_specs, "LNImpl"), (transformer_block, "LayerNormImpl")):
        monkeypatch.setattr(module, name, ApexNorm)
    cfg = _hf_config("llama", False)
    config = mcore_config_from_hf(cfg)
    spec = block_spec(layer_spec(cfg), config, None)
    assert len(spec.layer_specs) == cfg.num_hidden_layers and spec.layer_norm is WrappedTorchNorm
    assert spec.layer_specs[0].submodules.input_layernorm is WrappedTorchNorm
    assert spec.layer_specs[0].submodules.pre_mlp_layernorm is WrappedTorchNorm
    gpt = GPTModel(config=config, transformer_layer_spec=spec, vocab_size=cfg.vocab_size,
                   max_sequence_length=cfg.max_position_embeddings, position_embedding_type="rope")
    norms = [m for m in gpt.modules() if isinstance(m, torch.nn.RMSNorm)]
    assert len(norms) == 2 * cfg.num_hidden_layers + 1 and isinstance(gpt.decoder.final_layernorm, torch.nn.RMSNorm)
    conv = hf_to_mcore(_hf_model("llama", False)[1].state_dict(), cfg, tp=1, pp=1, tp_rank=0, pp_rank=0)
    missing, unexpected = gpt.load_state_dict(conv, strict=False)  # the same parameter names
    assert not unexpected and all(k.endswith("_extra_state") for k in missing)


def test_validation_errors():
    cfg = _hf_config("llama", False)
    hf = {}
    with pytest.raises(ValueError, match="num_attention_heads=4 is not divisible by tp=3"):
        hf_to_mcore(hf, cfg, tp=3, pp=1, tp_rank=0, pp_rank=0)
    with pytest.raises(ValueError, match="num_key_value_heads=2 is not divisible by tp=4"):
        hf_to_mcore(hf, cfg, tp=4, pp=1, tp_rank=0, pp_rank=0)
    with pytest.raises(ValueError, match="num_hidden_layers=4 is not divisible by pp=3"):
        hf_to_mcore(hf, cfg, tp=1, pp=3, tp_rank=0, pp_rank=0)
    odd = _hf_config("llama", False)
    odd.vocab_size = 127
    with pytest.raises(ValueError, match="vocab_size=127 is not divisible by tp=2"):
        hf_to_mcore(hf, odd, tp=2, pp=1, tp_rank=0, pp_rank=0)
    with pytest.raises(ValueError, match="outside"):
        hf_to_mcore(hf, cfg, tp=2, pp=1, tp_rank=2, pp_rank=0)
    from transformers import GPT2Config

    with pytest.raises(ValueError, match="unsupported architecture 'gpt2'"):
        hf_to_mcore(hf, GPT2Config(), tp=1, pp=1, tp_rank=0, pp_rank=0)
    with pytest.raises(ValueError, match="missing shards"):
        mcore_to_hf({}, cfg, tp=1, pp=1)


def _tp2_worker(rank: int, port: int) -> None:
    """One of 2 TP ranks: load its shard into a real TP=2 GPTModel and compare gathered logits."""
    import torch.distributed as dist
    from megatron.core import parallel_state, tensor_parallel

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    parallel_state.initialize_model_parallel(2, 1)
    torch.cuda.current_device = lambda: torch.device("cpu")  # see test_logits_match_hf
    tensor_parallel.get_cuda_rng_tracker().fork = lambda name=None: contextlib.nullcontext()
    try:
        for family, tied in (("qwen2", False), ("llama", True)):
            cfg, model = _hf_model(family, tied)
            gpt = _gpt_model(cfg, tied)
            shard = hf_to_mcore(model.state_dict(), cfg, tp=2, pp=1, tp_rank=rank, pp_rank=0)
            missing, unexpected = gpt.load_state_dict(shard, strict=False)
            assert not unexpected and all(k.endswith("._extra_state") for k in missing), (missing, unexpected)
            torch.manual_seed(1)
            ids = torch.randint(0, cfg.vocab_size, (2, 16))
            pos = torch.arange(16).unsqueeze(0).expand(2, -1)
            causal = torch.triu(torch.ones(1, 1, 16, 16, dtype=torch.bool), diagonal=1)
            with torch.no_grad():
                local = gpt(ids, pos, causal).contiguous()  # (b, s, vocab/tp): vocab-parallel logits
                parts = [torch.empty_like(local) for _ in range(2)]
                dist.all_gather(parts, local)
                ref = model(ids).logits
            torch.testing.assert_close(torch.cat(parts, dim=-1), ref, atol=1e-4, rtol=0)
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


def test_logits_match_hf_tp2():
    """TP=2 shards loaded into a real 2-process TP=2 GPTModel (gloo) give the HF logits."""
    torch.multiprocessing.spawn(_tp2_worker, args=(_free_port(),), nprocs=2, join=True)
