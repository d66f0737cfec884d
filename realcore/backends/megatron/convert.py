"""Weight conversion between HF Llama/Qwen2 checkpoints and Megatron-core GPTModel shards.

Pure tensor functions: no process group is needed, so the layout logic is testable alone.
Target layout is `GPTModel` built with `get_gpt_layer_local_spec()` (megatron-core 0.16.1):

    embedding.word_embeddings.weight                    first PP stage, vocab rows split over TP
    decoder.layers.{i}.input_layernorm.weight           replicated
    decoder.layers.{i}.self_attention.linear_qkv.weight fused QKV, per query group, split by groups
    decoder.layers.{i}.self_attention.linear_qkv.bias   (Qwen2 only) same layout as the weight
    decoder.layers.{i}.self_attention.linear_proj.weight split over the input dim
    decoder.layers.{i}.pre_mlp_layernorm.weight         replicated
    decoder.layers.{i}.mlp.linear_fc1.weight            [gate_r; up_r] per TP rank
    decoder.layers.{i}.mlp.linear_fc2.weight            split over the input dim
    decoder.final_layernorm.weight                      last PP stage
    output_layer.weight                                 last PP stage, vocab rows split over TP
    output_layer.weight, .bias                          value/score head (`head`): HF `score.weight`
                                                        (1, hidden) and `score.bias`, replicated over TP

Layer numbers `{i}` are local to the PP stage. Megatron's `*._extra_state` entries (TE/fp8
metadata, None without TransformerEngine) are neither produced nor read: load with
`strict=False` or ignore them. With tied embeddings and PP > 1 the last stage holds an
`output_layer.weight` copy of the embedding (Megatron keeps one and syncs it); with PP = 1 it
has no output layer. The vocab is not padded here: it must be divisible by TP (pad the
checkpoint beforehand if needed).
"""

import torch
import torch.nn.functional as F
from torch import Tensor

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen2_moe", "mixtral")
NORMALIZATION = "RMSNorm"  # every supported family's norm
# Where each MoE family keeps its router and experts (the hub/on-disk names transformers saves).
_MOE_NAMES = {
    "mixtral": {"block": "block_sparse_moe", "gate": "w1", "up": "w3", "down": "w2"},
    "qwen2_moe": {"block": "mlp", "gate": "gate_proj", "up": "up_proj", "down": "down_proj"},
}


def _dims(hf_config) -> tuple[int, int, int]:
    """(num_heads, num_kv_heads, head_dim) of an HF config."""
    nh = hf_config.num_attention_heads
    nkv = getattr(hf_config, "num_key_value_heads", None) or nh
    hd = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // nh
    return nh, nkv, hd


def _has_qkv_bias(hf_config) -> bool:
    return hf_config.model_type in ("qwen2", "qwen2_moe")


def num_experts(hf_config) -> int | None:
    """Routed experts of an MoE config (Qwen2-MoE `num_experts`, Mixtral `num_local_experts`)."""
    if hf_config.model_type not in _MOE_NAMES:
        return None
    return getattr(hf_config, "num_experts", None) or getattr(hf_config, "num_local_experts", None)


def _expert_ffn(hf_config) -> int:
    return getattr(hf_config, "moe_intermediate_size", None) or hf_config.intermediate_size


def _shared_ffn(hf_config) -> int:
    return getattr(hf_config, "shared_expert_intermediate_size", 0) or 0


def rope_base(hf_config) -> float:
    """HF rope theta (transformers 5 keeps it in `rope_parameters`)."""
    params = getattr(hf_config, "rope_parameters", None) or {}
    return float(params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0)))


