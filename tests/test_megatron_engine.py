"""MegatronEngine on CPU over gloo against a single-process torch reference of the same HF weights.

For each mesh: forward log-probs, one step's gradients (gathered back to HF names) and a 5-step
loss trajectory must match (relative error < 1e-4). The reference is independent of packing and
micro-batching: one HF forward per sequence, the loss over all tokens at once; the trajectory
reference is the torch engine (same AdamW, clipping and LR schedule).
"""

import json
import os
import socket

import pytest
import torch
import torch.multiprocessing as mp

from conftest import import_unless_ci  # noqa: E402

import_unless_ci("megatron.core", "pip install -e '.[megatron]'")
from safetensors.torch import load_file, save_file  # noqa: E402

pytestmark = [pytest.mark.skipif(torch.cuda.is_available(), reason="CPU compatibility test"), pytest.mark.timeout(300)]

RTOL = 1e-4
STEPS = 5


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _hf_model(kind: str):
    from transformers import (MixtralConfig, MixtralForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen2MoeConfig,
                              Qwen2MoeForCausalLM)

    common = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=4, vocab_size=128,
                  rms_norm_eps=1e-6, max_position_embeddings=128)
    if kind == "qwen2_moe":  # routed experts (softmax over all, no renormalisation) + gated shared expert
        return Qwen2MoeForCausalLM(Qwen2MoeConfig(**common, intermediate_size=96, moe_intermediate_size=32,
                                                  shared_expert_intermediate_size=48, num_experts=4,
                                                  num_experts_per_tok=2, tie_word_embeddings=False))
    if kind == "mixtral":  # top-k renormalised
        return MixtralForCausalLM(MixtralConfig(**common, intermediate_size=32, num_local_experts=4,
                                                num_experts_per_tok=2, tie_word_embeddings=False))
    return Qwen2ForCausalLM(Qwen2Config(**common, intermediate_size=96, tie_word_embeddings=kind == "tied"))


def _hf_dir(root: str, kind: str) -> str:
    path = os.path.join(root, f"hf-{kind}")
    if os.path.exists(path):
        return path
    torch.manual_seed(0)
    model = _hf_model(kind)
    with torch.no_grad():  # random everything (default init leaves biases 0 and norms 1)
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.1 + (1.0 if p.ndim == 1 and p.shape[0] == 64 else 0.0))
    model.save_pretrained(path)
    return path


def _hub_names(grads: dict, mixtral: bool) -> dict:
    """transformers 5 fuses experts in memory (experts.gate_up_proj [E, 2f, h] = [gate; up],
    experts.down_proj [E, h, f]) and calls Mixtral's block `mlp`; checkpoints (and our conversion)
    keep one tensor per expert and Mixtral's `block_sparse_moe.experts.{j}.w1/w3/w2`."""
    gate_name, up_name, down_name = ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")
    out = {}
    for name, g in grads.items():
        if mixtral and (".mlp.gate." in name or ".mlp.experts." in name):
            name = name.replace(".mlp.", ".block_sparse_moe.")
        if name.endswith("experts.gate_up_proj"):
            block = name.rsplit(".", 1)[0]
            for j in range(g.shape[0]):
                out[f"{block}.{j}.{gate_name}.weight"], out[f"{block}.{j}.{up_name}.weight"] = g[j].chunk(2, dim=0)
        elif name.endswith("experts.down_proj"):
            block = name.rsplit(".", 1)[0]
            for j in range(g.shape[0]):
                out[f"{block}.{j}.{down_name}.weight"] = g[j]
        else:
            out[name] = g
    return out


def _data(seed: int = 3):
    gen = torch.Generator().manual_seed(seed)
    lens = [7, 12, 5, 16, 9, 11]
    ids = [torch.randint(0, 128, (n,), generator=gen) for n in lens]
    mask = [(torch.arange(n) >= 3).long() for n in lens]
    adv = [torch.full((n,), float(a)) for n, a in zip(lens, torch.randn(len(lens), generator=gen))]
    return {"input_ids": ids, "loss_mask": mask, "advantages": adv}


def _loss_fn(out, data):
    """Policy-gradient surrogate plus an entropy bonus: exercises log-prob and entropy gradients."""
    assert out.cu_seqlens.tolist() == data["cu_seqlens"].tolist()  # the boundaries of the packed sequences
    m = data["loss_mask"].float()
    pg = -(out.logprobs * data["advantages"] * m).sum() / m.sum()
    ent = (out.entropy * m).sum() / m.sum()
    loss = pg - 0.01 * ent
    return loss, {"loss": loss.detach(), "entropy": ent.detach()}


def _torch_loss_fn(*args):
    """_loss_fn for the torch engine under either contract: loss_fn(out, data), or the one before
    issue 44's engines, loss_fn(logprobs, entropy, data) (drop this once the torch engine has HeadOutput)."""
    from realcore.api.engine import HeadOutput

    if len(args) == 3:
        lp, ent, data = args
        return _loss_fn(HeadOutput(data["cu_seqlens"], logprobs=lp, entropy=ent), data)
    return _loss_fn(*args)


def _n_tokens(data):
    return float(data["loss_mask"].sum())


def _role(**megatron):
    from realcore.api.config import OptimizerConfig, RoleConfig

    # float32 against the float32 reference ("auto" would be bf16 on a GPU)
    return RoleConfig(backend="megatron", trainable=True, max_tokens_per_mb=24, megatron=megatron, dtype="float32",
                      optimizer=OptimizerConfig(lr=1e-2, warmup_steps=1, max_grad_norm=1.0))


def init_dist(rank: int, world: int, port: int) -> None:
    """The mesh's default group as a model worker makes it: on GPUs (one per rank) each rank selects
    cuda:rank first, then NCCL bound to it; on a CPU gloo."""
    if torch.cuda.device_count() >= world:
        torch.cuda.set_device(rank)
        torch.distributed.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                             world_size=world, device_id=torch.device("cuda", rank))
    else:
        torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                             world_size=world)


def _reference(hf_path: str, out: str):
    """Log-probs and grads from one HF forward per sequence; trajectory from the torch engine."""
    torch.set_num_threads(1)
    from realcore.backends.batching import token_logprobs
    from realcore.backends.torch_engine import TorchEngine

    engine = TorchEngine(hf_path, _role(), total_steps=STEPS)
    model, data, device = engine.model, _data(), engine.device  # the model's device: a GPU where there is one
    lps, ents = [], []
    for ids in data["input_ids"]:
        ids = ids.to(device)
        logits = model(input_ids=ids[None]).logits[0]
        starts = torch.zeros(len(ids), dtype=torch.bool, device=device)
        starts[0] = True
        lp, ent = token_logprobs(logits, ids, starts, 1.0, True)
        lps.append(lp)
        ents.append(ent)
    from realcore.api.engine import HeadOutput
    from realcore.backends.batching import cu_seqlens

    packed = {k: torch.cat(v).to(device) for k, v in data.items()}
    packed["cu_seqlens"] = cu_seqlens([len(x) for x in data["input_ids"]])
    loss, _ = _loss_fn(HeadOutput(packed["cu_seqlens"], logprobs=torch.cat(lps), entropy=torch.cat(ents)), packed)
    loss.backward()
    tensors = {f"lp.{i}": lp.detach().cpu() for i, lp in enumerate(lps)}
    hub = _hub_names({n: p.grad for n, p in model.named_parameters()}, model.config.model_type == "mixtral")
    tensors.update({f"grad.{n}": g.cpu().contiguous() for n, g in hub.items()})
    model.zero_grad(set_to_none=True)
    losses = [engine.train_batch(data, _torch_loss_fn, _n_tokens)["loss"] for _ in range(STEPS)]
    save_file(tensors, f"{out}/ref.st")
    with open(f"{out}/ref.json", "w") as f:
        json.dump(losses, f)


def _assert_close(actual, expected, what):
    err = (actual - expected).norm() / expected.norm().clamp_min(1e-12)
    assert err < RTOL, f"{what}: relative error {err:.2e}"