def validate(hf_config, *, tp: int, pp: int) -> None:
    """Raise ValueError if this HF config cannot be sharded as TP x PP."""
    mt = getattr(hf_config, "model_type", None)
    if mt not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"unsupported architecture {mt!r}; supported: {SUPPORTED_MODEL_TYPES}")
    if mt == "llama" and (getattr(hf_config, "attention_bias", False) or getattr(hf_config, "mlp_bias", False)):
        raise ValueError("llama with attention_bias/mlp_bias is not supported")
    params = getattr(hf_config, "rope_parameters", None) or {}
    if params.get("rope_type", "default") != "default":
        raise ValueError(f"rope_type {params['rope_type']!r} is not supported (only 'default')")
    if tp < 1 or pp < 1:
        raise ValueError(f"tp and pp must be >= 1, got tp={tp} pp={pp}")
    nh, nkv, _ = _dims(hf_config)
    if nh % tp:
        raise ValueError(f"num_attention_heads={nh} is not divisible by tp={tp}")
    if nkv % tp:
        raise ValueError(f"num_key_value_heads={nkv} is not divisible by tp={tp}")
    if hf_config.num_hidden_layers % pp:
        raise ValueError(f"num_hidden_layers={hf_config.num_hidden_layers} is not divisible by pp={pp}")
    if hf_config.vocab_size % tp:
        raise ValueError(f"vocab_size={hf_config.vocab_size} is not divisible by tp={tp} (pad the vocab first)")
    experts = num_experts(hf_config)
    if experts is None and hf_config.intermediate_size % tp:
        raise ValueError(f"intermediate_size={hf_config.intermediate_size} is not divisible by tp={tp}")
    if experts is not None:
        if mt == "qwen2_moe" and (getattr(hf_config, "decoder_sparse_step", 1) != 1 or getattr(hf_config, "mlp_only_layers", [])):
            raise ValueError("qwen2_moe with dense layers (decoder_sparse_step != 1 or mlp_only_layers) is not supported")
        if _shared_ffn(hf_config) % tp:
            raise ValueError(f"shared_expert_intermediate_size={_shared_ffn(hf_config)} is not divisible by tp={tp}")


def mcore_config_from_hf(hf_config, **overrides):
    """A megatron `TransformerConfig` matching an HF Llama/Qwen2 config (CPU initialisation)."""
    # megatron on use: the launcher checks layouts with this module (via parallel.py) without it
    from megatron.core.transformer import TransformerConfig

    validate(hf_config, tp=1, pp=1)
    nh, nkv, hd = _dims(hf_config)
    kwargs = dict(
        num_layers=hf_config.num_hidden_layers,
        hidden_size=hf_config.hidden_size,
        num_attention_heads=nh,
        num_query_groups=nkv,
        kv_channels=hd,
        ffn_hidden_size=hf_config.intermediate_size,
        normalization=NORMALIZATION,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=_has_qkv_bias(hf_config),
        layernorm_epsilon=hf_config.rms_norm_eps,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        use_cpu_initialization=True,
    )
    experts = num_experts(hf_config)
    if experts is not None:
        kwargs.update(
            num_moe_experts=experts,
            moe_router_topk=hf_config.num_experts_per_tok,
            moe_ffn_hidden_size=_expert_ffn(hf_config),
            # Mixtral (and Qwen2-MoE with norm_topk_prob) renormalise the top-k probabilities: that
            # is a softmax over the top-k logits, Megatron's default. Otherwise softmax over all first.
            moe_router_pre_softmax=not (hf_config.model_type == "mixtral" or getattr(hf_config, "norm_topk_prob", False)),
            moe_aux_loss_coeff=0.0,  # the RL loss is the whole objective; add the aux loss in loss_fn if wanted
            moe_router_load_balancing_type="none",
            expert_tensor_parallel_size=1,  # experts are not split over TP (ETP=2 fails over gloo)
        )
        if _shared_ffn(hf_config):
            kwargs.update(moe_shared_expert_intermediate_size=_shared_ffn(hf_config), moe_shared_expert_gate=True)
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)


def layer_spec(hf_config, *, transformer_engine: bool = False):
    """The Megatron layer spec: local modules (run anywhere) with realcore's packed (THD) core
    attention, or TransformerEngine's (GPU; needed for context parallel attention). Both have the
    same parameter names for these models. The local spec's norms are torch's RMSNorm
    (`normalization`): without it megatron-core picks apex's FusedLayerNorm where apex is installed
    (GPU images), which asserts on RMSNorm."""
    from megatron.core.models.gpt import gpt_layer_specs  # megatron on use, as above

    from realcore.backends.megatron.varlen_attention import VarlenDotProductAttention  # imports megatron

    if transformer_engine:
        return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(
            num_experts=num_experts(hf_config), moe_grouped_gemm=False)
    spec = gpt_layer_specs.get_gpt_layer_local_spec(num_experts=num_experts(hf_config), moe_grouped_gemm=False,
                                                    normalization=NORMALIZATION)
    spec.submodules.self_attention.submodules.core_attention = VarlenDotProductAttention
    return spec


def block_spec(spec, config, vp_stage: int | None):
    """The decoder of one model chunk: `spec`'s layers (as many as this pipeline stage builds) and
    a final norm of the layers' own norm class. Given a layer spec alone, megatron-core picks the
    final norm itself (TransformerEngine's, else apex's FusedLayerNorm, which asserts on RMSNorm)."""
    # megatron on use, as above
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build

    return TransformerBlockSubmodules(layer_specs=[spec] * get_num_layers_to_build(config, vp_stage=vp_stage),
                                      layer_norm=spec.submodules.input_layernorm)