def _worker(rank, world, port, hf_path, out, mesh, megatron):
    torch.set_num_threads(1)
    from realcore.api.alloc import parse_mesh
    from realcore.backends.megatron.engine import MegatronEngine

    init_dist(rank, world, port)
    dims = parse_mesh(mesh)
    engine = MegatronEngine(hf_path, _role(**megatron), dims, total_steps=STEPS)
    from megatron.core import parallel_state as ps

    assert dims.dp_rank(rank) == ps.get_data_parallel_rank()  # the master's view of the mesh is Megatron's
    ref = load_file(f"{out}/ref.st")
    data = _data()
    for i, lp in enumerate(engine.logprobs(data["input_ids"])):
        _assert_close(lp, ref[f"lp.{i}"], f"logprobs[{i}]")
    # Each data-parallel replica trains on its own sequences; the gradient is the global mean.
    d = dims.dp_rank(rank)
    shard = {k: v[d::dims.dp] for k, v in data.items()}
    engine.forward_backward(shard, _loss_fn, _n_tokens)
    grads = engine.hf_state_dict(grads=True)
    full_grads = dims.dp == 1 or not megatron.get("distributed_optimizer", True)  # else sharded after reduce
    if rank == 0 and full_grads:
        tied = getattr(engine.hf_config, "tie_word_embeddings", False)
        for name, grad in grads.items():
            if not (tied and name == "lm_head.weight"):
                _assert_close(grad, ref[f"grad.{name}"], f"grad {name}")
    with open(f"{out}/ref.json") as f:
        expected = json.load(f)
    losses = [engine.train_batch(shard, _loss_fn, _n_tokens)["loss"] for _ in range(STEPS)]
    for step, (a, b) in enumerate(zip(losses, expected)):
        assert abs(a - b) <= RTOL * abs(b), f"step {step}: loss {a} vs reference {b} (all: {losses} vs {expected})"
    after = engine.logprobs(data["input_ids"])
    saved = f"{out}/saved-{mesh}"
    engine.save_hf(saved)
    torch.distributed.barrier()
    if rank == 0:  # the trained checkpoint loads in transformers and matches the engine's log-probs
        from realcore.api.config import RoleConfig
        from realcore.backends.torch_engine import TorchEngine

        reloaded = TorchEngine(saved, RoleConfig(backend="torch", dtype="float32"), total_steps=1)
        for a, b in zip(reloaded.logprobs(data["input_ids"]), after):
            _assert_close(a, b, "reloaded logprobs")
    torch.distributed.destroy_process_group()


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("megatron_engine"))


def _reference_dir(root: str, kind: str) -> tuple[str, str]:
    hf_path = _hf_dir(root, kind)
    out = os.path.join(root, f"ref-{kind}")
    if not os.path.exists(f"{out}/ref.json"):
        os.makedirs(out, exist_ok=True)
        ctx = mp.get_context("spawn")
        p = ctx.Process(target=_reference, args=(hf_path, out))
        p.start()
        p.join(120)
        assert p.exitcode == 0, "reference process failed"
    return hf_path, out


CASES = [
    ("d1p1t2", "untied", {}),  # TP=2 with sequence parallel
    ("d1p2t1", "tied", {}),  # PP=2 1F1B, tied embeddings synced across stages
    ("d1p2t2", "tied", {}),  # TP=2 x PP=2
    ("d2p1t2", "untied", {"distributed_optimizer": False}),  # DP=2 x TP=2 (full grads readable on replica 0)
    ("d2p1t2", "untied", {}),  # ... and the distributed optimizer (trajectory only differs if it is wrong)
    # Interleaved 1F1B: 2 model chunks per PP rank (4 layers = 4 virtual stages), p2p unbatched
    ("d1p2t1", "tied", {"virtual_pipeline_stages": 2, "batch_p2p_comm": False, "overlap_p2p_comm": True}),
    ("d2p1t1e2", "qwen2_moe", {"distributed_optimizer": False}),  # EP=2: 2 experts per rank, DP=2 for the rest
    ("d1p2t2e2", "mixtral", {"distributed_optimizer": False}),  # EP=2 over the TP ranks, PP=2, SP
]