# TransformerEngine's spec fuses the pre-attention (and, dense MLP only, pre-MLP) norm into the
# following linear layer: same tensors, other names.
_TE_FUSED_NORMS = {
    "input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
    "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight",
}


def to_te_names(state: dict[str, Tensor], *, inverse: bool = False) -> dict[str, Tensor]:
    """Rename local-spec keys to TransformerEngine-spec keys (or back with `inverse`)."""
    pairs = [(b, a) for a, b in _TE_FUSED_NORMS.items()] if inverse else list(_TE_FUSED_NORMS.items())
    out = {}
    for key, value in state.items():
        for old, new in pairs:
            if key.endswith("." + old) and (old != "pre_mlp_layernorm.weight" or key.replace(old, "mlp.linear_fc1.weight") in state):
                key = key[: -len(old)] + new
                break
        out[key] = value
    return out


def _stage_layers(hf_config, pp: int, pp_rank: int) -> range:
    """Global layer indices held by one PP stage (even split)."""
    per = hf_config.num_hidden_layers // pp
    return range(pp_rank * per, (pp_rank + 1) * per)


def _fuse_qkv(q: Tensor, k: Tensor, v: Tensor, nh: int, nkv: int, hd: int) -> Tensor:
    """HF q/k/v (weights [out, in] or biases [out]) -> Megatron per-group fused layout."""
    tail = q.shape[1:]
    q = q.reshape(nkv, nh // nkv * hd, *tail)  # (ng, heads_per_group*hd, ...)
    k = k.reshape(nkv, hd, *tail)  # (ng, hd, ...)
    v = v.reshape(nkv, hd, *tail)
    return torch.cat([q, k, v], dim=1).reshape(-1, *tail)  # (ng*(hpg+2)*hd, ...)


def _split_qkv(fused: Tensor, nh: int, nkv: int, hd: int) -> tuple[Tensor, Tensor, Tensor]:
    """Inverse of `_fuse_qkv` for the full (TP-gathered) fused tensor."""
    tail = fused.shape[1:]
    hpg = nh // nkv
    g = fused.reshape(nkv, (hpg + 2) * hd, *tail)  # (ng, (hpg+2)*hd, ...)
    q, k, v = torch.split(g, [hpg * hd, hd, hd], dim=1)
    return q.reshape(-1, *tail), k.reshape(-1, *tail), v.reshape(-1, *tail)


def hf_to_mcore(
    hf_state: dict[str, Tensor], hf_config, *, tp: int, pp: int, tp_rank: int, pp_rank: int, ep: int = 1,
    ep_rank: int = 0, head: str = "policy",
) -> dict[str, Tensor]:
    """The Megatron-core GPTModel state dict of one (tp_rank, pp_rank, ep_rank) shard (contiguous
    clones). With MoE, an EP rank holds experts [ep_rank * E/ep, (ep_rank + 1) * E/ep), numbered
    from 0 locally (Megatron's `local_experts.{j}`). `head` value/score: the output layer is the
    checkpoint's `score.*` where it has one (a causal LM's has none: the engine initialises it)."""
    validate(hf_config, tp=tp, pp=pp)
    if not (0 <= tp_rank < tp and 0 <= pp_rank < pp):
        raise ValueError(f"rank (tp_rank={tp_rank}, pp_rank={pp_rank}) outside tp={tp} pp={pp}")
    nh, nkv, hd = _dims(hf_config)
    tied = bool(getattr(hf_config, "tie_word_embeddings", False))

    def col(t: Tensor) -> Tensor:  # column parallel: split output rows
        return t.chunk(tp, dim=0)[tp_rank].clone()

    def row(t: Tensor) -> Tensor:  # row parallel: split input columns
        return t.chunk(tp, dim=1)[tp_rank].clone()

    out: dict[str, Tensor] = {}
    embed = hf_state["model.embed_tokens.weight"]
    if pp_rank == 0:
        out["embedding.word_embeddings.weight"] = col(embed)
    for local, i in enumerate(_stage_layers(hf_config, pp, pp_rank)):
        h, m = f"model.layers.{i}.", f"decoder.layers.{local}."
        qkv = _fuse_qkv(
            hf_state[h + "self_attn.q_proj.weight"],
            hf_state[h + "self_attn.k_proj.weight"],
            hf_state[h + "self_attn.v_proj.weight"],
            nh, nkv, hd,
        )
        # Groups are contiguous in the fused layout, so a row chunk is whole groups.
        out[m + "self_attention.linear_qkv.weight"] = col(qkv)
        if _has_qkv_bias(hf_config):
            bias = _fuse_qkv(
                hf_state[h + "self_attn.q_proj.bias"],
                hf_state[h + "self_attn.k_proj.bias"],
                hf_state[h + "self_attn.v_proj.bias"],
                nh, nkv, hd,
            )
            out[m + "self_attention.linear_qkv.bias"] = col(bias)
        out[m + "self_attention.linear_proj.weight"] = row(hf_state[h + "self_attn.o_proj.weight"])
        out[m + "input_layernorm.weight"] = hf_state[h + "input_layernorm.weight"].clone()
        out[m + "pre_mlp_layernorm.weight"] = hf_state[h + "post_attention_layernorm.weight"].clone()
        if num_experts(hf_config) is not None:
            out.update(_moe_to_mcore(hf_state, hf_config, h, m, col, row, ep, ep_rank))
            continue
        # Each rank holds its slice of gate then its slice of up: (2*ffn/tp, hidden).
        gate, up = col(hf_state[h + "mlp.gate_proj.weight"]), col(hf_state[h + "mlp.up_proj.weight"])
        out[m + "mlp.linear_fc1.weight"] = torch.cat([gate, up], dim=0)
        out[m + "mlp.linear_fc2.weight"] = row(hf_state[h + "mlp.down_proj.weight"])
    if pp_rank == pp - 1:
        out["decoder.final_layernorm.weight"] = hf_state["model.norm.weight"].clone()
        if head != "policy":
            names = ["weight", "bias"] if head == "value" else ["weight"]  # sequence classification: no bias
            out.update({f"output_layer.{n}": hf_state[f"score.{n}"].clone() for n in names if f"score.{n}" in hf_state})
        elif not tied:
            out["output_layer.weight"] = col(hf_state["lm_head.weight"])
        elif pp > 1:  # Megatron keeps a synced copy of the embedding on the last stage
            out["output_layer.weight"] = col(embed)
    return out


def mcore_to_hf(shards: dict[tuple[int, int], dict[str, Tensor]], hf_config, *, tp: int, pp: int,
                head: str = "policy") -> dict[str, Tensor]:
    """Gather all (tp_rank, pp_rank) shards back into an HF state dict (`head` value/score: the
    output layer as `score.*`, no `lm_head`).

    With tied embeddings `lm_head.weight` is emitted as a copy of the embedding (HF's
    `state_dict()` lists it too); the last stage's output_layer copy is not read.
    """
    validate(hf_config, tp=tp, pp=pp)
    missing = [(t, p) for t in range(tp) for p in range(pp) if (t, p) not in shards]
    if missing:
        raise ValueError(f"missing shards for (tp_rank, pp_rank) {missing}")
    nh, nkv, hd = _dims(hf_config)
    tied = bool(getattr(hf_config, "tie_word_embeddings", False))

    def cat(p: int, key: str, dim: int) -> Tensor:
        return torch.cat([shards[(t, p)][key] for t in range(tp)], dim=dim)

    def rep(p: int, key: str) -> Tensor:  # replicated over TP: take rank 0
        return shards[(0, p)][key].clone()

    out: dict[str, Tensor] = {}
    out["model.embed_tokens.weight"] = cat(0, "embedding.word_embeddings.weight", 0)
    for p in range(pp):
        for local, i in enumerate(_stage_layers(hf_config, pp, p)):
            h, m = f"model.layers.{i}.", f"decoder.layers.{local}."
            q, k, v = _split_qkv(cat(p, m + "self_attention.linear_qkv.weight", 0), nh, nkv, hd)
            out[h + "self_attn.q_proj.weight"] = q
            out[h + "self_attn.k_proj.weight"] = k
            out[h + "self_attn.v_proj.weight"] = v
            if _has_qkv_bias(hf_config):
                qb, kb, vb = _split_qkv(cat(p, m + "self_attention.linear_qkv.bias", 0), nh, nkv, hd)
                out[h + "self_attn.q_proj.bias"] = qb
                out[h + "self_attn.k_proj.bias"] = kb
                out[h + "self_attn.v_proj.bias"] = vb
            out[h + "self_attn.o_proj.weight"] = cat(p, m + "self_attention.linear_proj.weight", 1)
            out[h + "input_layernorm.weight"] = rep(p, m + "input_layernorm.weight")
            out[h + "post_attention_layernorm.weight"] = rep(p, m + "pre_mlp_layernorm.weight")
            if num_experts(hf_config) is not None:
                out.update(_moe_to_hf(shards, hf_config, p, tp, h, m, cat))
                continue
            # Each rank's fc1 is [gate_r; up_r] (2*ffn/tp, hidden): un-interleave before concat.
            halves = [shards[(t, p)][m + "mlp.linear_fc1.weight"].chunk(2, dim=0) for t in range(tp)]
            out[h + "mlp.gate_proj.weight"] = torch.cat([g for g, _ in halves], dim=0)
            out[h + "mlp.up_proj.weight"] = torch.cat([u for _, u in halves], dim=0)
            out[h + "mlp.down_proj.weight"] = cat(p, m + "mlp.linear_fc2.weight", 1)
    out["model.norm.weight"] = rep(pp - 1, "decoder.final_layernorm.weight")
    if head != "policy":
        for n in ("weight", "bias"):
            if f"output_layer.{n}" in shards[(0, pp - 1)]:
                out[f"score.{n}"] = rep(pp - 1, f"output_layer.{n}")
    elif tied:
        out["lm_head.weight"] = out["model.embed_tokens.weight"].clone()
    else:
        out["lm_head.weight"] = cat(pp - 1, "output_layer.weight", 0)
    return out


def _moe_to_mcore(hf_state, hf_config, h: str, m: str, col, row, ep: int, ep_rank: int) -> dict[str, Tensor]:
    """Router, this EP rank's experts (whole: no TP split) and the TP-split shared expert."""
    names, experts = _MOE_NAMES[hf_config.model_type], num_experts(hf_config)
    if experts % ep or not 0 <= ep_rank < ep:
        raise ValueError(f"{experts} experts cannot be split as ep_rank {ep_rank} of ep={ep}")
    b, per = h + names["block"] + ".", experts // ep
    out = {m + "mlp.router.weight": hf_state[b + "gate.weight"].clone()}
    for j in range(per):
        e = f"{b}experts.{ep_rank * per + j}."
        x = f"{m}mlp.experts.local_experts.{j}."
        out[x + "linear_fc1.weight"] = torch.cat([hf_state[e + names["gate"] + ".weight"], hf_state[e + names["up"] + ".weight"]])
        out[x + "linear_fc2.weight"] = hf_state[e + names["down"] + ".weight"].clone()
    if _shared_ffn(hf_config):
        s = b + "shared_expert."
        out[m + "mlp.shared_experts.linear_fc1.weight"] = torch.cat(
            [col(hf_state[s + "gate_proj.weight"]), col(hf_state[s + "up_proj.weight"])])
        out[m + "mlp.shared_experts.linear_fc2.weight"] = row(hf_state[s + "down_proj.weight"])
        out[m + "mlp.shared_experts.gate_weight"] = hf_state[b + "shared_expert_gate.weight"].clone()
    return out


def _moe_to_hf(shards, hf_config, p: int, tp: int, h: str, m: str, cat) -> dict[str, Tensor]:
    """Inverse of `_moe_to_mcore` over TP shards holding every expert (an EP=1 view)."""
    names, experts = _MOE_NAMES[hf_config.model_type], num_experts(hf_config)
    b, first = h + names["block"] + ".", shards[(0, p)]
    out = {b + "gate.weight": first[m + "mlp.router.weight"].clone()}
    for j in range(experts):
        x = f"{m}mlp.experts.local_experts.{j}."
        gate, up = first[x + "linear_fc1.weight"].chunk(2, dim=0)
        e = f"{b}experts.{j}."
        out[e + names["gate"] + ".weight"] = gate.clone()
        out[e + names["up"] + ".weight"] = up.clone()
        out[e + names["down"] + ".weight"] = first[x + "linear_fc2.weight"].clone()
    if _shared_ffn(hf_config):
        s = b + "shared_expert."
        halves = [shards[(t, p)][m + "mlp.shared_experts.linear_fc1.weight"].chunk(2, dim=0) for t in range(tp)]
        out[s + "gate_proj.weight"] = torch.cat([g for g, _ in halves], dim=0)
        out[s + "up_proj.weight"] = torch.cat([u for _, u in halves], dim=0)
        out[s + "down_proj.weight"] = cat(p, m + "mlp.shared_experts.linear_fc2.weight", 1)
        out[b + "shared_expert_gate.weight"] = first[m + "mlp.shared_experts.gate_weight"].clone()
    return out