@pytest.mark.parametrize("mesh,kind,megatron", CASES, ids=[f"{m}-{k}-{i}" for i, (m, k, _) in enumerate(CASES)])
def test_engine_matches_reference(root, mesh, kind, megatron):
    from realcore.api.alloc import parse_mesh

    hf_path, out = _reference_dir(root, kind)
    os.environ["OMP_NUM_THREADS"] = "1"
    world = parse_mesh(mesh).world_size
    mp.spawn(_worker, args=(world, _free_port(), hf_path, out, mesh, megatron), nprocs=world, join=True)


def _layer_calls(engine) -> list[int]:
    """Count forward calls of every transformer layer of the engine (Megatron's recompute calls the layers
    again, hooks included)."""
    from megatron.core.transformer.transformer_layer import TransformerLayer

    calls = [0]
    for chunk in engine.chunks:
        for m in chunk.modules():
            if isinstance(m, TransformerLayer):
                m.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    return calls


def _recompute_worker(rank, world, port, hf_path, mesh):
    """gradient_checkpointing: the same gradients and losses, every layer run twice per micro-batch in training;
    a call's max_tokens_per_mb: more micro-batches, the same log-probs."""
    torch.set_num_threads(1)
    from realcore.api.alloc import parse_mesh
    from realcore.backends.batching import split_by_budget
    from realcore.backends.megatron.engine import MegatronEngine

    init_dist(rank, world, port)
    dims, data = parse_mesh(mesh), _data()
    n_mb = len(split_by_budget([len(x) for x in data["input_ids"]], 24))
    plain = MegatronEngine(hf_path, _role(), dims, total_steps=STEPS)
    ckpt = MegatronEngine(hf_path, _role().model_copy(update={"gradient_checkpointing": True}), dims, total_steps=STEPS)
    assert plain.config.recompute_granularity is None and ckpt.config.recompute_granularity == "full"
    layers = plain.config.num_layers // dims.pp  # layers on this rank
    calls = {"plain": _layer_calls(plain), "ckpt": _layer_calls(ckpt)}
    stats = {k: e.forward_backward(data, _loss_fn, _n_tokens) for k, e in (("plain", plain), ("ckpt", ckpt))}
    assert calls["plain"][0] == n_mb * layers and calls["ckpt"][0] == 2 * n_mb * layers, (calls, n_mb, layers)
    assert stats["ckpt"]["loss"] == pytest.approx(stats["plain"]["loss"], rel=1e-6)
    grads = {"plain": plain.hf_state_dict(grads=True), "ckpt": ckpt.hf_state_dict(grads=True)}
    if rank == 0:
        for name, g in grads["plain"].items():
            _assert_close(grads["ckpt"][name], g, f"grad {name}")
    losses = {k: [e.train_batch(data, _loss_fn, _n_tokens)["loss"] for _ in range(2)]
              for k, e in (("plain", plain), ("ckpt", ckpt))}
    assert losses["ckpt"] == pytest.approx(losses["plain"], rel=RTOL), losses

    # A per-call budget (an MFC's max_tokens_per_mb) changes the split of that call only.
    calls["plain"][0] = 0
    default = plain.logprobs(data["input_ids"])
    assert calls["plain"][0] == n_mb * layers
    calls["plain"][0] = 0
    small = plain.logprobs(data["input_ids"], max_tokens_per_mb=12)
    n_small = len(split_by_budget([len(x) for x in data["input_ids"]], 12))
    assert n_small > n_mb and calls["plain"][0] == n_small * layers
    for a, b in zip(small, default):
        _assert_close(a, b, "logprobs with max_tokens_per_mb=12")
    torch.distributed.destroy_process_group()


def test_gradient_checkpointing_and_call_budget(root):
    """TP=2 with sequence parallel (the RNG tracker and SP gathers run again in the recompute)."""
    hf_path = _hf_dir(root, "untied")
    os.environ["OMP_NUM_THREADS"] = "1"
    mp.spawn(_recompute_worker, args=(2, _free_port(), hf_path, "d1p1t2"), nprocs=2, join=True)
